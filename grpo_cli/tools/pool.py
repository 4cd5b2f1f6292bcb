"""Tool calls off the decoding loop: a pool of threads runs the calls of different trajectories at once, while
the engine decodes the others, under a tool-time budget per generate call (issue 36, docs/tools.md).

The engine loop never runs a tool. `ToolEngine` hands each call to `StepCalls.submit`, which queues it on
the pool; a thread runs it (a tool with a time limit in a worker process of its own, one per thread, so
calls of one tool run side by side; an environment's methods one at a time, in the environment's one
process, under its lock; a tool with `timeout_s: null` in this process, on any of the pool's threads at once,
so it must be thread-safe) and the loop takes the finished calls back between engine steps (`StepCalls.take`),
in the order they were submitted. A call that answers within `JOIN_WAIT_S` of the engine step that submitted it joins the
next step, as a synchronous call would: a run whose tools are fast batches exactly as before. A slower one
leaves the others decoding and joins at the first step after it answers.

The budget is wall time with at least one call running, per generate call (a step's sampling, a held-out
evaluation). A call is never let run past what is left of it (its worker is killed then, as on its own
timeout); once it is spent, every call fails at once with an error the model reads. An in-process tool
(`timeout_s: null`) cannot be killed: it runs to its end, and only the calls not yet started fail.
"""

from __future__ import annotations

import functools
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from grpo_cli.tools.load import LoadedTool, ToolResult, call_tool

JOIN_WAIT_S = 0.02  # how long the loop waits, after an engine step, for the calls that step submitted


class CallDone(NamedTuple):
    key: Any  # the trajectory's key, as submitted
    result: ToolResult | None  # what the model reads; None: no call, the trajectory's turn goes on (`resume`)
    seconds: float  # the call's wall time (0 when the budget was spent before it started)
    replay: str  # an environment method's "replay" | "lost" (EnvironmentEnd history); "" for a tool


class ToolPool:
    """`workers` daemon threads that run tool calls (daemon: an in-process tool stuck forever cannot keep the
    trainer from exiting), and the spare worker processes of each tool with a time limit."""

    def __init__(self, workers: int) -> None:
        self.jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self.threads = [threading.Thread(target=self._serve, daemon=True, name=f"grpo-tool-{i}")
                        for i in range(workers)]
        self.lock = threading.Lock()
        self.started = False

    def _serve(self) -> None:
        while True:
            self.jobs.get()()

    def run(self, job: Callable[[], None]) -> None:
        if not self.started:
            for thread in self.threads:
                thread.start()
            self.started = True
        self.jobs.put(job)

    def checkout(self, tool: LoadedTool) -> Any:
        """An idle worker process of `tool` (its own first, then spares, started on demand: at most one per
        thread); give it back with `checkin`."""
        with self.lock:
            if tool.idle:
                return tool.idle.pop()
            tool.spares.append(tool.worker.twin(f"{tool.worker.name}-{len(tool.spares) + 1}"))
            return tool.spares[-1]

    def checkin(self, tool: LoadedTool, worker: Any) -> None:
        with self.lock:
            tool.idle.append(worker)


