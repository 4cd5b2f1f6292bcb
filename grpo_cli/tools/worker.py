"""One reward function in its own process, so a call that overruns `rewards[i].timeout_s` can be killed.

A checker stuck on a pathological string, or a user's function in an endless loop, cannot be
interrupted inside the trainer's process (a thread cannot be killed, and SIGALRM would land in
whatever torch or vLLM is doing). So each reward with a time limit gets a worker: a spawned
process that imports the function by name once and then answers calls over a pipe. A call that
does not answer in time has its worker killed; the next call starts a fresh one.

The worker ignores Ctrl-C (the trainer decides when to stop) and exits when the trainer's end of
the pipe closes, so a killed trainer leaves no worker behind.
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import signal
import sys
import time
from typing import Any

from grpo_cli.errors import Unreachable, UsageError, one_line

START_TIMEOUT_S = 120.0  # a worker's import of its module (e.g. math-verify, sympy) must finish in this time


def import_function(name: str, what: str) -> Any:
    """The callable named "package.module:function" (a custom reward or tool: `what`), imported from the
    Python path, the working directory included (like `python -m`)."""
    module_name, _, func_name = name.partition(":")
    if not module_name or not func_name:
        raise UsageError(f"{what} '{name}' must look like package.module:function")
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise UsageError(f"{what} '{name}': cannot import module '{module_name}' ({e}); "
                           "check the name and that it is importable from here") from None
    except Exception as e:
        raise UsageError(f"{what} '{name}': importing '{module_name}' failed: {type(e).__name__}: {e}") from None
    fn = getattr(module, func_name, None)
    if fn is None:
        raise UsageError(f"{what} '{name}': module '{module_name}' has no function '{func_name}'")
    if not callable(fn):
        raise UsageError(f"{what} '{name}': '{func_name}' in '{module_name}' is not callable")
    return fn


def start_limit(within_s: float | None) -> float:
    """The seconds a worker may take to start: START_TIMEOUT_S, or less where the call has less (a tool call's
    share of its step's budget, issue 54)."""
    return START_TIMEOUT_S if within_s is None else max(min(START_TIMEOUT_S, within_s), 0.001)


def call_limit(limit_s: float, within_s: float | None, spent_s: float) -> float:
    """A call's own time limit once its worker is up: `limit_s`, cut to what is left of `within_s` after the
    `spent_s` its start took."""
    return limit_s if within_s is None else max(min(limit_s, within_s - spent_s), 0.001)


def _serve(conn: Any, fn: Any) -> None:
    """The worker's loop: answer (completions, kwargs) with a tagged result. `fn` arrived pickled by
    reference (module and name), so unpickling it imported its module in this process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn.send(("ready", None))
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):  # the trainer is gone
            return
        if request is None:
            return
        completions, kwargs = request
        result = call_in_process(fn, completions, kwargs)
        try:
            conn.send(result)
        except Exception as e:  # values pickle cannot carry back (a generator's frames, a lock, ...)
            conn.send(("type", f"returned values that cannot be sent back: {one_line(e, 240)}"))


def call_in_process(fn: Any, completions: list, kwargs: dict[str, Any]) -> tuple[str, Any]:
    """("ok", values) | ("raised", reason) | ("unreachable", reason) | ("type", reason): one call, its failure
    told apart."""
    try:
        out = fn(completions, **kwargs)
    except Unreachable as e:  # a learned reward's server: every sample of the call fails, none is retried alone
        return "unreachable", one_line(e, 240)
    except (Exception, SystemExit) as e:  # SystemExit: argparse on a malformed argument, sys.exit() (issue 54)
        return "raised", f"raised {one_line(e, 240)}"
    if isinstance(out, str | bytes | dict) or not hasattr(out, "__iter__"):
        return "type", f"returned {type(out).__name__}, not a list of numbers"
    try:
        return "ok", list(out)
    except Exception as e:
        return "raised", f"raised while its result was read: {one_line(e, 240)}"


class WorkerDied(Exception):
    """A worker's transport: the child died, or could not be reached (a "raised" failure, worker killed); its
    message says how."""


class Malformed(Exception):
    """A worker's transport: what came back cannot be what the function returned (a "type" failure, worker
    killed)."""


class Worker:
    """One function in a killable child process: the one call protocol of every worker (a reward's, a tool's, an
    environment's, a sandboxed one's). Started on the first call within its start limit (`start_limit`), each
    call within its limit (`call_limit`: the worker's own, cut to what is left of `within_s`), a call past it
    kills the worker (the next call starts a fresh one), and each failure is one of ("raised" | "type" |
    "timeout", reason). How the child is launched and how a call travels are its transport's: `_launch`,
    `_exchange`, `alive` and `_stop` (RewardWorker: a spawned Python process, pickles over a pipe;
    tools.sandbox_worker.SandboxedWorker: a bwrap sandbox, JSON frames that are never unpickled)."""

    def __init__(self, name: str, fn: Any, timeout_s: float) -> None:
        self.name, self.fn, self.timeout_s = name, fn, timeout_s
        self.starts = 0  # worker processes started so far (a restart loses what the last one held)

    def twin(self, name: str) -> Worker:
        """Another worker of the same function, limit and transport (the tool pool runs several side by side)."""
        return type(self)(name, self.fn, self.timeout_s)

    def call(self, completions: list, kwargs: dict[str, Any], timeout_s: float | None = None,
             within_s: float | None = None) -> tuple[str, Any]:
        """("ok", values) | ("raised" | "type" | "timeout", reason), within timeout_s seconds of the call (the
        worker's own limit unless given); `within_s`: a bound on the whole of it, a worker's start included."""
        asked = time.monotonic()
        if not self.alive():
            self.starts += 1
            if (failure := self._launch(start_limit(within_s))) is not None:
                return failure
        limit = call_limit(timeout_s or self.timeout_s, within_s, time.monotonic() - asked)
        try:
            return self._exchange(completions, kwargs, limit)
        except TimeoutError:
            self.kill()
            return "timeout", f"timed out after {limit:g} s (worker killed)"
        except WorkerDied as e:
            self.kill()
            return "raised", str(e)
        except Malformed as e:
            self.kill()
            return "type", str(e)

    def kill(self) -> None:
        """Stop the child at once, whatever it is doing; the next call starts a fresh one."""
        self._stop()

    def close(self) -> None:
        """End the worker (the transport may ask it to exit first)."""
        self.kill()

    # a transport's part
    def alive(self) -> bool:
        raise NotImplementedError

    def _launch(self, within_s: float) -> tuple[str, Any] | None:
        """Start the child within `within_s`: None when it is ready, else the failure to report."""
        raise NotImplementedError

    def _exchange(self, completions: list, kwargs: dict[str, Any], limit_s: float) -> tuple[str, Any]:
        """Send one call and read its tagged answer within `limit_s`: TimeoutError past it, WorkerDied,
        Malformed; a failure before anything was sent (inputs it cannot carry) is returned as it is."""
        raise NotImplementedError

    def _stop(self) -> None:
        raise NotImplementedError


class RewardWorker(Worker):
    """A spawned Python process running one function, its calls pickled over a pipe (the trainer's own code:
    its answers may be unpickled)."""

    def __init__(self, name: str, fn: Any, timeout_s: float) -> None:
        super().__init__(name, fn, timeout_s)
        self.process: Any = None
        self.conn: Any = None

    def alive(self) -> bool:
        return self.process is not None and self.process.is_alive()

    def _launch(self, within_s: float = START_TIMEOUT_S) -> tuple[str, Any] | None:
        ctx = multiprocessing.get_context("spawn")  # fork would copy the trainer's threads and locks
        parent, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child, self.fn), daemon=True,
                                   name=f"grpo-reward-{self.name}")
        try:
            self.process.start()
        except Exception as e:  # a function pickle cannot name (a lambda, a closure): no worker for it
            self.process = None
            parent.close()
            child.close()
            return "raised", f"cannot run in a worker ({one_line(e, 240)}); define it at module level, or set timeout_s: null"
        child.close()
        self.conn = parent
        if not parent.poll(within_s):
            self.kill()
            return "timeout", f"its worker did not start within {within_s:g} s"
        try:
            tag, reason = parent.recv()
        except (EOFError, OSError):
            self.kill()
            return "raised", "its worker died while starting"
        if tag != "ready":
            self.kill()
            return tag, reason
        return None

    def _exchange(self, completions: list, kwargs: dict[str, Any], limit_s: float) -> tuple[str, Any]:
        started = time.monotonic()
        try:
            self.conn.send((completions, kwargs))
        except Exception as e:  # e.g. a column value that cannot be pickled
            self.kill()
            return "raised", f"its inputs could not be sent to the worker: {one_line(e, 240)}"
        if not self.conn.poll(limit_s):
            raise TimeoutError
        try:
            return self.conn.recv()
        except (EOFError, OSError):
            code = self.process.exitcode if self.process is not None else None
            raise WorkerDied(f"its worker died after {time.monotonic() - started:.1f} s (exit code {code})") from None
        except Exception as e:  # the result could not be unpickled
            raise Malformed(f"returned values that cannot be sent back: {one_line(e, 240)}") from None

    def _stop(self) -> None:
        if self.process is not None and self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        if self.conn is not None:
            self.conn.close()
        self.process = self.conn = None

    def close(self) -> None:
        """End the worker politely (it exits on None), or kill it."""
        if self.process is not None and self.process.is_alive():
            try:
                self.conn.send(None)
                self.process.join(2)
            except Exception:  # noqa: BLE001 - closing anyway
                pass
        self.kill()
