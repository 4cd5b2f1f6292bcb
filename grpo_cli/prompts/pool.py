"""Which training prompts a step draws: the prompt pool (data.sampler; docs/sampling.md).

Every sampler walks the same seeded order (`PromptCursor`: the train rows shuffled, reshuffled each epoch). A
sampler only decides, for each prompt as its turn comes, the probability that the step takes it (`KEEP`); a
prompt passed over waits for its turn in a later epoch. `uniform` takes every prompt, so its draws are the
cursor's. What the pool knows comes from groups already scored (`record`): with rollout.max_staleness=K the
draw of step t+K happens before step t is recorded and sees steps up to t-1. Every rank records the same
scores in the same order, the decisions' random numbers are a function of (seed, step, position), and the
whole pool goes into the checkpoint, so a run stays a pure function of its seed at any world size and after
a resume.

A group is *settled* when its pass rate (the correctness reward's mean over the group) is at or outside
data.sampler.band: by default all wrong or all right, the groups whose advantages are all zero.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from grpo_cli.config import SamplerConfig
from grpo_cli.errors import UsageError
from grpo_cli.prompts.rows import PromptCursor


class PromptPool:
    """The cursor, each drawn prompt's last pass rates, and the sampler that reads them."""

    def __init__(self, num_rows: int, seed: int, sampler: SamplerConfig, column_values: list[str] | None = None) -> None:
        self.cursor = PromptCursor(num_rows, seed)
        self.seed, self.sampler = seed, sampler
        self.column_values = column_values  # [rows] each train row's data.sampler.column as text (signal_by_column)
        self.rates: dict[int, list[float]] = {}  # row -> its last data.sampler.visits pass rates, oldest first
        self.skips: dict[int, int] = {}  # row -> times passed over in a row since it was last taken
        self.signal: dict[str, float] = {}  # column value -> EMA of the share of its groups that were not settled
        self.pending: dict[int, list[int]] = {}  # step -> rows drawn for it and not yet recorded (in draw order)
        self.passed: dict[int, int] = {}  # step -> prompts passed over while drawing it

    def take(self, count: int, step: int) -> list[int]:
        """The step's next `count` row indices (a dynamic-sampling round calls again for the same step)."""
        drawn = self.pending.setdefault(step, [])
        rng = random.Random(f"prompt_pool/{self.seed}/{step}/{len(drawn)}")  # str seeds hash the same in every process
        keep_probability = KEEP[self.sampler.name]
        rows: list[int] = []
        while len(rows) < count:
            row = self.cursor.take(1, step)[0]
            keep = keep_probability(self, row)
            if keep < 1.0 and self.skips.get(row, 0) < self.sampler.max_skips and rng.random() >= keep:
                self.skips[row] = self.skips.get(row, 0) + 1  # its next turn is in a later epoch
                self.passed[step] = self.passed.get(step, 0) + 1
                continue
            self.skips.pop(row, None)
            rows.append(row)
        drawn.extend(rows)
        return rows

    def record(self, step: int, pass_rates: list[float]) -> None:
        """The pass rates [P] of the groups of `step`, in the order its rows were drawn (all its rounds)."""
        rows = self.pending.pop(step)
        if len(rows) != len(pass_rates):
            raise ValueError(f"step {step} drew {len(rows)} prompts and recorded {len(pass_rates)} groups")
        for row, rate in zip(rows, pass_rates):
            history = self.rates.setdefault(row, [])
            history.append(float(rate))
            del history[:-self.sampler.visits]
            if self.column_values is not None:  # EMA of the value's unsettled share; an unseen value starts at 1
                value, decay = self.column_values[row], self.sampler.decay
                self.signal[value] = decay * self.signal.get(value, 1.0) + (1.0 - decay) * (not self.settled(rate))

    def settled(self, rate: float) -> bool:
        low, high = self.sampler.band
        return rate <= low or rate >= high

    def metrics(self, step: int) -> dict[str, float]:
        """The step's passed-over prompts and the pool's buckets by each seen prompt's last pass rate."""
        low, high = self.sampler.band
        last = [history[-1] for history in self.rates.values()]
        out = {"pool/passed_over": float(self.passed.pop(step, 0)), "pool/seen": float(len(last)),
               "pool/solved": float(sum(rate >= high for rate in last)),  # last group at or above the band
               "pool/unsolved": float(sum(rate <= low for rate in last)),  # at or below it
               "pool/learning": float(sum(low < rate < high for rate in last))}
        out.update({f"pool/signal/{value}": share for value, share in sorted(self.signal.items())})
        return out

    def state_dict(self) -> dict[str, Any]:
        """Plain types (checkpoint.load_trainer_state reads with weights_only=True); the cursor's own keys stay
        where a checkpoint always had them (order, position)."""
        return {**self.cursor.state_dict(),
                "prompt_pool": {"rates": self.rates, "skips": self.skips, "signal": self.signal,
                                "pending": self.pending, "passed": self.passed}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A checkpoint's pool; one saved before the pool existed has only the cursor (the pool starts empty)."""
        self.cursor.load_state_dict(state)
        pool = state.get("prompt_pool", {})
        self.rates = {int(k): list(v) for k, v in pool.get("rates", {}).items()}
        self.skips = {int(k): int(v) for k, v in pool.get("skips", {}).items()}
        self.signal = dict(pool.get("signal", {}))
        self.pending = {int(k): list(v) for k, v in pool.get("pending", {}).items()}
        self.passed = {int(k): int(v) for k, v in pool.get("passed", {}).items()}


def keep_every(pool: PromptPool, row: int) -> float:
    """uniform: every prompt at its turn."""
    return 1.0


def keep_unsettled(pool: PromptPool, row: int) -> float:
    """skip_settled, after GRESO (Zheng et al. 2025, "Act Only When It Pays", arXiv:2506.02177): a prompt whose
    last `visits` groups were all settled is likely settled again; it is taken with probability `floor`."""
    history, s = pool.rates.get(row, []), pool.sampler
    if len(history) < s.visits or not all(pool.settled(rate) for rate in history):
        return 1.0
    return s.floor


def keep_by_column_signal(pool: PromptPool, row: int) -> float:
    """signal_by_column, after SEC (Chen et al. 2025, "Self-Evolving Curriculum for LLM Reasoning",
    arXiv:2505.14970): the rows sharing a value of data.sampler.column (a difficulty tier, a domain) are one arm;
    an arm is taken in proportion to its recent share of unsettled groups, relative to the best arm's, never below
    `floor`. It needs no prompt to come back: it learns from fresh prompts of the same kind."""
    share = pool.signal.get(pool.column_values[row], 1.0)  # an unseen value: as good as the best
    best = max(pool.signal.values(), default=1.0)
    return 1.0 if best <= 0.0 else max(pool.sampler.floor, min(1.0, share / best))


KEEP: dict[str, Callable[[PromptPool, int], float]] = {
    "uniform": keep_every,
    "skip_settled": keep_unsettled,
    "signal_by_column": keep_by_column_signal,
}


def column_values(rows: list[dict[str, Any]], sampler: SamplerConfig) -> list[str] | None:
    """Each train row's data.sampler.column as text, for signal_by_column (None for the other samplers)."""
    if sampler.name != "signal_by_column":
        return None
    for index, row in enumerate(rows):
        if sampler.column not in row:
            raise UsageError(f"data.sampler.column: train row {index} has no column '{sampler.column}' (its columns: "
                             f"{', '.join(sorted(row))}); signal_by_column needs it on every row")
    return [str(row[sampler.column]) for row in rows]
