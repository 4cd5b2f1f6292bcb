"""Final-answer extraction: the one place that decides what answer a completion states.

Every function here is pure, never raises on a completion whatever it holds, and uses only
regexes and scans that run in linear time, so a 1 MB adversarial string costs milliseconds.
The reward functions (grpo_cli.rewards) and maj@k voting (grpo_cli.evaluate) read answers
through `final_answers` / `final_answer`.
"""

from __future__ import annotations

import re
from decimal import ROUND_HALF_UP, Decimal, InvalidOperation, localcontext
from typing import Any

from grpo_cli.config import ANSWER_FORMATS

CENT = Decimal("0.01")
MAX_ANSWER_CHARS = 64  # a final answer longer than this is garbage, not a number worth parsing

# answer_line: "Answer: X" anywhere (a line start, or inline after the working: "... = 48.6. Answer: 48.6"),
# with optional markdown ("**Answer:** X", "Final answer: X"); X is the rest of that line. "answer" must not
# end a longer word. No two neighbouring quantifiers can match the same character, so a failed match
# backtracks at most once over each position: linear time on any input.
_ANSWER_LINE = re.compile(r"(?<![a-z])answer[ \t]*(?:[*_]+[ \t]*)?:([^\n]*)", re.IGNORECASE)
# answer_tag: <answer>X</answer>; X cannot contain '<', so a match never spans two tags.
_ANSWER_TAG = re.compile(r"<answer>([^<]*)</answer>", re.IGNORECASE)
# hash: a line "#### X" (GSM8K's solutions); X is the rest of the line.
_HASH_LINE = re.compile(r"^[ \t]*####([^\n]*)", re.MULTILINE)
_BOXED = re.compile(r"\\(?:boxed|fbox)[ ]*\{")
MAX_BOXED_DEPTH = 50  # deeper nesting is not an answer

_CURRENCY = r"(?:[$€£]|usd|eur|gbp|dollars?|euros?)"
# Whole-string pattern for one amount: optional sign and currency on either side,
# digits with optional thousands separators (strict groups of three), optional decimals.
_AMOUNT = re.compile(
    rf"(?P<sign>[-+\u2212]?)[ ]?(?P<cur>{_CURRENCY})?[ ]?(?P<sign2>[-+\u2212]?)"
    r"(?P<int>[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.(?P<frac>[0-9]+))?"
    rf"(?:[ ]?(?P<cur2>{_CURRENCY}))?",
    re.IGNORECASE,
)


def parse_amount(text: Any) -> Decimal | None:
    """'$1,250.50' -> Decimal('1250.50'); anything that is not one clean number -> None."""
    if not isinstance(text, str):
        return None
    # Tolerate markdown emphasis and a sentence's full stop around the number.
    text = text.strip().strip("*_ \t").removesuffix(".").strip("*_ \t")
    if not text or len(text) > MAX_ANSWER_CHARS:
        return None
    m = _AMOUNT.fullmatch(text)
    if m is None or (m["sign"] and m["sign2"]) or (m["cur"] and m["cur2"]):
        return None
    digits = m["int"].replace(",", "") + "." + (m["frac"] or "0")
    negative = "-" in (m["sign"] + m["sign2"]) or "\u2212" in (m["sign"] + m["sign2"])
    try:
        value = Decimal(digits)
    except InvalidOperation:
        return None
    return -value if negative else value


def to_cents(value: Decimal) -> Decimal:
    """Round to cent precision, half up (48.605 -> 48.61)."""
    with localcontext() as ctx:
        ctx.prec = 100  # MAX_ANSWER_CHARS digits always fit, so quantize never overflows
        return value.quantize(CENT, rounding=ROUND_HALF_UP)


def as_text(completion: Any) -> str | None:
    if isinstance(completion, str):
        return completion
    if isinstance(completion, bytes | bytearray):
        return bytes(completion).decode("utf-8", errors="replace")
    return None


def _boxed_contents(text: str) -> list[str]:
    """The contents of every top-level \\boxed{...} (nested braces kept whole), in one left-to-right pass."""
    found, position = [], 0
    while (m := _BOXED.search(text, position)) is not None:
        depth, i = 1, m.end()
        while i < len(text) and 0 < depth <= MAX_BOXED_DEPTH:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth:  # unclosed or too deep: no answer here, and nothing after it can close it either
            break
        found.append(text[m.end() : i - 1])
        position = i  # a \\boxed nested inside this one is part of its contents, not a second answer
    return found


def _without_prompt(text: str, prompt: Any) -> str:
    """The completion with every verbatim copy of the prompt's text removed: an answer marker the model
    only repeats from the question (a restatement) is not an answer it gives."""
    if isinstance(prompt, str) and len(prompt.strip()) >= 8:
        return text.replace(prompt.strip(), " ")
    return text


def final_answers(completion: Any, answer_format: str = "answer_line", prompt: Any = None) -> list[str]:
    """Every raw final-answer string the completion states, in order (unparsed). One rule per format:

    - answer_line: each `Answer: X` anywhere in the text (line start or inline; `**Answer:**`, `Final
      answer:` too); X is the rest of its line.
    - answer_tag: each `<answer>X</answer>`.
    - boxed: each top-level `\\boxed{X}` (or `\\fbox{X}`), nested braces included: `\\boxed{\\frac{1}{2}}`.
    - hash: each line that opens with `#### X` (GSM8K's format); X is the rest of the line.

    Text copied verbatim from `prompt` (the question, when the scorer passes it) is skipped first.
    Callers refuse a completion whose stated answers differ (see `final_answer`).
    """
    text = as_text(completion)
    if text is None:
        return []
    if answer_format not in ANSWER_FORMATS:
        raise ValueError(f"answer_format '{answer_format}' is not one of {', '.join(ANSWER_FORMATS)}")
    text = _without_prompt(text, prompt)
    if answer_format == "boxed":
        return _boxed_contents(text)
    pattern = {"answer_line": _ANSWER_LINE, "answer_tag": _ANSWER_TAG, "hash": _HASH_LINE}[answer_format]
    return [m.group(1) for m in pattern.finditer(text)]


def final_answer(completion: Any, answer_format: str = "answer_line", prompt: Any = None) -> Decimal | None:
    """The final answer at cent precision: the last one stated, provided every stated answer agrees with
    it. None when there is none, one is not a clean number, or two differ (hedging between answers)."""
    values = {parse_amount(raw) for raw in final_answers(completion, answer_format, prompt)}
    values = {to_cents(v) if v is not None else None for v in values}
    if len(values) != 1 or None in values:
        return None
    return values.pop()
