"""Countdown: combine the given numbers with + - * / to reach the target, each number used once.

A problem is drawn by combining numbers in the order the question lists them: the result so far
and the next number, with an operation whose result is a positive whole number no larger than
MAX_VALUE (division only when exact); the last result is the target. That construction is the worked solution, one line per
operation, and its expression (with the parentheses it needs) is the final `Answer:` line.
Many problems have other solutions too; the reward (`grpo_cli.rewards.countdown`) checks the
expression a completion states, not a gold string.

Tiers count the numbers: 1. two numbers (one operation); 2. three (two); 3. four (three).
Numbers stay small (1..MAX_NUMBER, results <= MAX_VALUE) so a ~1M-parameter model learns the
arithmetic from the solutions.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

from grpo_cli.tasks.draw import draw_distinct

TIERS = (1, 2, 3)
DEFAULT_TIERS = (1, 2)  # what the countdown recipe and its shipped model use
CHECK_REWARDS = ("countdown", "countdown_valid")  # (correctness, format) rewards, as scripts/make_base_model.py measures
NUMBERS_PER_TIER = {1: 2, 2: 3, 3: 4}
MAX_NUMBER = 15  # the given numbers are drawn from 1..MAX_NUMBER
MAX_VALUE = 150  # every intermediate result and the target stay in 1..MAX_VALUE
OPS = ("+", "-", "*", "/")
_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}
_ATOM = 3


@dataclass(frozen=True)
class Problem:
    id: str  # stable: derived from the question text
    question: str
    numbers: tuple[int, ...]  # the numbers to use, each exactly once, in the question's order
    target: int
    solution: str  # one line per operation, then "Answer: <expression>"
    tier: int  # 1..3: two, three or four numbers

    def to_row(self) -> dict:
        return {"question": self.question, "numbers": list(self.numbers), "target": self.target,
                "solution": self.solution, "tier": self.tier, "id": self.id}


@dataclass(frozen=True)
class _Term:
    value: int
    expr: str
    precedence: int  # of the expression's outermost operation; _ATOM for a bare number


def _apply(op: str, a: int, b: int) -> int | None:
    """a op b when it is a whole number in 1..MAX_VALUE and not a no-op (x*1, x/1), else None."""
    if op == "+":
        out = a + b
    elif op == "-":
        out = a - b
    elif op == "*":
        out = a * b if a != 1 and b != 1 else None
    else:
        out = a // b if b not in (0, 1) and a % b == 0 else None
    return out if out is not None and 1 <= out <= MAX_VALUE else None


def _combine(op: str, left: _Term, right: _Term) -> _Term:
    p = _PRECEDENCE[op]
    lhs = left.expr if left.precedence >= p else f"({left.expr})"
    # - and / are not associative: a right operand of the same precedence needs parentheses.
    rhs = right.expr if right.precedence > p or (right.precedence == p and op in "+*") else f"({right.expr})"
    return _Term(_apply(op, left.value, right.value), f"{lhs} {op} {rhs}", p)


def draw(rng: random.Random, tier: int) -> tuple[tuple[int, ...], int, list[str], str] | None:
    """(numbers, target, step lines, expression), or None when this draw found no valid operation.

    The numbers are combined in the order the question lists them, each operation taking the result
    so far and the next number: a procedure a ~1M-parameter model can learn from the solutions (which
    pair to combine is then never a guess), while the operations stay its choice. The reward accepts
    any expression that reaches the target, in any order.
    """
    numbers = tuple(rng.randint(1, MAX_NUMBER) for _ in range(NUMBERS_PER_TIER[tier]))
    term = _Term(numbers[0], str(numbers[0]), _ATOM)
    steps = []
    for n in numbers[1:]:
        ops = [op for op in rng.sample(OPS, len(OPS)) if _apply(op, term.value, n) is not None]
        if not ops:
            return None
        new = _combine(ops[0], term, _Term(n, str(n), _ATOM))
        steps.append(f"{term.value} {ops[0]} {n} = {new.value}")
        term = new
    return numbers, term.value, steps, term.expr


def _listing(numbers: tuple[int, ...]) -> str:
    return ", ".join(str(n) for n in numbers[:-1]) + f" and {numbers[-1]}"


def render_question(numbers: tuple[int, ...], target: int, rng: random.Random) -> str:
    return rng.choice((
        f"Use {_listing(numbers)} to make {target}. Each number is used once, with + - * /.",
        f"Reach {target} from {_listing(numbers)}, using every number exactly once and + - * /.",
        f"Numbers: {' '.join(map(str, numbers))}. Target: {target}. Combine each number once with + - * /.",
    ))


def problem_id(question: str) -> str:
    return "countdown-" + hashlib.sha1(question.encode()).hexdigest()[:12]


def _draw_problems(n: int, rng: random.Random, tiers: tuple[int, ...], exclude: set[str],
                   unique: bool) -> list[Problem]:
    """n problems whose puzzle (numbers and target) is not in `exclude`; with `unique`, no puzzle twice
    (each drawn one is added to `exclude`). Two numbers make only a few hundred puzzles, so the
    train split repeats them (in varied wording) while the held-out split never shares one."""

    def draw_one(rng: random.Random, tier: int) -> Problem | None:
        drawn = draw(rng, tier)
        if drawn is None:
            return None
        numbers, target, steps, expr = drawn
        key = f"{sorted(numbers)}->{target}"  # the same puzzle in another order or wording is the same puzzle
        if key in exclude:
            return None
        if unique:
            exclude.add(key)
        question = render_question(numbers, target, rng)
        return Problem(id=problem_id(question), question=question, numbers=numbers, target=target,
                       solution="\n".join(steps + [f"Answer: {expr}"]), tier=tier)

    return draw_distinct(n, rng, tuple(tiers), TIERS, "countdown", draw_one)


def splits(num_train: int, num_heldout: int, seed: int, tiers=DEFAULT_TIERS) -> tuple[list[Problem], list[Problem]]:
    """(train, heldout) that never share a puzzle (the same numbers and target).

    The held-out set is drawn first from its own stream, so it depends only on
    (num_heldout, seed, tiers): growing num_train never changes what is evaluated.
    """
    tiers = tuple(tiers)
    seen: set[str] = set()
    heldout = _draw_problems(num_heldout, random.Random(f"countdown/heldout/{seed}"), tiers, seen, unique=True)
    train = _draw_problems(num_train, random.Random(f"countdown/train/{seed}"), tiers, seen, unique=False)
    return train, heldout
