"""Scoring completions with the loaded rewards: one call per prompt's group, failures counted, never fatal.

A call that raises is retried one sample at a time; a wrong count, a value that is not a finite
number or a timeout marks the samples it covers as failed (they score 0, or leave the loss with
on_failure=drop). The caller (the training step, `grpo eval`) decides when too many is too many.
"""

from __future__ import annotations

import math
import numbers
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from grpo_cli.prompts.templates import question_text
from grpo_cli.rewards.load import RESERVED, TOOL_RUN_ONLY, WeightedReward
from grpo_cli.tools.worker import call_in_process

MAX_TIMEOUTS_IN_A_ROW = 3  # then a function's remaining calls in this scoring are skipped (a held-out set has 200 groups); a server that does not answer counts as a timeout


@dataclass
class RewardFailures:
    """Samples a reward function could not score: it raised, timed out, returned the wrong count or type,
    or a value that is not a finite number. The caller decides when too many is too many."""

    counts: Counter = field(default_factory=Counter)  # function name -> samples it failed on
    last_error: dict[str, str] = field(default_factory=dict)  # function name -> the latest reason, one line

    def record(self, name: str, samples: int, reason: str) -> None:
        self.counts[name] += samples
        self.last_error[name] = reason

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def _invoke(reward: WeightedReward, completions: list, kwargs: dict[str, Any]) -> tuple[str, Any]:
    """One call: in the reward's worker (under its time limit) or, without timeout_s, in this process."""
    if reward.worker is not None:
        return reward.worker.call(completions, kwargs)
    return call_in_process(reward.fn, completions, kwargs)


def _as_score(value: Any) -> float | None:
    if isinstance(value, numbers.Real):  # int, float, bool, numpy scalars; not strings or tensors
        x = float(value)
        return x if math.isfinite(x) else None
    return None


def _score_chunk(reward: WeightedReward, completions: list, per_sample: dict[str, list], fixed: dict[str, Any],
                 first: int, failed: list[bool], reasons: list[str]) -> tuple[list[float], str]:
    """Scores of one call's completions (samples first..first+n-1 of the batch); failures marked in `failed`.
    `per_sample` holds the keyword arguments with one value per completion (the columns, the prompts,
    the token counts), `fixed` the others. A call that raises is retried one sample at a time, so only
    the samples it fails on are lost. Also returns the call's outcome tag ("ok", "raised", "timeout", ...)."""
    n = len(completions)
    tag, out = _invoke(reward, completions, {**per_sample, **fixed})
    if tag == "raised" and n > 1:
        scores = []
        for j in range(n):
            one = {k: v[j : j + 1] for k, v in per_sample.items()}
            scores += _score_chunk(reward, completions[j : j + 1], one, fixed, first + j, failed, reasons)[0]
        return scores, tag
    if tag != "ok":
        where = f"sample {first}" if n == 1 else f"samples {first}-{first + n - 1}"
        reasons.append(f"{where}: {out}")
        failed[first : first + n] = [True] * n
        return [0.0] * n, tag
    if len(out) != n:
        reasons.append(f"samples {first}-{first + n - 1}: returned {len(out)} values for {n} completions")
        failed[first : first + n] = [True] * n
        return [0.0] * n, tag
    scores = []
    for j, value in enumerate(out):
        x = _as_score(value)
        if x is None:
            reasons.append(f"sample {first + j}: returned {value!r:.40}, not a finite number")
            failed[first + j] = True
        scores.append(0.0 if x is None else x)
    return scores, tag


def _call_reward(reward: WeightedReward, completions: list, per_sample: dict[str, list], fixed: dict[str, Any],
                 failures: RewardFailures, group_size: int) -> tuple[list[float], list[bool]]:
    """([N] scores, [N] failed) of one function, one call per group of `group_size` completions.
    Once it has failed on more than half the samples, or timed out on MAX_TIMEOUTS_IN_A_ROW calls in
    a row, its remaining groups are not called and count as failed: each call could cost a full
    timeout, and a training run stops on a function that fails on most samples anyway."""
    n = len(completions)
    failed, reasons, scores = [False] * n, [], []
    fixed = {**fixed, **reward.args}
    timeouts_in_a_row = 0
    for first in range(0, n, group_size):
        chunk = slice(first, min(first + group_size, n))
        if sum(failed) > n / 2 or timeouts_in_a_row >= MAX_TIMEOUTS_IN_A_ROW:
            failed[chunk] = [True] * len(completions[chunk])
            scores += [0.0] * len(completions[chunk])
            continue
        group = {k: v[chunk] for k, v in per_sample.items()}
        chunk_scores, tag = _score_chunk(reward, completions[chunk], group, fixed, first, failed, reasons)
        scores += chunk_scores
        timeouts_in_a_row = timeouts_in_a_row + 1 if tag in ("timeout", "unreachable") else 0
    if any(failed):
        failures.record(reward.name, sum(failed), reasons[-1] if reasons else "skipped after most samples failed")
    return scores, failed


