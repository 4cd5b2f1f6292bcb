"""The learning-rate schedules, by name: pure functions of the optimizer step (no torch), so the config can
check `trainer.lr_schedule` against the table itself."""

from __future__ import annotations

import math


def constant_lr(index: int, warmup: int, total: int) -> float:
    """LR factor of optimizer step `index` (0-based): linear warm-up over `warmup` steps, then 1."""
    return min(1.0, (index + 1) / warmup) if warmup else 1.0


def linear_lr(index: int, warmup: int, total: int) -> float:
    """Warm-up, then a straight line from 1 down to 0 at step `total` (the last step gets 1/(total-warmup))."""
    if index < warmup:
        return constant_lr(index, warmup, total)
    return max(0.0, (total - index) / max(total - warmup, 1))


def cosine_lr(index: int, warmup: int, total: int) -> float:
    """Warm-up, then half a cosine from 1 down to 0 at step `total`."""
    if index < warmup:
        return constant_lr(index, warmup, total)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, (index - warmup) / max(total - warmup, 1))))


# trainer.lr_schedule picks one by name. A run's schedule spans its first trainer.steps, resumes included.
LR_SCHEDULES = {"constant": constant_lr, "linear": linear_lr, "cosine": cosine_lr}
