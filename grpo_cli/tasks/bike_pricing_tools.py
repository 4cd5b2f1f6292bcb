"""Bike-rental pricing with prices to the cent, for a model that may call a calculator (recipe=bike_pricing_tools).

The same rentals and wording as bike_pricing (tiers 1-3: one bike; plus an add-on, a fee or a second
bike; plus a coupon or a weekly pass), but every price has cents (17.35 a day, a fee of 8.45) and
the discounts have more percentages (15% of 138.60 = 20.79), so that a model of a million
parameters gets the arithmetic wrong most of the time when it works it out in its own tokens.

A solution is one line per operation, each line's value rounded to the cent (half up, as the
calculator rounds). It can be written two ways, and the shipped base model was pre-trained on both
(scripts/make_base_model.py, a minority with the calculator):

    without the tool                          with it (the model writes up to </calc>, the tool answers)
    e-bike: 7 x 17.35 = 121.45                e-bike: <calc>7 x 17.35</calc><result>121.45</result>
    helmet: 7 x 2.45 = 17.15                  helmet: <calc>7 x 2.45</calc><result>17.15</result>
    subtotal: 121.45 + 17.15 = 138.60         subtotal: <calc>121.45 + 17.15</calc><result>138.60</result>
    discount: 138.60 x 15 / 100 = 20.79       discount: <calc>138.60 x 15 / 100</calc><result>20.79</result>
    total: 138.60 - 20.79 = 117.81            total: <calc>138.60 - 20.79</calc><result>117.81</result>
    Answer: 117.81                            Answer: 117.81

The rewards score only the final answer (and its format); nothing pays for calling the tool as such.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from fractions import Fraction
from typing import NamedTuple

from grpo_cli.tasks.bike_pricing import (
    ADDONS,
    BIKES,
    FEES,
    MAX_DAYS,
    MAX_DAYS_WEEKLY,
    NAMES,
    WEEKLY_PASS_MIN_DAYS,
    Rental,
    render_question,
)
from grpo_cli.tasks.draw import draw_distinct
from grpo_cli.tools.builtin import format_amount

TIERS = (1, 2, 3)
CHECK_REWARDS = ("correct", "format")  # (correctness, format) rewards, as scripts/make_base_model.py measures
RATE_CENTS = (800, 2999)  # a bike's rate per day, any cent value in this range
ADDON_CENTS = (150, 599)  # an add-on's price per day
FEE_CENTS = (300, 1499)  # a one-time fee
DEPOSITS = (20, 50, 100)  # refundable, whole units: never part of the total
DISCOUNT_PERCENTS = (10, 15, 20, 25, 30, 35, 40)
CALL_OPEN, CALL_CLOSE = "<calc>", "</calc>"  # the recipe's calculator tags
RESULT_OPEN, RESULT_CLOSE = "<result>", "</result>"  # what the environment writes around a result (the default)


class Line(NamedTuple):
    """One solution line: `prefix + expression = value`, `prefix + value` (an amount stated), or the prefix alone."""

    prefix: str
    expression: str | None = None  # the arithmetic of the line (what a calculator call holds)
    value: str | None = None  # its result, to the cent


@dataclass(frozen=True)
class Problem:
    id: str  # stable: derived from the question text
    question: str
    answer: str  # the total, two decimals
    solution: str  # the worked solution without the tool
    tier: int  # 1..3
    lines: tuple[Line, ...]  # the solution's lines, from which both renderings are made

    def to_row(self) -> dict:
        return {"question": self.question, "answer": self.answer, "solution": self.solution,
                "tier": self.tier, "id": self.id}


def amount(cents: int) -> str:
    """Integer cents -> '17.35' (prices in questions are positive)."""
    return f"{cents // 100}.{cents % 100:02d}"


def solution_lines(rental: Rental) -> tuple[list[Line], str]:
    """The worked lines of a rental whose prices are in cents, and the answer they reach."""
    lines, values = [], []
    for bike, rate in rental.bikes:
        cents = rental.days * rate
        lines.append(Line(f"{bike}: ", f"{rental.days} x {amount(rate)}", amount(cents)))
        values.append(cents)
    if rental.addon:
        item, per_day = rental.addon
        cents = rental.days * per_day
        lines.append(Line(f"{item}: ", f"{rental.days} x {amount(per_day)}", amount(cents)))
        values.append(cents)
    if rental.fee:
        name, fee = rental.fee
        lines.append(Line(f"{name}: ", None, amount(fee)))
        values.append(fee)
    total = sum(values)
    if len(values) > 1:
        lines.append(Line("subtotal: ", " + ".join(amount(v) for v in values), amount(total)))
    if rental.discount:
        kind, percent = rental.discount
        if kind == "coupon" or rental.days >= WEEKLY_PASS_MIN_DAYS:
            # Rounded to the cent half up, as the calculator rounds its result (tools.builtin.format_amount).
            off = format_amount(Fraction(total * percent, 100 * 100))
            off_cents = round(Fraction(off) * 100)
            prefix = "discount: " if kind == "coupon" else f"weekly pass: {rental.days} days >= {WEEKLY_PASS_MIN_DAYS}, "
            lines.append(Line(prefix, f"{amount(total)} x {percent} / 100", off))
            lines.append(Line("total: ", f"{amount(total)} - {off}", amount(total - off_cents)))
            total -= off_cents
        else:
            lines.append(Line(f"weekly pass: {rental.days} days < {WEEKLY_PASS_MIN_DAYS}, no discount"))
    lines.append(Line("Answer: ", None, amount(total)))
    return lines, amount(total)


def render_line(line: Line) -> str:
    prefix, expression, value = line
    return prefix + (f"{expression} = {value}" if expression else value or "")


def tool_segments(problem: Problem) -> list[tuple[str, bool]]:
    """The solution written with the calculator, as the turns of a rollout: (text, written by the model).
    The model's turns end at the close tag; each result is the environment's turn (tokenized on its own,
    as the rollout engine tokenizes a reply)."""
    segments: list[tuple[str, bool]] = []
    text = ""
    for i, (prefix, expression, value) in enumerate(problem.lines):
        text += ("\n" if i else "") + prefix
        if expression:
            segments.append((text + CALL_OPEN + expression + CALL_CLOSE, True))
            segments.append((RESULT_OPEN + value + RESULT_CLOSE, False))
            text = ""
        else:
            text += value or ""
    segments.append((text, True))
    return segments


def draw_rental(rng: random.Random, tier: int) -> Rental:
    """bike_pricing's draw with prices in cents (Rental's rates hold cents here)."""
    discount = None
    if tier == 3:
        discount = (rng.choice(("coupon", "weekly")), rng.choice(DISCOUNT_PERCENTS))
    days = rng.randint(1, MAX_DAYS_WEEKLY if discount and discount[0] == "weekly" else MAX_DAYS)
    first_bike = rng.choice(BIKES)
    bikes = [(first_bike, rng.randint(*RATE_CENTS))]
    addon = fee = None
    if tier >= 2:
        extra = rng.choice(("addon", "fee", "bike"))
        if extra == "addon":
            addon = (rng.choice(ADDONS), rng.randint(*ADDON_CENTS))
        elif extra == "fee":
            fee = (rng.choice(FEES), rng.randint(*FEE_CENTS))
        else:
            bikes.append((rng.choice([b for b in BIKES if b != first_bike]), rng.randint(*RATE_CENTS)))
    deposit = rng.choice(DEPOSITS) if rng.random() < 0.4 else None
    return Rental(renter=rng.choice(NAMES), days=days, bikes=tuple(bikes), addon=addon, fee=fee,
                  deposit=deposit, discount=discount)


def in_units(rental: Rental) -> Rental:
    """The rental with its cents written as amounts ('17.35'), for bike_pricing's wording."""
    return Rental(renter=rental.renter, days=rental.days, bikes=tuple((b, amount(r)) for b, r in rental.bikes),
                  addon=(rental.addon[0], amount(rental.addon[1])) if rental.addon else None,
                  fee=(rental.fee[0], amount(rental.fee[1])) if rental.fee else None,
                  deposit=rental.deposit, discount=rental.discount)