class Scores(NamedTuple):
    total: list[float]  # [N] weighted sum over the reward functions
    per_function: dict[str, list[float]]  # name -> [N] raw scores, in recipe order
    dropped: list[bool]  # [N] a reward with on_failure=drop failed on it: it leaves the loss


class SampleContext(NamedTuple):
    """What the scorer knows of each of the N samples beside its text, each [N] (None: not known here)."""

    completion_tokens: list[int] | None = None  # the model's token counts (a trajectory's tool replies are not)
    prompts: list[Any] | None = None  # each sample's prompt column (text or chat messages); passed as `prompt`, the question as text
    tool_calls: list[list[dict]] | None = None  # a tool run: each trajectory's calls (tool, argument, result, ok)
    environment: tuple[list, list] | None = None  # with an environment: ([N] its state, [N] its reward())
    trajectories: list[str] | None = None  # a tool run: the whole trajectory's text, the tools' replies in it
    trajectory_tokens: list[int] | None = None  # a tool run: the whole trajectory's token counts
    max_trajectory_tokens: int | None = None  # a tool run: the trajectory cap (rollout.max_trajectory_tokens)


NO_CONTEXT = SampleContext()  # a scoring that knows only the texts and the columns


def score(rewards: list[WeightedReward], completions: list, columns: dict[str, list], answer_format: str,
          failures: RewardFailures | None = None, group_size: int | None = None, max_new_tokens: int | None = None,
          context: SampleContext = NO_CONTEXT) -> Scores:
    """Score N completions with every reward; columns are aligned with completions (each [N]).
    `max_new_tokens` (the cap) and what `context` knows (the token counts, the prompts, a tool run's calls, an
    environment's states and rewards, passed as `completion_tokens`, `prompt`, `tool_calls`,
    `environment_state` and `environment_reward`) reach the functions when given.

    Each function is called once per group of `group_size` consecutive completions (one prompt's
    group; None = all N in one call), in its worker under `timeout_s` when it has one. A function
    that fails scores 0 on the samples it failed, `failures` (when given) counts them, and with
    on_failure=drop those samples are marked in `Scores.dropped`.
    """
    n = len(completions)
    states, env_rewards = context.environment if context.environment is not None else (None, None)
    passed = {"tool_calls": context.tool_calls, "environment_state": states, "environment_reward": env_rewards,
              "trajectory": context.trajectories, "trajectory_tokens": context.trajectory_tokens}
    reserved = [name for name in RESERVED if name not in TOOL_RUN_ONLY or passed[name] is not None]
    # A prompt column named `prompt` (TRL's name) is the prompt itself: passed once, as the question's text.
    columns = {k: v for k, v in columns.items() if not (k == "prompt" and v == context.prompts)}
    for name, values in columns.items():
        if name in reserved:
            raise ValueError(f"a dataset column is named '{name}', which reward functions receive as an argument; "
                             "rename the column")
        if len(values) != n:
            raise ValueError(f"column '{name}' has {len(values)} values for {n} completions")
    failures = failures if failures is not None else RewardFailures()
    prompts = None if context.prompts is None else [question_text(p) for p in context.prompts]
    extra = (("completion_tokens", context.completion_tokens), ("prompt", prompts), *passed.items())
    per_sample = {**columns, **{k: v for k, v in extra if v is not None}}
    fixed = {"answer_format": answer_format, **({"max_new_tokens": max_new_tokens} if max_new_tokens else {}),
             **({"max_trajectory_tokens": context.max_trajectory_tokens} if context.max_trajectory_tokens else {})}
    per_function, dropped = {}, [False] * n
    for r in rewards:
        per_function[r.name], failed = _call_reward(r, completions, per_sample, fixed, failures,
                                                    group_size or max(n, 1))
        if r.on_failure == "drop":
            dropped = [d or f for d, f in zip(dropped, failed, strict=True)]
    total = [sum(r.weight * per_function[r.name][i] for r in rewards) for i in range(n)]
    return Scores(total, per_function, dropped)
