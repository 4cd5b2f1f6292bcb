"""Bike pricing where the first bike's daily rate is only in a picture: its price tag.

The question is bike_pricing's, with one change: the first bike's sentence names the bike and the days but
not the rate ("Ana rents the e-bike in the picture for 3 days, at the daily rate on its tag."). The rate is
drawn on a 56 x 56 price tag in seven-segment digits, shifted by a few pixels at random so that no pixel
position alone gives it away. The worked solution is bike_pricing's, so the answer needs the picture: with a
blank tag a model can only guess among the seven rates.

The digits are drawn from rectangles, not a font, so a tag is the same image on every machine.
"""

from __future__ import annotations

import random

from PIL import Image, ImageDraw

from grpo_cli.tasks.bike_pricing import (
    CHECK_REWARDS,  # noqa: F401  the generator's (correctness, format) rewards, as scripts/ measure with
    TIERS,
    Problem,
    Rental,
    _article,
    _days,
    draw_rental,
    make_problem,
    render_question,
)
from grpo_cli.tasks.draw import draw_distinct

TAG_PIXELS = 56  # the tag is TAG_PIXELS x TAG_PIXELS, what the shipped model's vision tower sees unresized
MAX_SHIFT = 3  # the digits move up to this many pixels in x and y
PAPER, INK, EDGE = (250, 244, 224), (24, 24, 24), (150, 110, 60)
DIGIT_W, DIGIT_H, STROKE, GAP = 14, 26, 3, 4  # one seven-segment digit's box, its stroke and the gap between two
SEGMENTS = {0: "abcdef", 1: "bc", 2: "abged", 3: "abgcd", 4: "fgbc", 5: "afgcd", 6: "afgedc", 7: "abc",
            8: "abcdefg", 9: "abcdfg"}  # which segments light up: a top, b/c right, d bottom, e/f left, g middle


def _segment_boxes(x: int, y: int) -> dict[str, tuple[int, int, int, int]]:
    """Each segment's rectangle (x0, y0, x1, y1, inclusive) for a digit whose box starts at (x, y)."""
    w, h, t = DIGIT_W, DIGIT_H, STROKE
    mid = y + (h - t) // 2
    return {
        "a": (x, y, x + w - 1, y + t - 1), "g": (x, mid, x + w - 1, mid + t - 1), "d": (x, y + h - t, x + w - 1, y + h - 1),
        "f": (x, y, x + t - 1, mid + t - 1), "b": (x + w - t, y, x + w - 1, mid + t - 1),
        "e": (x, mid, x + t - 1, y + h - 1), "c": (x + w - t, mid, x + w - 1, y + h - 1),
    }


def blank_tag() -> Image.Image:
    """A price tag with nothing written on it."""
    image = Image.new("RGB", (TAG_PIXELS, TAG_PIXELS), PAPER)
    ImageDraw.Draw(image).rectangle((1, 1, TAG_PIXELS - 2, TAG_PIXELS - 2), outline=EDGE, width=2)
    return image


def price_tag(rate: int, shift: tuple[int, int] = (0, 0)) -> Image.Image:
    """The tag showing a daily rate of 1-99 in two seven-segment digits (a blank tens place below 10)."""
    if not 1 <= rate <= 99:
        raise ValueError(f"a price tag shows a rate of 1 to 99, got {rate}")
    image = blank_tag()
    draw = ImageDraw.Draw(image)
    x0 = (TAG_PIXELS - 2 * DIGIT_W - GAP) // 2 + shift[0]
    y0 = (TAG_PIXELS - DIGIT_H) // 2 + shift[1]
    tens, units = divmod(rate, 10)
    for place, digit in enumerate((tens, units)):
        if place == 0 and digit == 0:
            continue
        boxes = _segment_boxes(x0 + place * (DIGIT_W + GAP), y0)
        for segment in SEGMENTS[digit]:
            draw.rectangle(boxes[segment], fill=INK)
    return image


def _bike_in_picture(rng: random.Random, who: str, bike: str, rate: int, days: int) -> str:
    del rate  # on the tag, not in the text
    return rng.choice((
        f"{who} rents the {bike} in the picture for {_days(days)}, at the daily rate on its tag.",
        f"{who} hires the {bike} shown for {_days(days)}; its tag gives the price per day.",
        f"{_article(bike).capitalize()} like the one in the picture is rented by {who} for {_days(days)}, "
        "at the rate on its tag.",
    ))


class VisionProblem:
    """A bike_pricing problem with the first bike's price tag; `to_row()` carries it as a PIL image."""

    def __init__(self, problem: Problem, rental: Rental, shift: tuple[int, int]):
        self.problem, self.rental, self.shift = problem, rental, shift
        self.id, self.question, self.answer = problem.id, problem.question, problem.answer
        self.solution, self.tier = problem.solution, problem.tier

    @property
    def rate(self) -> int:
        return self.rental.bikes[0][1]

    def image(self) -> Image.Image:
        """The tag, named after the problem (the name completions.jsonl records)."""
        image = price_tag(self.rate, self.shift)
        image.info["name"] = f"{self.id}.png"
        return image

    def to_row(self) -> dict:
        return {**self.problem.to_row(), "image": self.image()}


def _draw_problems(n: int, rng: random.Random, tiers: tuple[int, ...], exclude: set[str]) -> list[VisionProblem]:
    def draw_one(rng: random.Random, tier: int) -> VisionProblem | None:
        rental = draw_rental(rng, tier)
        question = render_question(rental, rng, first_bike=_bike_in_picture)
        shift = (rng.randint(-MAX_SHIFT, MAX_SHIFT), rng.randint(-MAX_SHIFT, MAX_SHIFT))
        # The same words with another rate on the tag is another problem: the key holds both.
        key = f"{question}|{rental.bikes[0][1]}"
        if key in exclude:
            return None
        exclude.add(key)
        problem = make_problem(rental, question, tier)
        problem = Problem(id=problem.id.replace("bike-", "bikev-") + f"-{rental.bikes[0][1]}", question=question,
                          answer=problem.answer, solution=problem.solution, tier=tier)
        return VisionProblem(problem, rental, shift)

    return draw_distinct(n, rng, tuple(tiers), TIERS, "bike_pricing_vision", draw_one)


def splits(num_train: int, num_heldout: int, seed: int, tiers=TIERS) -> tuple[list[VisionProblem], list[VisionProblem]]:
    """(train, heldout) that never share a (question, tag) pair; the held-out set depends only on
    (num_heldout, seed, tiers), as bike_pricing's."""
    tiers = tuple(tiers)
    seen: set[str] = set()
    heldout = _draw_problems(num_heldout, random.Random(f"bike_pricing_vision/heldout/{seed}"), tiers, seen)
    train = _draw_problems(num_train, random.Random(f"bike_pricing_vision/train/{seed}"), tiers, seen)
    return train, heldout
