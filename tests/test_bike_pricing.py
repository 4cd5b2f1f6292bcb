"""The bike_pricing generator: determinism, splits, and answers recomputed from the question text.

The recomputation below reads the numbers back out of the *question wording*
with its own small parser and exact fractions, so it shares no code with the
generator's cents arithmetic.
"""

from __future__ import annotations

import collections
import re
import subprocess
import sys
from fractions import Fraction

import pytest

from grpo_cli.tasks import bike_pricing
from grpo_cli.tasks.bike_pricing import Problem, generate, splits

BIKE_WORDS = ("bike", "tandem")


def total_from_question(question: str) -> Fraction:
    """An independent reading of the question: sum the charges, skip the deposit, apply the discount."""
    sentences = re.split(r"(?<=[.?])\s+", question)
    days = None
    per_day = []  # rates charged for every day
    fixed = []
    percent, weekly = None, False
    for s in sentences:
        if s.endswith("?") or "deposit" in s:
            continue
        if "%" in s:
            percent = int(re.search(r"(\d+)%", s).group(1))
            weekly = "weekly" in s
        elif "fee" in s:
            fixed.append(int(re.search(r"fee of (\d+)", s).group(1)))
        else:
            rate = int(re.search(r"(\d+) (?:extra )?(?:per|a) day", s).group(1))
            per_day.append(rate)
            if any(w in s for w in BIKE_WORDS):
                days_here = int(re.search(r"(\d+) days?\b", s).group(1))
                assert days in (None, days_here), "every bike is rented for the same days"
                days = days_here
    assert days is not None, question
    total = Fraction(sum(per_day) * days + sum(fixed))
    if percent is not None and (not weekly or days >= 7):
        total = total * (100 - percent) / 100
    return total


@pytest.fixture(scope="module")
def many() -> list[Problem]:
    return generate(3000, seed=7)


def test_answers_match_an_independent_reading_of_the_question(many):
    for p in many:
        assert re.fullmatch(r"\d+\.\d\d", p.answer), p.answer
        assert Fraction(p.answer) == total_from_question(p.question), (p.question, p.answer)


def test_every_solution_line_is_correct_arithmetic_and_ends_with_the_answer(many):
    for p in many:
        lines = p.solution.split("\n")
        assert lines[-1] == f"Answer: {p.answer}"
        assert sum(line.startswith("Answer:") for line in lines) == 1
        for line in lines[:-1]:
            if m := re.search(r"(\d+) x (\d+) = ([\d.]+)$", line):
                assert Fraction(m[1]) * Fraction(m[2]) == Fraction(m[3]), line
            elif m := re.search(r"(\d+)% of ([\d.]+) = ([\d.]+)$", line):
                assert Fraction(m[1]) * Fraction(m[2]) / 100 == Fraction(m[3]), line
            elif m := re.search(r": ([\d.]+) - ([\d.]+) = ([\d.]+)$", line):
                assert Fraction(m[1]) - Fraction(m[2]) == Fraction(m[3]), line
            elif m := re.search(r": ([\d. +]+) = ([\d.]+)$", line):
                assert sum(Fraction(x) for x in m[1].split(" + ")) == Fraction(m[2]), line
            else:
                assert re.fullmatch(r"[a-z ]+fee: \d+\.\d\d|weekly pass: \d+ days? < 7, no discount", line), line
            # Money in the solution is always written with two decimals.
            for amount in re.findall(r"\d+\.\d+", line):
                assert re.fullmatch(r"\d+\.\d\d", amount), line


def test_tiers_count_operations(many):
    for p in many:
        computed = p.solution.split("\n")[:-1]
        if p.tier == 1:
            assert len(computed) == 1
        elif p.tier == 2:
            assert len(computed) == 3 and computed[-1].startswith("subtotal:")
        else:
            assert "%" in p.question and ("discount" in p.solution or "weekly pass" in p.solution)
        assert ("%" in p.question) == (p.tier == 3)


def test_tiers_are_drawn_uniformly(many):
    counts = collections.Counter(p.tier for p in many)
    assert set(counts) == {1, 2, 3}
    for tier in (1, 2, 3):
        assert 0.28 < counts[tier] / len(many) < 0.39, counts


def test_weekly_pass_sometimes_applies_and_sometimes_not(many):
    solutions = [p.solution for p in many]
    assert any("weekly pass" in s and "no discount" in s for s in solutions)
    assert any("weekly pass" in s and ">= 7" in s for s in solutions)
    assert any("discount:" in s for s in solutions)  # the unconditional coupon
    assert any("deposit" in p.question for p in many)


def test_numbers_stay_small(many):
    for p in many:
        first_sentence = re.split(r"(?<=[.?])\s+", p.question)[0]
        days = int(re.search(r"(\d+) days?\b", first_sentence).group(1))
        assert 1 <= days <= (14 if "weekly" in p.question else 10), p.question
        rates = [int(r) for r in re.findall(r"(\d+) (?:extra )?(?:per|a) day", p.question)]
        assert all(r in bike_pricing.RATES or 2 <= r <= 5 for r in rates), p.question


def test_generate_is_deterministic_and_questions_are_distinct():
    a, b = generate(300, seed=3), generate(300, seed=3)
    assert a == b
    assert len({p.question for p in a}) == 300
    assert len({p.id for p in a}) == 300
    assert [p.question for p in generate(300, seed=4)] != [p.question for p in a]
    assert generate(50, seed=3) == a[:50]  # a longer run extends, never reshuffles


def test_generate_is_the_same_in_a_fresh_interpreter_with_another_hash_seed():
    code = "from grpo_cli.tasks.bike_pricing import generate; print([p.id for p in generate(40, 11)])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "12345", "PATH": ""}).stdout.strip()
    assert out == str([p.id for p in generate(40, 11)])


def test_tier_subset():
    assert {p.tier for p in generate(60, seed=1, tiers=(2,))} == {2}
    assert {p.tier for p in generate(200, seed=1, tiers=[1, 3])} == {1, 3}
    with pytest.raises(ValueError, match="tiers"):
        generate(5, seed=1, tiers=(4,))


def test_splits_are_disjoint_and_heldout_is_stable():
    train, heldout = splits(2000, 150, seed=5)
    assert len(train) == 2000 and len(heldout) == 150
    assert not {p.question for p in train} & {p.question for p in heldout}
    assert len({p.question for p in train}) == 2000
    _, heldout_small_train = splits(10, 150, seed=5)
    assert heldout_small_train == heldout
    _, heldout_other_seed = splits(10, 150, seed=6)
    assert heldout_other_seed != heldout


def test_to_row_and_id_are_derived_from_content():
    p = generate(1, seed=0)[0]
    row = p.to_row()
    assert set(row) == {"question", "answer", "solution", "tier", "id"}
    assert row["id"] == bike_pricing.problem_id(p.question)
    assert Problem(**row) == p


def test_money_formats_cents():
    assert bike_pricing.money(4860) == "48.60"
    assert bike_pricing.money(5) == "0.05"
    assert bike_pricing.money(12500) == "125.00"
