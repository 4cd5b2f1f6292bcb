"""From a recipe's `rewards` list to callable, weighted rewards, checked before any model loads.

A built-in name (grpo_cli.rewards.builtin), a custom `package.module:function`, imported from the
Python path (the working directory included), or a reward model (`model`: grpo_cli.rewards.model); a
function with `timeout_s` gets a killable worker process (grpo_cli.tools.worker). Exactly one reward is
the task's correctness check.
"""

from __future__ import annotations

import difflib
import inspect
import math
from dataclasses import dataclass, field
from typing import Any

from grpo_cli.errors import UsageError
from grpo_cli.rewards.builtin import BUILTIN_REWARDS, RewardFn
from grpo_cli.rewards.judge import Judge
from grpo_cli.rewards.model import RewardModel
from grpo_cli.tools.worker import RewardWorker, import_function

ON_FAILURE = ("zero", "drop")  # rewards[i].on_failure: a failed sample scores 0, or leaves the loss


# keyword names the scorer itself passes (completion_tokens, max_new_tokens and prompt when the caller knows them:
# grpo train, grpo eval; tool_calls in a tool run; environment_state and environment_reward with an environment)
RESERVED = ("completions", "answer_format", "completion_tokens", "max_new_tokens", "prompt", "tool_calls",
            "environment_state", "environment_reward", "trajectory", "trajectory_tokens", "max_trajectory_tokens")
TOOL_RUN_ONLY = ("tool_calls", "environment_state", "environment_reward", "trajectory",
                 "trajectory_tokens")  # a tool run's only; reserved when passed


@dataclass(frozen=True)
class WeightedReward:
    name: str  # as written in the recipe: a builtin name or "module:function"
    fn: RewardFn
    weight: float
    args: dict = field(default_factory=dict)  # the recipe's extra keyword arguments (rewards[i].args)
    timeout_s: float | None = None  # per call (one prompt's group); None = called in the trainer's process, no limit
    on_failure: str = "zero"  # a sample it fails on scores 0 ("zero") or leaves the loss ("drop")
    correctness: bool = False  # the task's correctness check (pass@1, zero-variance groups, best checkpoint)
    worker: Any = field(default=None, compare=False, repr=False)  # a worker.RewardWorker when timeout_s is set


