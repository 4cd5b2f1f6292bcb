"""Environments: a class holding one rollout's state, whose methods are the model's tools.

A recipe names one with `rollout.environment.cls: package.module:Class`. Every sample of a step gets
its own instance, built from its prompt's dataset row (`Class(**columns)`: the columns its `__init__`
names, or all of them when it takes `**kwargs`), so one trajectory's instance state (a game board, a
shell's working directory, a ledger) is never another's; class attributes and module globals are
shared, as in any Python process. Its public methods defined in the class itself are the tools (in
the tag format one text argument each, called `<METHOD>...</METHOD>` unless
`rollout.environment.tags` says otherwise; in the chat format typed arguments and an `Args:`
docstring, as a function tool's). Two names are not tools: `reward(self) -> float`, when defined,
scores the finished trajectory (the built-in reward `environment` returns it), and
`state(self) -> dict`, when defined, is what the rewards receive as `environment_state` (by default
the instance's public attributes), as plain data.

The instances live in the environment's worker process (the reward workers' machinery), keyed by
trajectory, so a method that hangs is killed with its time limit like a function tool. Killing the
worker loses every instance in it; each request therefore carries the trajectory's row and its
earlier calls, and a worker that does not hold the instance rebuilds it by replaying them (within
`timeout_s` per replayed call as well as the new one's). So an
environment must be a function of its row and the calls made on it (which a resumed run needs anyway:
the same trajectories must meet the same states).
"""

from __future__ import annotations

import inspect
import itertools
import math
import threading
import types
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from grpo_cli.errors import UsageError, one_line
from grpo_cli.tools.result import ToolResult, result_of
from grpo_cli.tools.worker import RewardWorker, call_in_process, import_function

HOOKS = ("reward", "state")  # methods an environment may define that are not tools
_LIVE: dict[tuple[int, int], Any] = {}  # in the process that runs the environment: trajectory key -> its instance
_CLASSES: dict[str, type] = {}  # in that process: "module:Class" -> the class, imported once


class EnvironmentEnd(NamedTuple):
    """What a finished trajectory's environment leaves for the rewards."""
    state: dict[str, Any] | None  # `state()`, or the public attributes; None when the environment failed
    reward: float | None  # `reward()`; None when it has none or it failed
    error: str | None  # why the environment failed (it raised, timed out or could not be rebuilt), or None


_ENVIRONMENT_IDS = itertools.count()  # tells apart the environments loaded in one process (their keys share _LIVE)


@dataclass
class LoadedEnvironment:
    name: str  # as written in the recipe: "module:Class"
    cls: type
    columns: tuple[str, ...] | None  # the row's columns its __init__ takes; None = all of them (**kwargs)
    required: tuple[str, ...]  # those of them without a default: every row must hold them
    methods: tuple[str, ...]  # its tools, in definition order
    has_reward: bool  # it defines reward()
    timeout_s: float | None  # per request, in the worker; None = in the trainer's process, no limit
    worker: Any = field(default=None, compare=False, repr=False)  # a RewardWorker when timeout_s is set
    keys: Any = field(default_factory=itertools.count, compare=False, repr=False)  # a fresh key per trajectory
    served: dict = field(default_factory=dict, compare=False, repr=False)  # key -> the worker start that holds it
    uid: int = field(default_factory=lambda: next(_ENVIRONMENT_IDS), compare=False)
    # one process holds the instances: its requests (calls, ends, forgets) go one at a time, from any thread
    lock: Any = field(default_factory=threading.Lock, compare=False, repr=False)

    def new_key(self) -> tuple[int, int]:
        return self.uid, next(self.keys)

    def _request(self, key: tuple[int, int], row: dict[str, Any], history: list, method: str,
                 argument: Any, within_s: float | None = None) -> tuple[str, Any, bool, float | None]:
        """(tag, answer, killed, limit_s): whether the worker was killed by this request (its instances gone) and
        the time limit the request ran under (a rebuild's covers the replayed calls too), both read under the
        lock, before another thread's request can restart the worker."""
        columns = row if self.columns is None else {c: row[c] for c in self.columns if c in row}
        request = [(key, self.name, columns, history, method, argument)]
        with self.lock:
            if self.worker is None:
                return (*call_in_process(serve_request, request, {}), False, None)
            alive = self.worker.alive()
            rebuild = bool(history) and not (alive and self.served.get(key) == self.worker.starts)
            # a worker that lost the instance replays its calls first, each within its own limit
            limit_s = self.timeout_s * (1 + len(history)) if rebuild else self.timeout_s
            tag, out = self.worker.call(request, {}, limit_s if rebuild else None, within_s)
            self.served[key] = self.worker.starts
            return tag, out, tag != "ok" and self.worker.process is None, limit_s

    def call(self, key: tuple[int, int], row: dict[str, Any], history: list, method: str,
             argument: Any, within_s: float | None = None) -> tuple[ToolResult, str, float | None]:
        """One tool call on trajectory `key`'s instance, within `within_s` (what is left of the step's tool budget,
        tools.pool) when given: (what the model reads, "replay" | "lost", the limit it ran under). "replay": it
        ran, so a rebuilt instance must see it again (append it to the history); "lost": the worker was killed
        (the call overran: a "timeout" failure, counted as a tool's), and the call is not replayed."""
        tag, out, killed, limit_s = self._request(key, row, history, method, argument, within_s)
        return result_of(tag, out), "lost" if killed else "replay", limit_s

    def end(self, key: tuple[int, int], row: dict[str, Any], history: list) -> EnvironmentEnd:
        """The finished trajectory's state and reward; its instance is dropped."""
        tag, out, _, _ = self._request(key, row, history, "", None)
        self.served.pop(key, None)
        if tag != "ok":
            return EnvironmentEnd(None, None, f"the environment {out.removeprefix('raised ')}"[:240])
        return out[0]

    def forget(self, keys: list[tuple[int, int]]) -> None:
        """Drop instances without ending them (a generate that failed half-way), here and in a live worker."""
        with self.lock:  # pool threads may be mid-call on the worker's pipe (issue 54)
            for key in keys:
                _LIVE.pop(key, None)
                self.served.pop(key, None)
            if self.worker is not None and self.worker.alive():
                self.worker.call([(FORGET, keys)], {})  # a worker that fails to answer is killed, instances and all

    def close(self) -> None:
        with self.lock:
            if self.worker is not None:
                self.worker.close()


