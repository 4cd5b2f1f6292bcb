"""The Countdown task: its generator, and the rewards that check an expression with a
safe parser (never eval)."""

from __future__ import annotations

import time
from fractions import Fraction
from pathlib import Path

import pytest

from grpo_cli.rewards import countdown, countdown_valid, parse_expression
from grpo_cli.tasks import BUILTIN_TASKS
from grpo_cli.tasks.countdown import MAX_VALUE, NUMBERS_PER_TIER, splits

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def problems():
    return splits(3000, 200, seed=1234)


def test_every_worked_solution_scores_1_and_follows_its_steps(problems):
    train, heldout = problems
    rows = [p.to_row() for p in train + heldout]
    completions = [r["solution"] for r in rows]
    numbers, targets = [r["numbers"] for r in rows], [r["target"] for r in rows]
    assert countdown(completions, numbers=numbers, target=targets) == [1.0] * len(rows)
    assert countdown_valid(completions, numbers=numbers) == [1.0] * len(rows)
    for p in train[:200]:
        *steps, answer = p.solution.splitlines()
        assert len(steps) == NUMBERS_PER_TIER[p.tier] - 1 and answer.startswith("Answer: ")
        assert 1 <= p.target <= MAX_VALUE and steps[-1].endswith(f"= {p.target}")
        assert all(str(n) in p.question for n in p.numbers)


def test_splits_are_deterministic_disjoint_and_cover_both_tiers(problems):
    train, heldout = problems
    again_train, again_heldout = splits(3000, 200, seed=1234)
    assert [p.id for p in train] == [p.id for p in again_train] and [p.id for p in heldout] == [p.id for p in again_heldout]
    puzzle = lambda p: (tuple(sorted(p.numbers)), p.target)  # noqa: E731
    assert not {puzzle(p) for p in train} & {puzzle(p) for p in heldout}
    assert {p.tier for p in heldout} == {1, 2}
    assert splits(10, 200, seed=1234)[1] == heldout  # the held-out set does not depend on num_train
    assert BUILTIN_TASKS["countdown"] is splits
    with pytest.raises(ValueError, match="tiers must be a non-empty subset"):
        splits(10, 10, seed=0, tiers=(4,))


@pytest.mark.parametrize("text, value, used", [
    ("(12 - 7) * 3", Fraction(15), [12, 7, 3]),
    ("12 - 7 * 3", Fraction(-9), [12, 7, 3]),
    ("12 / 8 * 2", Fraction(3), [12, 8, 2]),
    ("8 - 3 - 2", Fraction(3), [8, 3, 2]),  # left to right
    ("8 - (3 - 2)", Fraction(7), [8, 3, 2]),
    ("2 × 3 ÷ 6 − 1", Fraction(0), [2, 3, 6, 1]),
    ("((((5))))", Fraction(5), [5]),
])
def test_parse_expression_values(text, value, used):
    assert parse_expression(text) == (value, used)


@pytest.mark.parametrize("text", [
    "", "2 ** 3", "2 3", "-3 + 5", "(1 + 2", "1 + 2)", "1 / 0", "1 / (2 - 2)", "1.5 + 2", "abs(3)",
    "__import__('os').system('true')", "x + 1", "1 +", "(" * 200 + "1" + ")" * 200, "1" + "+1" * 100,
])
def test_parse_expression_refuses_anything_else(text):
    assert parse_expression(text) is None


def test_parse_expression_is_fast_on_junk():
    junk = ["(" * 100_000, "1+" * 200_000, "9" * 500_000, "((1)" * 50_000]
    started = time.perf_counter()
    for text in junk:
        assert parse_expression(text) is None
        assert countdown([f"Answer: {text}"], numbers=[[1, 2]], target=[3]) == [0.0]
    assert time.perf_counter() - started < 1.0


# The recipe end to end on its shipped model (vLLM, 2 ranks): tests/test_distributed_engines.py.