def load_reward(name: str) -> RewardFn:
    """A builtin reward by name, or a custom one as "package.module:function"."""
    if name in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[name]
    if ":" not in name:
        close = difflib.get_close_matches(name, BUILTIN_REWARDS, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise UsageError(f"unknown reward '{name}'{hint}; built-in: {', '.join(BUILTIN_REWARDS)}, "
                           "or a custom one as package.module:function")
    fn = import_function(name, "reward")
    if (first := _first_parameter(fn)) in ("prompts", "prompt"):  # TRL's reward_funcs signature
        raise UsageError(f"reward '{name}' takes ({first}, completions, ...), as a TRL reward does; grpo calls "
                         "f(completions, **columns) with the question as prompt=...: make completions the first "
                         "parameter and read prompt from the keywords (docs/from_trl_and_verl.md)")
    if not _takes_var_kwargs(fn):
        raise UsageError(f"reward '{name}' must accept **kwargs: columns and answer_format arrive by name")
    return fn


def _first_parameter(fn: RewardFn) -> str | None:
    """The name of a function's first positional parameter (None when it has none or no signature)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return params[0].name if params and params[0].kind in kinds else None



def _takes_var_kwargs(fn: RewardFn) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # some builtins have no signature; let them through
        return True
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def load_rewards(specs: list) -> list[WeightedReward]:
    """The recipe's `rewards` list (RewardSpec) -> loaded functions with weights. Fails at the edge.
    Exactly one is the correctness check (`correctness: true`, or the only reward)."""
    marked = [i for i, spec in enumerate(specs) if spec.correctness]
    if len(marked) > 1 or (not marked and len(specs) > 1):
        raise UsageError(f"rewards: {len(marked)} are marked correctness: true; mark exactly one, the task's "
                         "correctness check (pass@1, the zero-variance groups, the best checkpoint)")
    loaded, seen = [], set()
    for i, spec in enumerate(specs):
        if spec.name in seen:
            raise UsageError(f"rewards[{i}]: '{spec.name}' is listed twice; give it one entry with the summed weight")
        seen.add(spec.name)
        if not math.isfinite(spec.weight):
            raise UsageError(f"rewards[{i}].weight: {spec.weight} is not a finite number")
        args = dict(spec.args)
        if clash := sorted(set(args) & set(RESERVED)):
            raise UsageError(f"rewards[{i}].args: {', '.join(clash)} is passed by the scorer itself; drop it")
        timeout_s, on_failure = spec.timeout_s, spec.on_failure
        if timeout_s is not None and not (math.isfinite(timeout_s) and timeout_s > 0):
            raise UsageError(f"rewards[{i}].timeout_s: {timeout_s} must be > 0 seconds, or null for no limit")
        if on_failure not in ON_FAILURE:
            raise UsageError(f"rewards[{i}].on_failure: '{on_failure}' is not one of {', '.join(ON_FAILURE)}")
        worker = None
        if spec.judge is not None:  # a judge: its server's requests carry their own time limit (timeout_s)
            fn, timeout_s = Judge(f"rewards[{i}]", spec), None
        elif spec.model is not None:  # a reward model: in this process a forward pass has no time limit to keep
            fn, timeout_s = RewardModel(f"rewards[{i}]", spec), None
        else:
            fn = load_reward(spec.name)
        if timeout_s is not None:
            worker = RewardWorker(spec.name, fn, float(timeout_s))
        loaded.append(WeightedReward(spec.name, fn, float(spec.weight), args, timeout_s, on_failure,
                                     spec.correctness or len(specs) == 1, worker))
    return loaded


def correctness_name(rewards: list[WeightedReward]) -> str:
    """The name of the reward that is the task's correctness check: the one marked, or the only one."""
    return next(r.name for r in rewards if r.correctness or len(rewards) == 1)


def required_columns(fn: RewardFn) -> list[str]:
    """Dataset columns a reward function needs: its named parameters without defaults, after `completions`,
    less those the scorer passes itself (`tool_calls`, `environment_state`, ...); a judge's, those its template
    names."""
    if isinstance(fn, Judge):
        return list(fn.needed_columns)
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return []
    return [p.name for p in params[1:]
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is p.empty and p.name not in RESERVED]


def needed_columns(rewards: list[WeightedReward]) -> list[str]:
    return sorted({c for r in rewards for c in required_columns(r.fn)})


def validate_columns(rows: list[dict], needed: list, where: str = "row") -> None:
    """Every row must hold every column the rewards need; the error names the first bad row (0-based).

    `needed` is a list of column names, or the loaded rewards themselves (their needs are read off
    their signatures).
    """
    columns = [c for c in needed if isinstance(c, str)]
    columns += needed_columns([r for r in needed if isinstance(r, WeightedReward)])
    for i, row in enumerate(rows):
        for column in columns:
            if column not in row:
                raise UsageError(f"{where} {i}: no '{column}' column, which the rewards need "
                                 f"(columns present: {', '.join(sorted(row)) or 'none'})")
            if row[column] is None:
                raise UsageError(f"{where} {i}: its '{column}' is null, and the rewards need a value there")


LEARNED = (RewardModel, Judge)  # the rewards that hold a model or a server


def place_reward_models(rewards: list[WeightedReward], device: Any, dtype: str, log_dir: Any = None,
                        ranks: Any = None) -> None:
    """Every learned reward ready to score: a reward model onto the trainer's device in model.dtype, loaded now,
    or a server it starts (server=start) started, its log in `log_dir`. With `ranks` (the job's Dist) at world size
    > 1, rank 0 alone starts a server=start and every rank sends its requests there: one server for the job, as
    for a served teacher (server=start is refused at dist.nnodes > 1, so every rank reaches it on this machine)."""
    for reward in rewards:
        if not isinstance(reward.fn, LEARNED):
            continue
        link = getattr(reward.fn, "server", None)
        shared = ranks is not None and ranks.world_size > 1 and link is not None and link.setting == "start"
        if not shared or ranks.is_main:
            reward.fn.place(device, dtype, log_dir)
        if shared:
            url = ranks.broadcast(link.url if ranks.is_main else None)
            if not ranks.is_main:
                link.attach(url)
                reward.fn.place(device, dtype, log_dir)  # the server is rank 0's: nothing starts here


def close_reward_models(rewards: list[WeightedReward]) -> None:
    """Stop the servers this process started for its learned rewards."""
    for reward in rewards:
        if isinstance(reward.fn, LEARNED):
            reward.fn.close()
