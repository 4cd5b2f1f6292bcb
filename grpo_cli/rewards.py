"""Reward functions, their loading and weighting, and the `grpo reward` harness.

A reward function is a plain function `(completions: list[str], **columns) -> list[float]`.
Dataset columns arrive by name (e.g. `answer=[...]`, one value per completion),
plus `answer_format="answer_line" | "answer_tag"`; every function takes
`**kwargs` so it can ignore what it does not need.

The checkers below never raise on a completion, whatever it holds, and only use
regexes that run in linear time, so a 1 MB adversarial string costs milliseconds.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import json
import math
import os
import re
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import ROUND_HALF_UP, Decimal, InvalidOperation, localcontext
from pathlib import Path
from typing import Any, NamedTuple

from grpo_cli.errors import UsageError

RewardFn = Callable[..., list]

ANSWER_FORMATS = ("answer_line", "answer_tag")
CENT = Decimal("0.01")
MAX_ANSWER_CHARS = 64  # a final answer longer than this is garbage, not a number worth parsing

# "Answer: X" must open a line (after optional markdown like "**" or "#"); X is the rest of the line.
# No two neighbouring quantifiers can match the same character, so a failed match
# backtracks at most once over each line: linear time on any input.
_ANSWER_LINE = re.compile(r"^[ \t]*(?:[*_#>]+[ \t]*)?answer[ \t]*(?:[*_]+[ \t]*)?:([^\n]*)", re.IGNORECASE | re.MULTILINE)
# <answer>X</answer>; X cannot contain '<', so a match never spans two tags.
_ANSWER_TAG = re.compile(r"<answer>([^<]*)</answer>", re.IGNORECASE)

_CURRENCY = r"(?:[$€£]|usd|eur|gbp|dollars?|euros?)"
# Whole-string pattern for one amount: optional sign and currency on either side,
# digits with optional thousands separators (strict groups of three), optional decimals.
_AMOUNT = re.compile(
    rf"(?P<sign>[-+\u2212]?)[ ]?(?P<cur>{_CURRENCY})?[ ]?(?P<sign2>[-+\u2212]?)"
    r"(?P<int>[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.(?P<frac>[0-9]+))?"
    rf"(?:[ ]?(?P<cur2>{_CURRENCY}))?",
    re.IGNORECASE,
)


# ---------------------------------------------------------------------------
# parsing


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


def final_answers(completion: Any, answer_format: str = "answer_line") -> list[str]:
    """Every raw final-answer string the completion states, in order (unparsed)."""
    text = as_text(completion)
    if text is None:
        return []
    if answer_format not in ANSWER_FORMATS:
        raise ValueError(f"answer_format '{answer_format}' is not one of {', '.join(ANSWER_FORMATS)}")
    pattern = _ANSWER_TAG if answer_format == "answer_tag" else _ANSWER_LINE
    return [m.group(1) for m in pattern.finditer(text)]


def final_answer(completion: Any, answer_format: str = "answer_line") -> Decimal | None:
    """The one final answer, at cent precision; None when there is none, one is garbage, or two differ."""
    values = {parse_amount(raw) for raw in final_answers(completion, answer_format)}
    values = {to_cents(v) if v is not None else None for v in values}
    if len(values) != 1 or None in values:
        return None
    return values.pop()


# ---------------------------------------------------------------------------
# built-in rewards


def correct(completions: list, answer: list, answer_format: str = "answer_line", **kwargs: Any) -> list[float]:
    """1.0 when the single final answer equals the gold `answer` at cent precision, else 0.0."""
    scores = []
    for completion, gold in zip(completions, answer, strict=True):
        gold_value = parse_amount(str(gold))
        if gold_value is None:
            raise ValueError(f"gold answer {gold!r} is not a number")
        got = final_answer(completion, answer_format)
        scores.append(1.0 if got is not None and got == to_cents(gold_value) else 0.0)
    return scores


def format_ok(completions: list, answer_format: str = "answer_line", **kwargs: Any) -> list[float]:
    """1.0 when the final answer is stated exactly once and is a clean number, else 0.0."""
    scores = []
    for completion in completions:
        raw = final_answers(completion, answer_format)
        scores.append(1.0 if len(raw) == 1 and parse_amount(raw[0]) is not None else 0.0)
    return scores


def overlong(completions: list, completion_tokens: list | None = None, max_new_tokens: int | None = None,
             buffer: int = 32, **kwargs: Any) -> list[float]:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), from each completion's token count |y|
    and the cap L = rollout.max_new_tokens (both passed by the trainer and by `grpo eval`):

        0 for |y| <= L - buffer;   ((L - buffer) - |y|) / buffer for L - buffer < |y| <= L;   -1 beyond L.

    A linear fall from 0 to -1 over the last `buffer` tokens before the cap (set it with
    `args: {buffer: N}`), so long answers are discouraged before they are cut off.
    """
    if completion_tokens is None or max_new_tokens is None:
        raise ValueError("overlong needs completion_tokens and max_new_tokens, which grpo train and grpo eval pass")
    if not 0 < buffer <= max_new_tokens:
        raise ValueError(f"overlong: buffer={buffer} must be in 1..max_new_tokens={max_new_tokens}")
    safe = max_new_tokens - buffer
    return [0.0 if n <= safe else -1.0 if n > max_new_tokens else (safe - n) / buffer for n in completion_tokens]