class StepCalls:
    """One generate call's tool calls: submitted by the engine loop, run on the pool, taken back in order."""

    def __init__(self, pool: ToolPool, budget_s: float | None) -> None:
        self.pool, self.budget_s = pool, budget_s
        self.lock = threading.Condition()
        self.done: dict[int, CallDone] = {}  # submission number -> the finished call
        self.next_index = 0  # the next submission's number
        self.fresh: list[int] = []  # numbers submitted since the last take
        self.outstanding = 0  # submitted, not yet taken
        self.running = 0  # calls running now
        self.busy_s = 0.0  # wall time with a call running, up to `busy_since`
        self.busy_since = 0.0
        self.budget_cuts = 0  # calls failed or cut because the budget was spent

    def _spent(self) -> float:
        """Seconds of the budget used so far (under the lock)."""
        return self.busy_s + (time.monotonic() - self.busy_since if self.running else 0.0)

    @property
    def tool_seconds(self) -> float:
        with self.lock:
            return self._spent()

    def _begin(self) -> float | None:
        """A call starts: the seconds of budget left for it (None: no budget), or 0 when it is spent."""
        with self.lock:
            left = None if self.budget_s is None else self.budget_s - self._spent()
            if left is not None and left <= 0:
                self.budget_cuts += 1
                return 0.0
            if not self.running:
                self.busy_since = time.monotonic()
            self.running += 1
            return left

    def _end(self) -> None:
        with self.lock:
            self.running -= 1
            if not self.running:
                self.busy_s += time.monotonic() - self.busy_since

    def _finish(self, index: int, done: CallDone) -> None:
        with self.lock:
            self.done[index] = done
            self.lock.notify_all()

    def submit(self, key: Any, tool: LoadedTool | None, argument: Any, env_call: tuple | None = None) -> None:
        """Queue one call (`tool` None: a call the model wrote badly, its reason in `argument`; `env_call`: an
        environment method's (instance key, row, history)); it runs on the pool."""
        with self.lock:
            index = self.next_index
            self.next_index += 1
            self.fresh.append(index)
            self.outstanding += 1
        if tool is None:
            self._finish(index, CallDone(key, ToolResult(f"error: {argument}", False), 0.0, ""))
            return
        self.pool.run(functools.partial(self._run, index, key, tool, argument, env_call))

    def resume(self, key: Any) -> None:
        """A trajectory that goes on without a call (its turn is not over): it rejoins in submission order."""
        with self.lock:
            index = self.next_index
            self.next_index += 1
            self.fresh.append(index)
            self.outstanding += 1
            self.done[index] = CallDone(key, None, 0.0, "")

    def _run(self, index: int, key: Any, tool: LoadedTool, argument: Any, env_call: tuple | None) -> None:
        left = self._begin()
        if left == 0.0:
            spent = ToolResult(f"error: this step's tool time budget ({self.budget_s:g} s) is spent", False, "budget")
            self._finish(index, CallDone(key, spent, 0.0, "lost" if env_call else ""))
            return
        started, replay = time.monotonic(), ""
        result = ToolResult("error: the tool failed", False)
        try:
            if env_call is not None:
                result, replay = tool.environment.call(*env_call, tool.name, argument)
            elif tool.worker is None:
                result = call_tool(tool, argument)
            else:
                worker = self.pool.checkout(tool)
                try:
                    limit = tool.timeout_s if left is None else min(tool.timeout_s, left)
                    result = call_tool(tool, argument, worker, limit)
                    if result.failure == "timeout" and left is not None and left < tool.timeout_s:
                        with self.lock:
                            self.budget_cuts += 1
                        result = ToolResult(f"error: the call ran past this step's tool time budget "
                                            f"({self.budget_s:g} s)", False, "budget")
                finally:
                    self.pool.checkin(tool, worker)
        except BaseException as e:  # noqa: BLE001 - a thread's failure becomes the call's, never a hang (issue 54)
            result = ToolResult(f"error: the tool failed: {type(e).__name__}", False)
        finally:
            self._end()
            self._finish(index, CallDone(key, result, time.monotonic() - started, replay))

    @property
    def waiting(self) -> int:
        """Submitted and not yet taken back."""
        with self.lock:
            return self.outstanding

    def take(self, block: bool) -> list[CallDone]:
        """Every finished call, in submission order. First waits up to JOIN_WAIT_S for those submitted since the
        last take (a fast call joins the next engine step); with `block`, until at least one is ready."""
        with self.lock:
            deadline = time.monotonic() + JOIN_WAIT_S
            while any(i not in self.done for i in self.fresh) and (left := deadline - time.monotonic()) > 0:
                self.lock.wait(left)
            while block and self.outstanding and not self.done:
                self.lock.wait()
            self.fresh = []  # a call that missed its wait no longer holds a step: it joins whenever it returns
            out = [self.done.pop(i) for i in sorted(self.done)]
            self.outstanding -= len(out)
            return out
