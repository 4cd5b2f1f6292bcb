"""Where a tool call runs, the step's tool budget, and when its result rejoins decoding (issue 36, issue 54,
docs/tools.md). A call's other rules live beside it in tools/, one module each: what the model reads of an answer
and which calls count toward `rollout.max_tool_timeouts` (tools/result.py: `result_of`, `timeouts`; the tool loop
in engines/tools.py asks it and cuts the trajectory at the cap), a worker's start and call limits and its kill
(tools/worker.py; tools/sandbox_worker.py is its transport into the sandbox), an environment's rebuild
(tools/environment.py).

The engine loop never runs a tool. `ToolEngine` hands each call to `StepCalls.submit`, which queues it on
the pool; a thread runs it (a tool with a time limit in a worker process of its own, one per thread, so
calls of one tool run side by side; an environment's methods one at a time, in the environment's one
process, under its lock; a tool with `timeout_s: null` in this process, on any of the pool's threads at once,
so it must be thread-safe).

When a result rejoins is a rule of the engine's steps, never of the clock, so a run with tools is a pure
function of its seed however long its calls take: a call submitted at an engine step waits out the *wave*
of requests the engine held after that step (those decoding, and those queued to start), and rejoins at the
first step after the last of them finished; the engine runs on meanwhile, and other calls overlap it and
each other. A result that is late at its point stops the engine until it comes (the only wait; `late_s`
sums it, logged as time/tool_late); so when nothing is left to decode, every call still out rejoins, together.
Calls that need no tool (a turn that goes on, a call the model wrote badly) rejoin at the next step.

The budget is wall time with at least one call running, per generate call (a step's sampling, a held-out
evaluation). A call is never let run past what is left of it, its worker's start included (its worker is
killed then, as on its own timeout); once it is spent, every call fails at once with an error the model reads.
An in-process tool (`timeout_s: null`) cannot be killed: it runs to its end, and only the calls not yet
started fail. A call that times out or meets the budget depends on the clock by nature: the budget and the
time limits are guards against hung tools, not part of a healthy run.
"""

from __future__ import annotations

import functools
import queue
import threading
import time
from collections.abc import Callable, Collection, Hashable
from typing import Any, NamedTuple

from grpo_cli.tools.load import LoadedTool, ToolResult, call_tool


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
    """One generate call's tool calls: submitted by the engine loop, run on the pool, rejoining at the point the
    module docstring's rule gives."""

    def __init__(self, pool: ToolPool, budget_s: float | None, rejoin: str = "wave") -> None:
        self.pool, self.budget_s, self.due = pool, budget_s, REJOIN_RULES[rejoin]
        self.lock = threading.Condition()
        self.done: dict[int, CallDone] = {}  # submission number -> the finished call, not yet rejoined
        self.next_index = 0  # the next submission's number
        self.fresh: list[int] = []  # submitted since the last take: their wave is the engine's requests at the next
        self.waves: dict[int, set] = {}  # submission number -> the requests it still waits out (empty: due)
        self.running = 0  # calls running now
        self.busy_s = 0.0  # wall time with a call running, up to `busy_since`
        self.busy_since = 0.0
        self.budget_cuts = 0  # calls failed or cut because the budget was spent
        self.late_s = 0.0  # seconds the engine waited for results late at their rejoin point

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
        if tool is None:
            self._settled(CallDone(key, ToolResult(f"error: {argument}", False), 0.0, ""))
            return
        with self.lock:
            index = self.next_index
            self.next_index += 1
            self.fresh.append(index)
        self.pool.run(functools.partial(self._run, index, key, tool, argument, env_call))

    def resume(self, key: Any) -> None:
        """A trajectory that goes on without a call (its turn is not over): it rejoins at the next step."""
        self._settled(CallDone(key, None, 0.0, ""))

    def _settled(self, done: CallDone) -> None:
        """A call with nothing to run: due at once, rejoining at the next take in submission order."""
        with self.lock:
            index = self.next_index
            self.next_index += 1
            self.waves[index] = set()
            self.done[index] = done

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
                result, replay, limit_s = tool.environment.call(*env_call, tool.name, argument, within_s=left)
            elif tool.worker is None:
                result, limit_s = call_tool(tool, argument), None
            else:
                worker = self.pool.checkout(tool)
                try:
                    result, limit_s = call_tool(tool, argument, worker, within_s=left), tool.timeout_s
                finally:
                    self.pool.checkin(tool, worker)
            if result.failure == "timeout" and left is not None and limit_s is not None and left < limit_s:
                with self.lock:  # cut by what was left of the budget, not by its own limit
                    self.budget_cuts += 1
                result = ToolResult(f"error: the call ran past this step's tool time budget ({self.budget_s:g} s)",
                                    False, "budget")
        except BaseException as e:  # noqa: BLE001 - a thread's failure becomes the call's, never a hang (issue 54)
            result = ToolResult(f"error: the tool failed: {type(e).__name__}", False)
        finally:
            self._end()
            self._finish(index, CallDone(key, result, time.monotonic() - started, replay))

    @property
    def waiting(self) -> int:
        """Submitted and not yet rejoined."""
        with self.lock:
            return len(self.fresh) + len(self.waves)

    def take(self, running: Collection[Hashable]) -> list[CallDone]:
        """After an engine step, with `running` the ids of the requests the engine holds (decoding or queued; none:
        it is idle): the calls whose rejoin point this is, in submission order, waiting for any still running."""
        with self.lock:
            for index in self.fresh:
                self.waves[index] = set(running)
            self.fresh = []
            due = self.due(self, running)
            if any(i not in self.done for i in due):
                waited = time.monotonic()
                while any(i not in self.done for i in due):
                    self.lock.wait()
                self.late_s += time.monotonic() - waited
            for index in due:
                del self.waves[index]
            return [self.done.pop(i) for i in due]


def wave_due(calls: StepCalls, running: Collection[Hashable]) -> list[int]:
    """rollout.tool_rejoin=wave: the calls whose wave has finished (every call out, when nothing runs), ready or
    not: a rule of the engine's steps, so the run replays bit for bit (module docstring). Under calls.lock."""
    for wave in calls.waves.values():
        wave.intersection_update(running)
    return [i for i in sorted(calls.waves) if not calls.waves[i]]


def asap_due(calls: StepCalls, running: Collection[Hashable]) -> list[int]:
    """rollout.tool_rejoin=asap: the calls that have returned, in submission order; with nothing running, those
    returned once the first one does. Faster where calls are slow, but which requests share a batch follows the
    clock: the engine's logprobs (and on a GPU possibly tokens) change from run to run. Under calls.lock."""
    while not running and calls.waves and not any(i in calls.done for i in calls.waves):
        calls.lock.wait()
    return [i for i in sorted(calls.waves) if i in calls.done]


REJOIN_RULES = {"wave": wave_due, "asap": asap_due}  # rollout.tool_rejoin (config.TOOL_REJOIN names them)