FORGET = "forget"  # serve_request((FORGET, keys)): drop those instances; answers how many this process still holds


def serve_request(requests: list, **_: Any) -> list:
    """Run one request where the instances live (the worker, or the trainer's process without a time limit):
    (key, class name, columns, earlier calls, method, argument); method "" ends the trajectory. Builds the
    instance (replaying the earlier calls) when this process does not hold it."""
    if requests[0][0] == FORGET:
        for key in requests[0][1]:
            _LIVE.pop(tuple(key), None)
        return [len(_LIVE)]
    [(key, name, columns, history, method, argument)] = requests
    env = _LIVE.get(key)
    if env is None:
        if name not in _CLASSES:
            _CLASSES[name] = import_function(name, "environment")
        env = _CLASSES[name](**columns)
        _LIVE[key] = env  # before the replay: a replayed call that raises leaves the state it left
        for past_method, past_argument in history:
            try:
                _invoke(env, past_method, past_argument)
            except (Exception, SystemExit):  # noqa: BLE001 - it failed the first time too (SystemExit included:
                pass  # an ordinary failure since issue 54), and the model read that; the rest is replayed
    if method:
        return [_invoke(env, method, argument)]
    del _LIVE[key]
    return [_finish(env)]


def _invoke(env: Any, method: str, argument: Any) -> Any:
    fn = getattr(env, method)
    value = fn(argument) if isinstance(argument, str) else fn(**argument)
    # numbers become text here, where a failure (a 5,000-digit int) is the call's own, not the trainer's
    return str(value) if isinstance(value, int | float) and not isinstance(value, bool) else value


def _finish(env: Any) -> EnvironmentEnd:
    """The instance's state (as plain data) and reward; a failure of either is the environment's, and one does
    not cost the other."""
    errors = []
    try:
        state = env.state() if callable(getattr(env, "state", None)) else \
            {k: v for k, v in vars(env).items() if not k.startswith("_")}
        state = plain(dict(state))
    except Exception as e:  # noqa: BLE001 - e.g. vars() of a class with __slots__
        state, _ = None, errors.append(f"state() raised {one_line(e, 160)}")
    reward = None
    if callable(getattr(env, "reward", None)):
        try:
            reward = float(env.reward())
            if not math.isfinite(reward):
                reward, _ = None, errors.append(f"reward() is {reward}")
        except Exception as e:  # noqa: BLE001
            errors.append(f"reward() raised {one_line(e, 160)}")
    return EnvironmentEnd(state, reward, f"the environment's {'; '.join(errors)}" if errors else None)