BUILTIN_REWARDS: dict[str, RewardFn] = {
    "correct": correct,
    "format": format_ok,
    "overlong": overlong,
}


# ---------------------------------------------------------------------------
# loading


@dataclass(frozen=True)
class WeightedReward:
    name: str  # as written in the recipe: a builtin name or "module:function"
    fn: RewardFn
    weight: float
    args: dict = field(default_factory=dict)  # the recipe's extra keyword arguments (rewards[i].args)


def load_reward(name: str) -> RewardFn:
    """A builtin reward by name, or a custom one as "package.module:function"."""
    if name in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[name]
    if ":" not in name:
        close = difflib.get_close_matches(name, BUILTIN_REWARDS, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise UsageError(f"unknown reward '{name}'{hint}; built-in: {', '.join(BUILTIN_REWARDS)}, "
                           "or a custom one as package.module:function")
    module_name, _, func_name = name.partition(":")
    if not module_name or not func_name:
        raise UsageError(f"reward '{name}' must look like package.module:function")
    # Like `python -m`, let a rewards module in the current directory be found.
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise UsageError(f"reward '{name}': cannot import module '{module_name}' ({e}); "
                           "check the name and that it is importable from here") from None
    except Exception as e:
        raise UsageError(f"reward '{name}': importing '{module_name}' failed: {type(e).__name__}: {e}") from None
    fn = getattr(module, func_name, None)
    if fn is None:
        raise UsageError(f"reward '{name}': module '{module_name}' has no function '{func_name}'")
    if not callable(fn):
        raise UsageError(f"reward '{name}': '{func_name}' in '{module_name}' is not callable")
    if not _takes_var_kwargs(fn):
        raise UsageError(f"reward '{name}' must accept **kwargs: columns and answer_format arrive by name")
    return fn


def _takes_var_kwargs(fn: RewardFn) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # some builtins have no signature; let them through
        return True
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def load_rewards(specs: list) -> list[WeightedReward]:
    """The recipe's `rewards` list (RewardSpec) -> loaded functions with weights. Fails at the edge."""
    loaded, seen = [], set()
    for i, spec in enumerate(specs):
        if spec.name in seen:
            raise UsageError(f"rewards[{i}]: '{spec.name}' is listed twice; give it one entry with the summed weight")
        seen.add(spec.name)
        if not math.isfinite(spec.weight):
            raise UsageError(f"rewards[{i}].weight: {spec.weight} is not a finite number")
        args = dict(getattr(spec, "args", None) or {})
        if clash := sorted(set(args) & set(_RESERVED)):
            raise UsageError(f"rewards[{i}].args: {', '.join(clash)} is passed by the scorer itself; drop it")
        loaded.append(WeightedReward(spec.name, load_reward(spec.name), float(spec.weight), args))
    return loaded


def required_columns(fn: RewardFn) -> list[str]:
    """Dataset columns a reward function needs: its named parameters without defaults, after `completions`."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return []
    return [p.name for p in params[1:]
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is p.empty]


def needed_columns(rewards: list[WeightedReward]) -> list[str]:
    return sorted({c for r in rewards for c in required_columns(r.fn)})


def validate_columns(rows: list[dict], needed: list, where: str = "row") -> None:
    """Every row must hold every column the rewards need; the error names the first bad row (0-based).

    `needed` is a list of column names, or the loaded rewards themselves (their needs are read off
    their signatures).
    """
    columns = [c for c in needed if isinstance(c, str)]
    columns += needed_columns([r for r in needed if isinstance(r, WeightedReward)])
    for i, row in enumerate(rows):
        for column in columns:
            if column not in row or row[column] is None:
                raise UsageError(f"{where} {i}: no '{column}' column, which the rewards need "
                                   f"(columns present: {', '.join(sorted(row)) or 'none'})")


# ---------------------------------------------------------------------------
# scoring


@dataclass
class RewardFailures:
    """Samples a reward function could not score (it raised, returned the wrong count, or NaN/inf).

    Those samples score 0 for that function; the caller decides when too many is too many.
    """

    counts: Counter = field(default_factory=Counter)  # function name -> samples scored 0 because of a failure
    last_error: dict[str, str] = field(default_factory=dict)  # function name -> the latest reason, one line

    def record(self, name: str, samples: int, reason: str) -> None:
        self.counts[name] += samples
        self.last_error[name] = reason

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def _call_reward(reward: WeightedReward, completions: list, columns: dict[str, list], answer_format: str,
                 failures: RewardFailures, extra: dict[str, Any]) -> list[float]:
    n = len(completions)
    try:
        values = list(reward.fn(completions, **columns, answer_format=answer_format, **extra, **reward.args))
    except Exception as e:
        failures.record(reward.name, n, f"raised {type(e).__name__}: {' '.join(str(e).split())[:200]}")
        return [0.0] * n
    if len(values) != n:
        failures.record(reward.name, n, f"returned {len(values)} values for {n} completions")
        return [0.0] * n
    scores = []
    bad = 0
    for v in values:
        try:
            x = float(v)
        except (TypeError, ValueError):
            x = math.nan
        if not math.isfinite(x):
            bad += 1
            x = 0.0
        scores.append(x)
    if bad:
        failures.record(reward.name, bad, f"returned {bad} non-finite or non-numeric values")
    return scores


class Scores(NamedTuple):
    total: list[float]  # [N] weighted sum over the reward functions
    per_function: dict[str, list[float]]  # name -> [N] raw scores, in recipe order (the first is the main one)


# keyword names the scorer itself passes (the last two when the caller knows them: grpo train, grpo eval)
_RESERVED = ("completions", "answer_format", "completion_tokens", "max_new_tokens")


def score(rewards: list[WeightedReward], completions: list, columns: dict[str, list], answer_format: str,
          failures: RewardFailures | None = None, completion_tokens: list[int] | None = None,
          max_new_tokens: int | None = None) -> Scores:
    """Score N completions with every reward; columns are aligned with completions (each [N]).
    `completion_tokens` ([N] token counts) and `max_new_tokens` (the cap) reach the functions
    that take them (e.g. `overlong`) when given.

    A function that fails scores 0 on the samples it failed, and `failures` (when given)
    counts them; pass one RewardFailures across steps to watch the rate.
    """
    for name, values in columns.items():
        if name in _RESERVED:
            raise ValueError(f"a dataset column is named '{name}', which reward functions receive as an argument; "
                             "rename the column")
        if len(values) != len(completions):
            raise ValueError(f"column '{name}' has {len(values)} values for {len(completions)} completions")
    failures = failures if failures is not None else RewardFailures()
    extra = {k: v for k, v in (("completion_tokens", completion_tokens), ("max_new_tokens", max_new_tokens))
             if v is not None}
    per_function = {r.name: _call_reward(r, completions, columns, answer_format, failures, extra) for r in rewards}
    total = [sum(r.weight * per_function[r.name][i] for r in rewards) for i in range(len(completions))]
    return Scores(total, per_function)


# ---------------------------------------------------------------------------
# the `grpo reward` harness

_CASE_KEYS = ("completion", "expected", "note")  # everything else in a case is a dataset column


def read_cases(path_text: str) -> list[dict]:
    path = Path(path_text)
    if not path.is_file():
        raise UsageError(f"cases file '{path_text}' not found")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"cannot read cases file '{path_text}': {e}") from None
    cases = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            case = json.loads(line)
        except json.JSONDecodeError as e:
            raise UsageError(f"{path_text}:{lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(case, dict):
            raise UsageError(f"{path_text}:{lineno}: each line must be a JSON object with a 'completion'")
        if "completion" not in case:
            raise UsageError(f"{path_text}:{lineno}: no 'completion' field")
        if reserved := [k for k in _RESERVED if k in case]:
            raise UsageError(f"{path_text}:{lineno}: '{reserved[0]}' cannot be a column; the scorer passes it itself")
        case["_line"] = lineno
        cases.append(case)
    if not cases:
        raise UsageError(f"cases file '{path_text}' holds no cases")
    return cases


def expected_scores(case: dict, reward_names: list[str], where: str) -> dict[str, float]:
    """A case's `expected` as {function name: value}; a bare number is the `correct` reward's value."""
    expected = case.get("expected")
    if expected is None:
        return {}
    if isinstance(expected, int | float):
        if "correct" not in reward_names:
            raise UsageError(f"{where}: a bare 'expected' number refers to the 'correct' reward, which this "
                               f"recipe lacks; write it as {{\"NAME\": value}} with NAME in {reward_names}")
        return {"correct": float(expected)}
    if isinstance(expected, dict):
        for name, value in expected.items():
            if name not in reward_names:
                raise UsageError(f"{where}: expected names '{name}', not a reward of this recipe ({reward_names})")
            if not isinstance(value, int | float):
                raise UsageError(f"{where}: expected value for '{name}' must be a number, got {value!r}")
        return {name: float(value) for name, value in expected.items()}
    raise UsageError(f"{where}: 'expected' must be a number or {{name: number}}, got {expected!r}")


def _preview(completion: Any, width: int = 40) -> Any:
    from rich.text import Text

    text = as_text(completion)
    text = repr(completion) if text is None else text[: width * 4]
    # Newlines shown as ⏎; control and bidi characters as · so junk cannot garble the terminal.
    text = "".join("⏎" if ch == "\n" else " " if ch == "\t" else ch if ch.isprintable() else "·" for ch in text)
    # A Text object, not a str: brackets in a completion must not be read as rich markup.
    return Text(text if len(text) <= width else text[: width - 1] + "…")


def _cell(value: float, expected: float | None, failed: bool) -> str:
    if failed:
        return "[red]ERR[/red]"
    if expected is not None and not math.isclose(value, expected, abs_tol=1e-9):
        return f"[red]{value:g}≠{expected:g}[/red]"
    return f"{value:g}"


def run_cases(config: Any, run_dir: Any) -> int:
    """`grpo reward recipe=NAME cases=FILE.jsonl`: score every case with the recipe's rewards, check `expected`."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    rewards = load_rewards(config.rewards)
    names = [r.name for r in rewards]
    cases = read_cases(config.cases)
    wheres = [f"{config.cases}:{c['_line']}" for c in cases]
    expectations = [expected_scores(c, names, w) for c, w in zip(cases, wheres, strict=True)]
    needed = needed_columns(rewards)
    for case, where in zip(cases, wheres, strict=True):
        missing = [c for c in needed if c not in case]
        if missing:
            raise UsageError(f"{where}: no '{missing[0]}' field, which the rewards need (add it beside 'completion')")

    table = Table(title=escape(f"rewards of recipe '{config.task}' on {config.cases} ({config.data.answer_format})"))
    table.add_column("#", justify="right")
    table.add_column("completion", no_wrap=True, overflow="ellipsis", max_width=40)
    for name in names:
        table.add_column(name, justify="right", no_wrap=True)
    table.add_column("expected", no_wrap=True)
    table.add_column("result", no_wrap=True)

    failures = RewardFailures()
    totals = {name: 0.0 for name in names}
    passed = failed = unchecked = 0
    for case, where, expected in zip(cases, wheres, expectations, strict=True):
        # One case at a time: a reward that crashes on one case shows on that row only.
        columns = {k: [v] for k, v in case.items() if k not in _CASE_KEYS and not k.startswith("_")}
        case_failures = RewardFailures()
        _, per_function = score(rewards, [case["completion"]], columns, config.data.answer_format, case_failures)
        for name, count in case_failures.counts.items():
            failures.record(name, count, f"{where}: {case_failures.last_error[name]}")
        for name in names:
            totals[name] += per_function[name][0]
        mismatched = [n for n, v in expected.items() if not math.isclose(per_function[n][0], v, abs_tol=1e-9)]
        if case_failures.counts or mismatched:
            failed += 1
            result = "[red]FAIL[/red]"
        elif expected:
            passed += 1
            result = "[green]PASS[/green]"
        else:
            unchecked += 1
            result = "-"
        cells = [_cell(per_function[n][0], expected.get(n), n in case_failures.counts) for n in names]
        shown_expected = " ".join(f"{n}={v:g}" for n, v in expected.items()) or "-"
        table.add_row(str(case["_line"]), _preview(case["completion"]), *cells, shown_expected, result)

    console = Console(width=max(Console().width, 100))
    console.print(table)
    means = ", ".join(f"{name} {totals[name] / len(cases):.3f}" for name in names)
    console.print(f"{len(cases)} cases: {passed} passed, {failed} failed, {unchecked} without expected; mean {means}",
                  highlight=False)
    for name, count in failures.counts.items():
        console.print(f"[red]reward '{name}' failed on {count} case(s); last: {escape(failures.last_error[name])}[/red]",
                      highlight=False)
    return 1 if failed else 0
