"""Environments: a class holding one rollout's state, whose methods are the model's tools.

A recipe names one with `rollout.environment.cls: package.module:Class`. Every sample of a step gets
its own instance, built from its prompt's dataset row (`Class(**columns)`: the columns its `__init__`
names, or all of them when it takes `**kwargs`), so the state of one trajectory (a game board, a
shell's working directory, a ledger) never leaks into another. Its public methods are the tools (in
the tag format one text argument each, called `<METHOD>...</METHOD>` unless `rollout.environment.tags`
says otherwise; in the chat format typed arguments and an `Args:` docstring, as a function tool's).
Two names are not tools: `reward(self) -> float`, when defined, scores the finished trajectory (the
built-in reward `environment` returns it), and `state(self) -> dict`, when defined, is what the
rewards receive as `environment_state` (by default the instance's public attributes).

The instances live in the environment's worker process (the reward workers' machinery), keyed by
trajectory, so a method that hangs is killed with its time limit like a function tool. Killing the
worker loses every instance in it; each request therefore carries the trajectory's row and its
earlier calls, and a worker that does not hold the instance rebuilds it by replaying them. So an
environment must be a function of its row and the calls made on it (which a resumed run needs anyway:
the same trajectories must meet the same states).
"""

from __future__ import annotations

import inspect
import itertools
import math
import pickle
import types
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from grpo_cli.errors import UsageError

HOOKS = ("reward", "state")  # methods an environment may define that are not tools
_LIVE: dict[int, Any] = {}  # in the process that runs the environment: trajectory key -> its instance
_CLASSES: dict[str, type] = {}  # in that process: "module:Class" -> the class, imported once


class EnvironmentEnd(NamedTuple):
    """What a finished trajectory's environment leaves for the rewards."""

    state: dict[str, Any] | None  # `state()`, or the public attributes; None when the environment failed
    reward: float | None  # `reward()`; None when it has none or it failed
    error: str | None  # why the environment failed (it raised, timed out or could not be rebuilt), or None


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

    def new_key(self) -> int:
        return next(self.keys)

    def _request(self, key: int, row: dict[str, Any], history: list, method: str, argument: Any) -> tuple[str, Any]:
        from grpo_cli.rewards.worker import call_in_process

        columns = row if self.columns is None else {c: row[c] for c in self.columns if c in row}
        request = [(key, self.name, columns, history, method, argument)]
        if self.worker is not None:
            return self.worker.call(request, {})
        return call_in_process(serve_request, request, {})

    def call(self, key: int, row: dict[str, Any], history: list, method: str, argument: Any) -> tuple[str, bool, str]:
        """One tool call on trajectory `key`'s instance: (result text, ok, "replay"|"lost"|"done"). "replay":
        it ran, so a rebuilt instance must see it again (append it to the history); "lost": the worker was
        killed (the call overran), the call is not replayed."""
        tag, out = self._request(key, row, history, method, argument)
        if tag == "ok":
            value = out[0]
            if isinstance(value, int | float) and not isinstance(value, bool):
                value = str(value)
            if not isinstance(value, str):
                return f"error: the tool returned {type(value).__name__}, not text", False, "replay"
            return value, True, "replay"
        reason = out.removeprefix("raised ")
        lost = self.worker is not None and self.worker.process is None  # killed: its instances are gone
        return f"error: the tool {reason}"[:240], False, "lost" if lost else "replay"

    def end(self, key: int, row: dict[str, Any], history: list) -> EnvironmentEnd:
        """The finished trajectory's state and reward; its instance is dropped."""
        tag, out = self._request(key, row, history, "", None)
        if tag != "ok":
            return EnvironmentEnd(None, None, f"the environment {out.removeprefix('raised ')}"[:240])
        return out[0]

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()