def plain(value: Any, depth: int = 0) -> Any:
    """`value` as data JSON and pickle carry (the state travels back to the trainer and into completions.jsonl):
    text keys, lists for tuples and sets, numbers of at most 64 bits; anything else as its repr, cut."""
    if depth > 8:
        return "..."
    if value is None or isinstance(value, bool | str | float):
        return value
    if isinstance(value, int):
        return value if value.bit_length() <= 64 else f"<int of {value.bit_length()} bits>"
    if isinstance(value, dict):
        return {str(k) if isinstance(k, str | int | float | bool) else repr(k)[:80]: plain(v, depth + 1)
                for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [plain(v, depth + 1) for v in value]
    return repr(value)[:200]


def load_environment(spec: Any, tool_format: str) -> tuple[LoadedEnvironment | None, list[tuple[str, Any, str, str]]]:
    """`rollout.environment` -> (the loaded environment, its tools as (method, a bound stand-in for
    signatures and schemas, open, close)); (None, []) when the recipe names none. Fails at the edge."""
    if not spec.cls:
        if spec.tags:
            raise UsageError("rollout.environment.tags: set, but rollout.environment.cls names no environment")
        return None, []

    where = "rollout.environment.cls"
    try:
        cls = import_function(spec.cls, "environment")
    except UsageError as e:
        raise UsageError(f"{where}: {e}") from None
    if not inspect.isclass(cls):
        raise UsageError(f"{where}: '{spec.cls}' is not a class; an environment is a class whose methods are tools")
    try:
        params = list(inspect.signature(cls).parameters.values())
    except (TypeError, ValueError):
        params = []
    P = inspect.Parameter
    if bad := [p.name for p in params if p.kind in (P.POSITIONAL_ONLY, P.VAR_POSITIONAL)]:
        raise UsageError(f"{where}: {spec.cls}.__init__ takes {', '.join(bad)} by position; it is built from a "
                         "dataset row by column name (Class(**columns))")
    takes_all = any(p.kind is P.VAR_KEYWORD for p in params)
    columns = None if takes_all else tuple(p.name for p in params if p.kind is not P.VAR_KEYWORD)
    required = tuple(p.name for p in params if p.default is P.empty and p.kind is not P.VAR_KEYWORD)
    # its own plain methods, in definition order: not inherited ones (a base class's reset, step, close), nor
    # static or class methods (no instance to hold the state)
    methods = [name for name, fn in vars(cls).items()
               if inspect.isfunction(fn) and not name.startswith("_") and name not in HOOKS]
    if not methods:
        raise UsageError(f"{where}: {spec.cls} has no public method, so the model would have no tool; its methods "
                         f"(other than {', '.join(HOOKS)}) are the tools")
    if spec.tags and tool_format != "tags":
        raise UsageError(f"rollout.environment.tags: set, but rollout.tool_format={tool_format} calls tools in the "
                         "chat template's syntax; drop the tags")
    if unknown := sorted(set(spec.tags) - set(methods)):
        raise UsageError(f"rollout.environment.tags: {', '.join(unknown)} is not one of {spec.cls}'s tools "
                         f"({', '.join(methods)})")
    tools = []
    for name in methods:
        tags = spec.tags[name] if name in spec.tags else [f"<{name}>", f"</{name}>"]
        if len(tags) != 2 or not all(isinstance(tag, str) for tag in tags):
            raise UsageError(f"rollout.environment.tags.{name}: give two strings, the open and the close tag")
        stand_in = types.MethodType(getattr(cls, name), cls)  # the method's signature without self
        tools.append((name, stand_in, tags[0], tags[1]))
    timeout_s = spec.timeout_s
    if timeout_s is not None and not (math.isfinite(timeout_s) and timeout_s > 0):
        raise UsageError(f"rollout.environment.timeout_s: {timeout_s} must be > 0 seconds, or null for no limit")
    worker = None
    if timeout_s is not None:
        worker = RewardWorker(f"env-{cls.__name__}", serve_request, float(timeout_s))
    env = LoadedEnvironment(spec.cls, cls, columns, required, tuple(methods), callable(getattr(cls, "reward", None)),
                            timeout_s, worker)
    return env, tools


def check_rows(env: LoadedEnvironment | None, rows: list[dict[str, Any]], split: str) -> None:
    """Every row must hold the columns the environment is built from; the error names the row."""
    if env is None:
        return
    for i, row in enumerate(rows):
        if missing := [c for c in env.required if c not in row]:
            raise UsageError(f"rollout.environment.cls: {env.name} is built from the column(s) {', '.join(missing)}, "
                             f"which {split} row {i} lacks (columns present: {', '.join(sorted(row)) or 'none'})")