def _draw_problems(n: int, rng: random.Random, tiers: tuple[int, ...], exclude: set[str]) -> list[Problem]:
    def draw_one(rng: random.Random, tier: int) -> Problem | None:
        rental = draw_rental(rng, tier)
        question = render_question(in_units(rental), rng)
        if question in exclude:
            return None
        exclude.add(question)
        lines, answer = solution_lines(rental)
        return Problem(id="biket-" + hashlib.sha1(question.encode()).hexdigest()[:12], question=question,
                       answer=answer, solution="\n".join(render_line(line) for line in lines), tier=tier,
                       lines=tuple(lines))

    return draw_distinct(n, rng, tuple(tiers), TIERS, "bike_pricing_tools", draw_one)


def splits(num_train: int, num_heldout: int, seed: int, tiers=TIERS) -> tuple[list[Problem], list[Problem]]:
    """(train, heldout) that never share a question; the held-out set depends only on (num_heldout, seed, tiers)."""
    tiers = tuple(tiers)
    seen: set[str] = set()
    heldout = _draw_problems(num_heldout, random.Random(f"bike_pricing_tools/heldout/{seed}"), tiers, seen)
    train = _draw_problems(num_train, random.Random(f"bike_pricing_tools/train/{seed}"), tiers, seen)
    return train, heldout