def serve_request(requests: list, **_: Any) -> list:
    """Run one request where the instances live (the worker, or the trainer's process without a time limit):
    (key, class name, columns, earlier calls, method, argument); method "" ends the trajectory. Builds the
    instance (replaying the earlier calls) when this process does not hold it."""
    [(key, name, columns, history, method, argument)] = requests
    env = _LIVE.get(key)
    if env is None:
        if name not in _CLASSES:
            from grpo_cli.rewards.load import import_function

            _CLASSES[name] = import_function(name, "environment")
        env = _CLASSES[name](**columns)
        _LIVE[key] = env  # before the replay: a replayed call that raises leaves the state it left
        for past_method, past_argument in history:
            try:
                _invoke(env, past_method, past_argument)
            except Exception:  # noqa: BLE001 - it raised the first time too, and the model read that
                pass
    if method:
        return [_invoke(env, method, argument)]
    del _LIVE[key]
    return [_finish(env)]


def _invoke(env: Any, method: str, argument: Any) -> Any:
    fn = getattr(env, method)
    return fn(argument) if isinstance(argument, str) else fn(**argument)


def _finish(env: Any) -> EnvironmentEnd:
    from grpo_cli.errors import one_line

    try:
        state = env.state() if callable(getattr(env, "state", None)) else \
            {k: v for k, v in vars(env).items() if not k.startswith("_")}
        state = {k: v for k, v in dict(state).items() if _picklable(v)}  # it travels back to the trainer
        reward = float(env.reward()) if callable(getattr(env, "reward", None)) else None
    except Exception as e:  # noqa: BLE001 - the environment's own failure, counted for its trajectory
        return EnvironmentEnd(None, None, f"the environment raised {one_line(e, 200)}")
    if reward is not None and not math.isfinite(reward):
        return EnvironmentEnd(state, None, f"the environment's reward() is {reward}")
    return EnvironmentEnd(state, reward, None)


def _picklable(value: Any) -> bool:
    try:
        pickle.dumps(value)
    except Exception:  # noqa: BLE001
        return False
    return True


def load_environment(spec: Any, tool_format: str) -> tuple[LoadedEnvironment | None, list[tuple[str, Any, str, str]]]:
    """`rollout.environment` -> (the loaded environment, its tools as (method, a bound stand-in for
    signatures and schemas, open, close)); (None, []) when the recipe names none. Fails at the edge."""
    if not spec.cls:
        if spec.tags:
            raise UsageError("rollout.environment.tags: set, but rollout.environment.cls names no environment")
        return None, []
    from grpo_cli.rewards.load import import_function

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
    methods = [name for name, fn in inspect.getmembers(cls, inspect.isfunction)
               if not name.startswith("_") and name not in HOOKS]
    methods.sort(key=lambda name: getattr(cls, name).__code__.co_firstlineno)
    if not methods:
        raise UsageError(f"{where}: {spec.cls} has no public method, so the model would have no tool; its methods "
                         f"(other than {', '.join(HOOKS)}) are the tools")
    if unknown := sorted(set(spec.tags) - set(methods)):
        raise UsageError(f"rollout.environment.tags: {', '.join(unknown)} is not one of {spec.cls}'s tools "
                         f"({', '.join(methods)})")
    tools = []
    for name in methods:
        tags = spec.tags.get(name) or [f"<{name}>", f"</{name}>"]
        if len(tags) != 2:
            raise UsageError(f"rollout.environment.tags.{name}: give two strings, the open and the close tag")
        stand_in = types.MethodType(getattr(cls, name), cls)  # the method's signature without self
        tools.append((name, stand_in, tags[0], tags[1]))
    timeout_s = spec.timeout_s
    if timeout_s is not None and not (math.isfinite(timeout_s) and timeout_s > 0):
        raise UsageError(f"rollout.environment.timeout_s: {timeout_s} must be > 0 seconds, or null for no limit")
    worker = None
    if timeout_s is not None:
        from grpo_cli.rewards.worker import RewardWorker

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
