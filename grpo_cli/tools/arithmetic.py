"""A small exact arithmetic parser: whole numbers, + - * / and parentheses, never `eval`.

Countdown's rewards read the stated expression with it; its value is a Fraction, so 7 / 2 * 2 is 7.
The calculator tool (grpo_cli.tools.builtin) reads decimals too (`decimals=True`).
"""

from __future__ import annotations

import re
from fractions import Fraction

MAX_EXPRESSION_CHARS = 120
_EXPR_TOKEN = re.compile(r"\s*(?:([0-9]+)|([-+*/()×÷−]))")
_EXPR_TOKEN_DECIMALS = re.compile(r"\s*(?:([0-9]+(?:\.[0-9]+)?)|([-+*/()×÷−]))")
_SYNONYMS = {"×": "*", "÷": "/", "−": "-"}


def parse_expression(text: str, decimals: bool = False) -> tuple[Fraction, list] | None:
    """`(12 - 7) * 3` -> (Fraction(15), [12, 7, 3]): its exact value and the numbers it uses, in order.
    Whole numbers (and, with `decimals`, numbers like 18.25, read exactly as Fractions), + - * / and
    parentheses only (no unary minus, no implicit product); None for anything else, a division by
    zero, or over MAX_EXPRESSION_CHARS characters."""
    text = text.strip()
    if not text or len(text) > MAX_EXPRESSION_CHARS:
        return None
    pattern, number = (_EXPR_TOKEN_DECIMALS, Fraction) if decimals else (_EXPR_TOKEN, int)
    tokens: list = []
    position = 0
    while position < len(text):
        m = pattern.match(text, position)
        if m is None:
            return None
        tokens.append(number(m.group(1)) if m.group(1) else _SYNONYMS.get(m.group(2), m.group(2)))
        position = m.end()
    numbers: list = []

    def expression(i: int) -> tuple[Fraction, int]:  # expression := term (('+' | '-') term)*
        value, i = term(i)
        while i < len(tokens) and tokens[i] in ("+", "-"):
            rhs, j = term(i + 1)
            value, i = (value + rhs if tokens[i] == "+" else value - rhs), j
        return value, i

    def term(i: int) -> tuple[Fraction, int]:  # term := factor (('*' | '/') factor)*
        value, i = factor(i)
        while i < len(tokens) and tokens[i] in ("*", "/"):
            rhs, j = factor(i + 1)
            if tokens[i] == "/" and rhs == 0:
                raise ZeroDivisionError
            value, i = (value * rhs if tokens[i] == "*" else value / rhs), j
        return value, i

    def factor(i: int) -> tuple[Fraction, int]:  # factor := NUMBER | '(' expression ')'
        if i < len(tokens) and not isinstance(tokens[i], str):
            numbers.append(tokens[i])
            return Fraction(tokens[i]), i + 1
        if i < len(tokens) and tokens[i] == "(":
            value, j = expression(i + 1)
            if j < len(tokens) and tokens[j] == ")":
                return value, j + 1
        raise ValueError("not an expression")

    try:  # recursion depth is bounded by MAX_EXPRESSION_CHARS parentheses
        value, end = expression(0)
    except (ValueError, ZeroDivisionError):
        return None
    return (value, numbers) if end == len(tokens) else None
