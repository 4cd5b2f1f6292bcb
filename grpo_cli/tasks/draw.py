"""Drawing a set of distinct problems, shared by the built-in generators."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import TypeVar

P = TypeVar("P")


def draw_distinct(n: int, rng: random.Random, tiers: tuple[int, ...], known_tiers: tuple[int, ...], task: str,
                  draw_one: Callable[[random.Random, int], P | None]) -> list[P]:
    """n problems from `draw_one(rng, tier)`, each with a tier drawn uniformly from `tiers`; `draw_one`
    returns None for a draw to throw away (a duplicate, an unsolvable puzzle). A generator that cannot
    find n in 50 n + 1000 draws says so instead of looping for ever."""
    if not tiers or any(t not in known_tiers for t in tiers):
        raise ValueError(f"tiers must be a non-empty subset of {known_tiers} for {task}, got {tiers}")
    problems: list[P] = []
    for _ in range(50 * n + 1000):
        if len(problems) == n:
            return problems
        problem = draw_one(rng, rng.choice(tiers))
        if problem is not None:
            problems.append(problem)
    if len(problems) == n:
        return problems
    raise ValueError(f"only {len(problems)} distinct {task} problems found for tiers {tiers}; ask for fewer")
