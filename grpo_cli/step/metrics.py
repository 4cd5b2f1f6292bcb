"""A step's metrics: the phase timer, the metrics line the loop logs, and the names console and plot read.

Every logged key is made here or comes from a stage's stats (the update's, the push check's,
the held-out evaluation's): `reward/*` (each function's mean, and the REWARD_STATS), the loss and
its token means, lengths, group statistics, throughput, and `time/*` per phase.
"""

from __future__ import annotations

import time
from typing import Any

from grpo_cli.dist import Dist
from grpo_cli.runtime import peak_rss_gib
from grpo_cli.step.batch import TrainBatch
from grpo_cli.step.collect import Groups
from grpo_cli.step.tool_metrics import tool_metrics

REWARD_PREFIX = "reward/"
# reward/* keys that are not a reward function's mean
REWARD_STATS = ("reward/mean", "reward/std", "reward/failures", "reward/dropped", "reward/kl_penalty")
# the step-time split, in loop order; sleep: vLLM's sleep and wake-ups (and the optimizer-state offload)
TIME_PARTS = ("generate", "reward", "logprobs", "update", "wait_rollouts", "push", "sleep")
TIME_SHORT = {"generate": "gen", "reward": "rew", "logprobs": "lp", "update": "upd", "wait_rollouts": "wait", "push": "push",
              "sleep": "slp"}


def reward_functions(metrics: dict[str, Any]) -> dict[str, float]:
    """Each reward function's mean, from the `reward/<fn>` keys."""
    return {k[len(REWARD_PREFIX):]: v for k, v in metrics.items()
            if k.startswith(REWARD_PREFIX) and k not in REWARD_STATS}



def as_number(value: Any) -> float | None:
    """A metric or score as a float, or None when it is not a number."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def rank_metrics(dist: Dist, collective_s: float) -> dict[str, float]:
    """Peak host memory of the largest rank, and (several ranks) the seconds the step spent in the loop's
    own collectives, which sit inside the phases (FSDP2's communication is not counted here)."""
    metrics = {"memory/peak_rss_gib": max(dist.gather(peak_rss_gib()))}
    if dist.world_size > 1:
        metrics["dist/collective_s"] = collective_s
    return metrics


def step_metrics(step: int, groups: Groups, batch: TrainBatch, stats: dict[str, Any], timings: dict[str, float], lr: float,
                 started: float) -> dict[str, Any]:
    """One step's metrics line: rewards, the update's stats, lengths, group statistics, speed, time split."""
    rollouts, scored = groups.rollouts, groups.scored

    lengths = rollouts.model_tokens()  # [P*G] the model's own tokens (a trajectory's tool replies are not)
    push_checks = {k: v for k, v in stats.items() if k.startswith("push_check/")}
    update_stats = {k: v for k, v in stats.items() if k not in push_checks}
    return {
        "step": step,
        "reward/mean": float(groups.reward.mean()),
        "reward/std": float(groups.reward.std(unbiased=False)),
        **{f"reward/{name}": sum(vals) / len(vals) for name, vals in scored.per_function.items()},
        "reward/failures": groups.failures.total,  # samples x functions that raised, timed out or returned junk
        "reward/dropped": int(groups.dropped.sum()),  # samples that left the loss (a reward with on_failure=drop failed)
        **{f"reward_failures/{name}": groups.failures.counts.get(name, 0) for name in scored.per_function},
        **update_stats,  # loss, the loss's token means (kl, clip_frac, ...), grad_norm, skips, mismatch
        "lr": lr,
        "completion_len/mean": sum(lengths) / len(lengths),
        "completion_len/max": max(lengths),
        "truncation_rate": sum(t for group in rollouts.truncated for t in group) / len(lengths),
        "groups/all_correct_frac": float(groups.all_correct.float().mean()),
        "groups/all_wrong_frac": float(groups.all_wrong.float().mean()),
        "groups/zero_variance_frac": float((groups.all_correct | groups.all_wrong).float().mean()),
        "groups/kept": int(groups.keep.sum()),
        "sampling/rounds": groups.rounds,  # > 1 only with rollout.dynamic_sampling
        "sampling/groups": len(groups.rows),
        "samples": len(lengths),
        # sampling speed; with rollout.max_staleness > 0 the batch was sampled beside an earlier step
        # (ahead.staleness_metrics)
        **({"tokens_per_s": rollouts.num_tokens / max(timings["generate"], 1e-9)} if "generate" in timings else {}),
        "train_tokens": batch.train_tokens,  # kept samples' prompt + completion tokens (each prompt runs once)
        "train_tokens_per_s": batch.train_tokens / max(timings["logprobs"] + timings["update"], 1e-9),
        **{f"time/{k}": v for k, v in timings.items()},
        "time/step": sum(timings.values()),
        "elapsed_s": time.time() - started,
        **push_checks,
        **(tool_metrics(rollouts) if rollouts.segments else {}),  # a tool run: calls, turns, tokens, caps
    }
