"""Held-out metrics: sample each held-out problem k times and measure it, for `grpo train` and `grpo eval`.

pass@1 (mean of the recipe's correctness reward, `rewards[i].correctness`), unbiased pass@k,
maj@k, mean reward per function, mean completion length (tokens), truncation rate, the same
per difficulty tier when the rows have a `tier` column, and greedy accuracy (temperature 0).
The metric functions are pure; `heldout_metrics` and `greedy_accuracy` sample with an engine.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from grpo_cli.config import DataConfig
from grpo_cli.engines.base import NO_LOGPROBS, Engine, Rollouts, Sampling
from grpo_cli.rewards import SampleContext, WeightedReward, correctness_name, final_answer, final_answers, score
from grpo_cli.step.tool_metrics import calls_a_tool, tool_metrics

FULL_CREDIT = 1.0 - 1e-9  # a sample counts as correct for pass@k when its correctness reward reaches 1


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with c correct among n samples: 1 - C(n-c, k) / C(n, k) (Chen et al. 2021)."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def answer_key(completion: str, answer_format: str) -> Any:
    """What a completion votes for in maj@k: its final answer at cent precision (rewards.final_answer);
    for an answer that is not a number, the single stated answer's text; None = no vote."""
    value = final_answer(completion, answer_format)
    if value is not None:
        return value
    raw = final_answers(completion, answer_format)
    return raw[0].strip() if len(raw) == 1 and raw[0].strip() else None


def majority_vote(answers: list[Any]) -> int | None:
    """Index of the sample that represents the winning answer, or None when no sample has an answer.

    The most frequent non-None answer wins; a tie goes to the answer that appeared first,
    and the representative is that answer's first sample (deterministic, order-based).
    """
    counts = Counter(a for a in answers if a is not None)
    if not counts:
        return None
    first: dict[Any, int] = {}
    for i, a in enumerate(answers):
        if a is not None:
            first.setdefault(a, i)
    winner = max(counts, key=lambda a: (counts[a], -first[a]))
    return first[winner]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def summarise(problems: list[int], k: int, correct: list[float], per_function: dict[str, list[float]],
              lengths: list[int], truncated: list[bool], votes: list[Any]) -> dict[str, Any]:
    """The metrics of some problems (indices) from per-sample values laid out [N*k] (problem-major)."""
    samples = [p * k + j for p in problems for j in range(k)]
    num_correct = [sum(correct[p * k + j] >= FULL_CREDIT for j in range(k)) for p in problems]
    majority = []
    for p in problems:
        winner = majority_vote(votes[p * k:(p + 1) * k])
        majority.append(correct[p * k + winner] if winner is not None else 0.0)  # the vote's answer, scored
    return {
        "pass@1": _mean([correct[s] for s in samples]),
        "pass@k": _mean([pass_at_k(k, c, k) for c in num_correct]),
        "k": k,
        "maj@k": _mean(majority),
        "mean_length": _mean([lengths[s] for s in samples]),
        "truncation_rate": _mean([float(truncated[s]) for s in samples]),
        "mean_reward": {name: _mean([values[s] for s in samples]) for name, values in per_function.items()},
        "num_problems": len(problems),
    }


def _tiers(rows: list[dict[str, Any]]) -> dict[str, list[int]]:
    """tier -> problem indices, when the rows have a `tier` column (bike_pricing); else {}."""
    if not rows or "tier" not in rows[0]:
        return {}
    tiers: dict[str, list[int]] = {}
    for i, row in enumerate(rows):
        tiers.setdefault(str(row["tier"]), []).append(i)
    return dict(sorted(tiers.items()))


@dataclass(frozen=True)
class HeldoutSet:
    """The held-out problems as the engine and the rewards see them."""
    rows: list[dict[str, Any]]  # the problems' dataset rows
    prompt_ids: list[list[int]]  # each row's prompt, encoded once
    rewards: list[WeightedReward]  # the recipe's rewards (one is the correctness check)
    answer_format: str  # data.answer_format
    prompt_column: str  # data.prompt_column: the question each completion answers (passed as `prompt`)

    @classmethod
    def build(cls, rows: list[dict[str, Any]], encode: Callable[[dict[str, Any]], list[int]],
              rewards: list[WeightedReward], data: DataConfig) -> HeldoutSet:
        return cls(rows, [encode(row) for row in rows], rewards, data.answer_format, data.prompt_column)

    def score(self, out: Rollouts, max_new_tokens: int, max_trajectory_tokens: int | None = None) -> Any:
        """The rewards' Scores of the k completions per row in `out`, laid out row-major [N*k]. `max_new_tokens`:
        the completion's (a model turn's) cap; `max_trajectory_tokens`: a tool run's trajectory cap."""
        k = len(out.texts[0]) if out.texts else 1
        texts = [t for group in out.texts for t in group]  # [N*k]
        columns = {key: [row[key] for row in self.rows for _ in range(k)] for key in self.rows[0]}  # each [N*k]
        whole = out.trajectory_texts()
        context = SampleContext(out.model_tokens(), columns.get(self.prompt_column), out.tool_calls(),
                                out.environment_results(), *(whole or (None, None)),
                                max_trajectory_tokens if whole is not None else None)
        return score(self.rewards, texts, columns, self.answer_format, group_size=k, max_new_tokens=max_new_tokens,
                     context=context)


