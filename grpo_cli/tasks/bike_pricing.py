"""Bike-rental pricing questions with exact answers and one-line-per-step solutions.

A problem is drawn as a structured `Rental` (numbers only), then rendered twice:
as a question in varied wording from a small vocabulary, and as a worked
solution in one fixed format. All money is integer cents, so answers are exact.

Tiers count operations:
  1. one bike: days x rate (+ maybe a refundable deposit, which is a distractor)
  2. tier 1 + exactly one of: a per-day add-on, a fixed fee, a second bike
  3. tier 2 + a percentage discount: a coupon, or a weekly pass that only applies
     from 7 days on (days go up to 14 so it is skipped about half the time)

Numbers stay small (whole-number rates, days <= 14, four discount percentages)
so that a ~2M-parameter model can learn the arithmetic from the solutions.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

from grpo_cli.tasks.draw import draw_distinct

TIERS = (1, 2, 3)
CHECK_REWARDS = ("correct", "format")  # (correctness, format) rewards, as scripts/make_base_model.py measures
BIKES = ("city bike", "e-bike", "mountain bike", "road bike", "tandem", "cargo bike")
RATES = (8, 10, 12, 15, 18, 20, 25)  # per day, whole currency units
ADDONS = ("helmet", "lock", "child seat", "basket")
ADDON_RATES = (2, 3, 4, 5)  # per day
FEES = ("cleaning fee", "delivery fee", "booking fee")
FEE_AMOUNTS = (3, 5, 8, 10)  # one-time
DEPOSITS = (20, 50, 100)  # refundable: never part of the total
DISCOUNT_PERCENTS = (10, 20, 25, 50)
WEEKLY_PASS_MIN_DAYS = 7
MAX_DAYS = 10
MAX_DAYS_WEEKLY = 14
NAMES = ("Ana", "Ben", "Mia", "Tom", "Lea", "Sam", "Noor", "Ivan")


@dataclass(frozen=True)
class Rental:
    """The numbers behind one question; everything else is wording."""

    renter: str
    days: int
    bikes: tuple[tuple[str, int], ...]  # (bike, rate per day); one or two bikes, all kept for `days`
    addon: tuple[str, int] | None = None  # (item, price per day), for the whole rental
    fee: tuple[str, int] | None = None  # (name, one-time amount)
    deposit: int | None = None  # refundable deposit: mentioned, never added
    discount: tuple[str, int] | None = None  # ("coupon" | "weekly", percent off the whole bill)


@dataclass(frozen=True)
class Problem:
    id: str  # stable: derived from the question text
    question: str
    answer: str  # the total, two decimals, e.g. "48.60"
    solution: str  # worked solution, one line per operation; the last line is "Answer: {answer}"
    tier: int  # 1..3, number of operations

    def to_row(self) -> dict:
        return {"question": self.question, "answer": self.answer, "solution": self.solution,
                "tier": self.tier, "id": self.id}


# ---------------------------------------------------------------------------
# money


def money(cents: int) -> str:
    """Integer cents -> "48.60"."""
    sign = "-" if cents < 0 else ""
    cents = abs(cents)
    return f"{sign}{cents // 100}.{cents % 100:02d}"


def discount_applies(rental: Rental) -> bool:
    if rental.discount is None:
        return False
    kind, _ = rental.discount
    return kind == "coupon" or rental.days >= WEEKLY_PASS_MIN_DAYS


def line_items(rental: Rental) -> list[tuple[str, int, str]]:
    """(label, cents, how) for every charged item, in solution order."""
    items = [(bike, rental.days * rate * 100, f"{rental.days} x {rate}") for bike, rate in rental.bikes]
    if rental.addon:
        item, per_day = rental.addon
        items.append((item, rental.days * per_day * 100, f"{rental.days} x {per_day}"))
    if rental.fee:
        name, amount = rental.fee
        items.append((name, amount * 100, ""))
    return items


def discount_cents(subtotal_cents: int, percent: int) -> int:
    off, remainder = divmod(subtotal_cents * percent, 100)
    assert remainder == 0, "whole-unit prices times these percents are always whole cents"
    return off


def total_cents(rental: Rental) -> int:
    subtotal = sum(cents for _, cents, _ in line_items(rental))
    if discount_applies(rental):
        subtotal -= discount_cents(subtotal, rental.discount[1])
    return subtotal


# ---------------------------------------------------------------------------
# drawing the numbers


def draw_rental(rng: random.Random, tier: int) -> Rental:
    if tier not in TIERS:
        raise ValueError(f"tier {tier} is not one of {TIERS}")
    discount = None
    if tier == 3:
        kind = rng.choice(("coupon", "weekly"))
        discount = (kind, rng.choice(DISCOUNT_PERCENTS))
    days = rng.randint(1, MAX_DAYS_WEEKLY if discount and discount[0] == "weekly" else MAX_DAYS)
    first_bike = rng.choice(BIKES)
    bikes = [(first_bike, rng.choice(RATES))]
    addon = fee = None
    if tier >= 2:
        extra = rng.choice(("addon", "fee", "bike"))
        if extra == "addon":
            addon = (rng.choice(ADDONS), rng.choice(ADDON_RATES))
        elif extra == "fee":
            fee = (rng.choice(FEES), rng.choice(FEE_AMOUNTS))
        else:
            bikes.append((rng.choice([b for b in BIKES if b != first_bike]), rng.choice(RATES)))
    deposit = rng.choice(DEPOSITS) if rng.random() < 0.4 else None
    return Rental(renter=rng.choice(NAMES), days=days, bikes=tuple(bikes), addon=addon, fee=fee,
                  deposit=deposit, discount=discount)


# ---------------------------------------------------------------------------
# wording


def _article(noun: str) -> str:
    return ("an " if noun[0] in "aeiou" else "a ") + noun


def _days(n: int) -> str:
    return f"{n} day" if n == 1 else f"{n} days"


def _bike_sentence(rng: random.Random, who: str, bike: str, rate: int, days: int) -> str:
    return rng.choice((
        f"{who} rents {_article(bike)} for {_days(days)} at {rate} per day.",
        f"{who} hires {_article(bike)} at {rate} a day for {_days(days)}.",
        f"{_article(bike).capitalize()} costs {rate} per day and {who} keeps it for {_days(days)}.",
    ))


def _second_bike_sentence(rng: random.Random, who: str, bike: str, rate: int, days: int) -> str:
    return rng.choice((
        f"{who} also rents {_article(bike)} at {rate} per day for the same {_days(days)}.",
        f"A friend joins with {_article(bike)} at {rate} a day, also for {_days(days)}, on {who}'s bill.",
    ))


def _addon_sentence(rng: random.Random, item: str, per_day: int) -> str:
    return rng.choice((
        f"{_article(item).capitalize()} costs {per_day} per day.",
        f"They add {_article(item)} at {per_day} a day.",
        f"{_article(item).capitalize()} is {per_day} extra per day.",
    ))


def _fee_sentence(rng: random.Random, name: str, amount: int) -> str:
    return rng.choice((
        f"There is a one-time {name} of {amount}.",
        f"The shop charges a {name} of {amount} once.",
    ))


def _deposit_sentence(rng: random.Random, amount: int) -> str:
    return rng.choice((
        f"A refundable deposit of {amount} is paid at pickup.",
        f"The shop holds a deposit of {amount}, refunded on return.",
    ))


def _discount_sentence(rng: random.Random, kind: str, percent: int) -> str:
    if kind == "weekly":
        return rng.choice((
            f"A weekly pass gives {percent}% off the whole bill for rentals of {WEEKLY_PASS_MIN_DAYS} days or more.",
            f"From {WEEKLY_PASS_MIN_DAYS} days on, the weekly pass takes {percent}% off the whole bill.",
        ))
    return rng.choice((
        f"A coupon gives {percent}% off the whole bill.",
        f"Members get {percent}% off the whole bill, and {{who}} is a member.",
    ))


def render_question(rental: Rental, rng: random.Random, first_bike=_bike_sentence) -> str:
    """The question's text; `first_bike(rng, who, bike, rate, days)` words the first bike's sentence (the vision
    task's leaves the rate to the picture)."""
    who, days = rental.renter, rental.days
    (bike, rate), *more_bikes = rental.bikes
    facts = [first_bike(rng, who, bike, rate, days)]
    facts += [_second_bike_sentence(rng, who, b, r, days) for b, r in more_bikes]
    if rental.addon:
        facts.append(_addon_sentence(rng, *rental.addon))
    if rental.fee:
        facts.append(_fee_sentence(rng, *rental.fee))
    if rental.deposit is not None:
        # The distractor lands anywhere after the first fact, so position is no cue.
        facts.insert(rng.randint(1, len(facts)), _deposit_sentence(rng, rental.deposit))
    if rental.discount:
        facts.append(_discount_sentence(rng, *rental.discount).replace("{who}", who))
    ask = rng.choice((
        f"What is the total cost for {who}?",
        f"How much does {who} pay in total?",
        "What is the total price?",
    ))
    return " ".join(facts + [ask])


def render_solution(rental: Rental) -> str:
    items = line_items(rental)
    lines = [f"{label}: {how} = {money(c)}" if how else f"{label}: {money(c)}" for label, c, how in items]
    # The refundable deposit gets no line: it is not an operation, and every
    # token counts against the completion budget (max_new_tokens).
    subtotal = sum(c for _, c, _ in items)
    if len(items) > 1:
        lines.append(f"subtotal: {' + '.join(money(c) for _, c, _ in items)} = {money(subtotal)}")
    total = subtotal
    if rental.discount:
        kind, percent = rental.discount
        if discount_applies(rental):
            off = discount_cents(subtotal, percent)
            total = subtotal - off
            prefix = "discount" if kind == "coupon" else f"weekly pass: {rental.days} days >= {WEEKLY_PASS_MIN_DAYS},"
            lines.append(f"{prefix}{':' if kind == 'coupon' else ''} {percent}% of {money(subtotal)} = {money(off)}")
            lines.append(f"total: {money(subtotal)} - {money(off)} = {money(total)}")
        else:
            lines.append(f"weekly pass: {rental.days} days < {WEEKLY_PASS_MIN_DAYS}, no discount")
    assert total == total_cents(rental)
    lines.append(f"Answer: {money(total)}")
    return "\n".join(lines)


def problem_id(question: str) -> str:
    return "bike-" + hashlib.sha1(question.encode()).hexdigest()[:12]


def make_problem(rental: Rental, question: str, tier: int) -> Problem:
    return Problem(id=problem_id(question), question=question, answer=money(total_cents(rental)),
                   solution=render_solution(rental), tier=tier)


# ---------------------------------------------------------------------------
# sets of problems


def _draw_problems(n: int, rng: random.Random, tiers: tuple[int, ...], exclude: set[str]) -> list[Problem]:
    """n problems with questions unseen in `exclude` (which is extended in place)."""

    def draw_one(rng: random.Random, tier: int) -> Problem | None:
        rental = draw_rental(rng, tier)
        question = render_question(rental, rng)
        if question in exclude:
            return None
        exclude.add(question)
        return make_problem(rental, question, tier)

    return draw_distinct(n, rng, tuple(tiers), TIERS, "bike_pricing", draw_one)


def generate(n: int, seed: int, tiers=TIERS) -> list[Problem]:
    """n distinct problems, tiers drawn uniformly; the same (n, seed, tiers) gives the same list."""
    return _draw_problems(n, random.Random(seed), tuple(tiers), set())


def splits(num_train: int, num_heldout: int, seed: int, tiers=TIERS) -> tuple[list[Problem], list[Problem]]:
    """(train, heldout) that never share a question.

    The held-out set is drawn first from its own stream, so it depends only on
    (num_heldout, seed, tiers): growing num_train never changes what is evaluated.
    """
    tiers = tuple(tiers)
    seen: set[str] = set()
    heldout = _draw_problems(num_heldout, random.Random(f"bike_pricing/heldout/{seed}"), tiers, seen)
    train = _draw_problems(num_train, random.Random(f"bike_pricing/train/{seed}"), tiers, seen)
    return train, heldout
