"""Watching a run's health: warnings when its groups stop carrying signal, a stop after too many
non-finite steps in a row.
"""

from __future__ import annotations

import collections
from typing import Any

from grpo_cli.errors import RunFailure

# ---------------------------------------------------------------------------
# zero-variance watch


class ZeroVarianceWatch:
    """Warns once per case when groups stop carrying signal: "too hard" (all wrong) or "too easy" (all right).

    A group whose rewards are all equal has zero advantages. Fed every step; `update` returns a message the
    first time a case holds for `patience` consecutive steps, then None for that case for the rest of the run.
    """

    def __init__(self, threshold: float = 0.9, patience: int = 10) -> None:
        if not 0 < threshold <= 1:
            raise ValueError(f"zero-variance threshold must be in (0, 1], got {threshold}")
        if patience < 1:
            raise ValueError(f"zero-variance patience must be >= 1, got {patience}")
        self.threshold = threshold
        self.patience = patience
        self.fired: set[str] = set()  # "too hard" / "too easy"
        self._window: collections.deque[tuple[float, float]] = collections.deque(maxlen=patience)
        self._zero_steps = 0  # consecutive steps where every sample's reward was 0

    def check(self, metrics: dict[str, Any]) -> str | None:
        """`update` from a step's metrics dict; rows without group statistics (e.g. step 0) are skipped."""
        if "groups/all_correct_frac" not in metrics or "reward/mean" not in metrics:
            return None
        return self.update(metrics["groups/all_correct_frac"], metrics["groups/all_wrong_frac"],
                           metrics["reward/mean"], metrics.get("reward/std"))

    def update(self, all_correct_frac: float, all_wrong_frac: float, reward_mean: float,
               reward_std: float | None = None) -> str | None:
        correct, wrong = float(all_correct_frac), float(all_wrong_frac)
        if reward_std is not None:
            all_zero = abs(float(reward_mean)) < 1e-12 and float(reward_std) < 1e-12
        else:
            all_zero = abs(float(reward_mean)) < 1e-12 and wrong >= 1.0 - 1e-9
        self._zero_steps = self._zero_steps + 1 if all_zero else 0
        if correct + wrong >= self.threshold:
            self._window.append((correct, wrong))
        else:
            self._window.clear()

        if "too hard" not in self.fired and self._zero_steps >= self.patience:
            self.fired.add("too hard")
            return (f"too hard: every sample scored reward 0 for the last {self._zero_steps} steps, so no group "
                    "carries a learning signal. The reward may be rejecting the answer format: check it on "
                    "hand-written completions with `grpo reward recipe=NAME cases=FILE.jsonl`; also try easier "
                    "data or a larger rollout.max_new_tokens if answers are cut off (see truncation_rate).")
        if len(self._window) < self.patience:
            return None
        mean_correct = sum(c for c, _ in self._window) / len(self._window)
        mean_wrong = sum(w for _, w in self._window) / len(self._window)
        case = "too hard" if mean_wrong >= mean_correct else "too easy"
        if case in self.fired:
            return None
        self.fired.add(case)
        n = len(self._window)
        if case == "too hard":
            return (f"too hard: on average {mean_wrong:.0%} of groups scored all wrong over the last {n} steps "
                    f"({mean_correct:.0%} all right), so most groups carry no learning signal. Use easier data "
                    "(e.g. lower data.tiers), a larger rollout.max_new_tokens if answers are cut off (see "
                    "truncation_rate), or check the reward format with `grpo reward recipe=NAME cases=FILE.jsonl`.")
        return (f"too easy: on average {mean_correct:.0%} of groups scored all right over the last {n} steps "
                f"({mean_wrong:.0%} all wrong), so most groups carry no learning signal. Use harder data "
                "(e.g. higher data.tiers) or fewer trainer.steps: the model already solves this task.")



class NonFiniteGuard:
    """Counts training steps in a row with a skipped update (a non-finite loss or gradient); too many stop the run."""

    def __init__(self, max_bad_steps: int) -> None:
        self.max_bad_steps = max_bad_steps  # trainer.max_bad_steps
        self.in_a_row = 0

    def check(self, stats: dict[str, Any], step: int, warn: Any) -> None:
        if not stats["skipped_nonfinite"]:
            self.in_a_row = 0
            return
        self.in_a_row += 1
        warn(f"step {step}: non-finite loss or gradient, update skipped ({self.in_a_row} in a row)")
        if self.in_a_row >= self.max_bad_steps:
            raise RunFailure(f"{self.in_a_row} steps in a row had a non-finite loss or gradient (trainer."
                             f"max_bad_steps={self.max_bad_steps}); lower trainer.lr or check the rewards")