def heldout_metrics(engine: Engine, heldout: HeldoutSet, sampling: Sampling, seeds: list[int],
                    samples: list[dict[str, Any]] | None = None, max_tokens: int | None = None) -> dict[str, Any]:
    """Sample `sampling.n` = k completions per held-out row and measure them (see `summarise`), overall
    and per tier. `samples`, when given, receives one record per sample (prompt, completion, rewards,
    length, truncated, row columns). For the training log, `flatten(metrics)` gives eval/... keys.
    `max_tokens`: a tool run's trajectory cap, which the rewards see as `max_trajectory_tokens`."""
    k, rows = sampling.n, heldout.rows
    out = engine.generate(heldout.prompt_ids, sampling, seeds, rows)
    texts = [t for group in out.texts for t in group]  # [N*k]
    lengths = out.model_tokens()  # [N*k] the model's own tokens (a trajectory's tool replies are not)
    scored = heldout.score(out, sampling.max_new_tokens, max_tokens)
    correct = scored.per_function[correctness_name(heldout.rewards)]  # [N*k]
    truncated = [bool(t) for group in out.truncated for t in group]  # [N*k]
    votes = [answer_key(t, heldout.answer_format) for t in texts]  # [N*k]
    parts = (k, correct, scored.per_function, lengths, truncated, votes)
    metrics = summarise(list(range(len(rows))), *parts)
    metrics["per_tier"] = {tier: summarise(idx, *parts) for tier, idx in _tiers(rows).items()}
    if out.segments:  # a tool run: how the model used its tools, and how often that was right
        metrics.update(tool_metrics(out))
        metrics.update(pass_at_1_by_calling(out.segments, correct))
    if samples is not None:
        for s, text in enumerate(texts):
            p = s // k
            samples.append({
                "problem": p, "sample": s % k, "prompt": engine.tokenizer.decode(heldout.prompt_ids[p]),
                "completion": text, "rewards": {name: values[s] for name, values in scored.per_function.items()},
                "length": lengths[s], "truncated": truncated[s], "columns": rows[p],
                **({"trajectory": out.trajectories[p][s % k], "turns": out.segments[p][s % k]} if out.segments else {}),
                **({"environment": out.environments[p][s % k]._asdict()} if out.environments else {}),
            })
    return metrics


def pass_at_1_by_calling(segments: list[list[list[dict[str, Any]]]], correct: list[float]) -> dict[str, float]:
    """pass@1 of the samples that call a tool and of those that do not (`segments` [N][k], `correct` [N*k]);
    a side with no sample has no key."""
    calls = [calls_a_tool(turns) for group in segments for turns in group]  # [N*k]
    out = {}
    for key, side in (("tools/pass@1_calling", True), ("tools/pass@1_not_calling", False)):
        values = [c for c, called in zip(correct, calls, strict=True) if called == side]
        if values:
            out[key] = _mean(values)
    return out


def add_greedy_metrics(metrics: dict[str, Any], engine: Engine, heldout: HeldoutSet, max_new_tokens: int,
                       max_tokens: int | None = None) -> None:
    """Into heldout_metrics' dict: one temperature-0 completion per row scored as greedy_accuracy (overall and
    in each per_tier entry), and in a tool run greedy_call_share (the share of rows whose greedy completion
    calls a tool). `max_tokens` as in heldout_metrics."""
    out = engine.generate(heldout.prompt_ids, Sampling(1, 0.0, 1.0, max_new_tokens, logprob_seeds=NO_LOGPROBS), list(range(len(heldout.rows))),
                          heldout.rows)
    scored = heldout.score(out, max_new_tokens, max_tokens)
    correct = scored.per_function[correctness_name(heldout.rewards)]  # [N]
    metrics["greedy_accuracy"] = _mean(correct)
    for tier, idx in _tiers(heldout.rows).items():
        metrics["per_tier"][tier]["greedy_accuracy"] = _mean([correct[i] for i in idx])
    if out.segments:
        metrics["greedy_call_share"] = tool_metrics(out)["tools/call_share"]


def flatten(metrics: dict[str, Any], prefix: str = "eval/") -> dict[str, float]:
    """heldout_metrics' dict -> flat log keys: eval/pass@1, eval/reward/NAME, eval/pass@1_tier1, ..."""
    flat: dict[str, float] = {}
    for key, value in metrics.items():
        if key == "mean_reward":
            flat.update({f"{prefix}reward/{name}": v for name, v in value.items()})
        elif key == "per_tier":
            for tier, sub in value.items():
                flat.update({f"{prefix}{name}_tier{tier}": v for name, v in sub.items()
                             if isinstance(v, float) and name != "mean_reward"})
        elif key not in ("k", "num_problems"):
            flat[f"{prefix}{key}"] = value
    return flat
