"""`grpo reward recipe=NAME cases=FILE.jsonl`: hand-written completions through a recipe's rewards, as a table.

Each line of the cases file is a JSON object: a `completion`, the dataset columns the rewards need
(e.g. `answer`), optionally `expected` (a number for the correctness reward, or {name: value}),
a `note`, and for a tool recipe the model's words as `completion` (what the rewards read as `completions`),
the whole conversation as `trajectory` and its `tool_calls` ([{"tool", "argument", "result", "ok"}]). Exit
code 1 when a case's score differs from its expected value or a reward fails.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from grpo_cli.errors import UsageError
from grpo_cli.prompts.images import ImageProblem, load_image
from grpo_cli.rewards.answers import as_text
from grpo_cli.rewards.load import RESERVED, close_reward_models, correctness_name, load_rewards, needed_columns
from grpo_cli.rewards.score import RewardFailures, SampleContext, score

_CASE_KEYS = ("completion", "expected", "note", "tool_calls", "trajectory")  # everything else is a dataset column


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
        if reserved := [k for k in RESERVED if k in case and k not in _CASE_KEYS]:  # tool_calls: a trajectory's
            raise UsageError(f"{path_text}:{lineno}: '{reserved[0]}' cannot be a column; the scorer passes it itself")
        case["_line"] = lineno
        cases.append(case)
    if not cases:
        raise UsageError(f"cases file '{path_text}' holds no cases")
    return cases


def read_case_images(case: dict, column: str | None, base_dir: Path, where: str) -> None:
    """A case's images (data.image_column: paths relative to the cases file, as a data file's), read in place
    into PIL images as a run's rows hold them, so a reward that looks at the picture gets it here too."""
    if not column or case.get(column) is None:
        return
    values = case[column] if isinstance(case[column], list) else [case[column]]
    try:
        case[column] = [load_image(value, base_dir) for value in values]
    except ImageProblem as e:
        raise UsageError(f"{where}: '{column}': {e}") from None


Expected = float | tuple[float | None, float | None]  # a value, or a range [low, high] (None: open on that side)


def expected_scores(case: dict, reward_names: list[str], correctness: str, where: str) -> dict[str, Expected]:
    """A case's `expected` as {function name: value or [low, high]}; a bare number is the correctness reward's
    value. A range is for a reward model, whose exact scores change whenever it is retrained."""
    expected = case.get("expected")
    if expected is None:
        return {}
    if isinstance(expected, int | float):
        return {correctness: float(expected)}
    if isinstance(expected, dict):
        out: dict[str, Expected] = {}
        for name, value in expected.items():
            if name not in reward_names:
                raise UsageError(f"{where}: expected names '{name}', not a reward of this recipe ({reward_names})")
            if isinstance(value, int | float):
                out[name] = float(value)
            elif (isinstance(value, list) and len(value) == 2 and any(v is not None for v in value)
                  and all(v is None or isinstance(v, int | float) for v in value)):
                out[name] = (None if value[0] is None else float(value[0]), None if value[1] is None else float(value[1]))
            else:
                raise UsageError(f"{where}: expected value for '{name}' must be a number or a range [low, high] "
                                 f"(null for an open end), got {value!r}")
        return out
    raise UsageError(f"{where}: 'expected' must be a number or {{name: number or [low, high]}}, got {expected!r}")


def meets(value: float, expected: Expected) -> bool:
    """Whether a score is the expected value (to 1e-9) or within the expected range."""
    if isinstance(expected, tuple):
        low, high = expected
        return (low is None or value >= low) and (high is None or value <= high)
    return math.isclose(value, expected, abs_tol=1e-9)


def shown(expected: Expected) -> str:
    if isinstance(expected, tuple):
        low, high = expected
        return f"[{'' if low is None else f'{low:g}'}, {'' if high is None else f'{high:g}'}]"
    return f"{expected:g}"


def _preview(completion: Any, width: int = 40) -> Any:
    from rich.text import Text

    text = as_text(completion)
    text = repr(completion) if text is None else text[: width * 4]
    # Newlines shown as ⏎; control and bidi characters as · so junk cannot garble the terminal.
    text = "".join("⏎" if ch == "\n" else " " if ch == "\t" else ch if ch.isprintable() else "·" for ch in text)
    # A Text object, not a str: brackets in a completion must not be read as rich markup.
    return Text(text if len(text) <= width else text[: width - 1] + "…")


def _cell(value: float, expected: Expected | None, failed: bool) -> str:
    if failed:
        return "[red]ERR[/red]"
    if expected is not None and not meets(value, expected):
        return f"[red]{value:g}∉{shown(expected)}[/red]" if isinstance(expected, tuple) else \
            f"[red]{value:g}≠{expected:g}[/red]"
    return f"{value:g}"


def run_cases(config: Any, run_dir: Any) -> int:
    """`grpo reward recipe=NAME cases=FILE.jsonl`: score every case with the recipe's rewards, check `expected`."""

    rewards = load_rewards(config.rewards)
    try:
        return score_cases(config, rewards)
    finally:
        close_reward_models(rewards)  # a server started for a reward model (rewards[i].server=start)


def score_cases(config: Any, rewards: list) -> int:
    """run_cases with the rewards loaded: the table, and 1 when a case fails."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    names = [r.name for r in rewards]
    cases = read_cases(config.cases)
    wheres = [f"{config.cases}:{c['_line']}" for c in cases]
    expectations = [expected_scores(c, names, correctness_name(rewards), w) for c, w in zip(cases, wheres, strict=True)]
    needed = needed_columns(rewards)
    for case, where in zip(cases, wheres, strict=True):
        missing = [c for c in needed if c not in case]
        if missing:
            raise UsageError(f"{where}: no '{missing[0]}' field, which the rewards need (add it beside 'completion')")
        read_case_images(case, config.data.image_column, Path(config.cases).parent, where)

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
        prompt = case.get(config.data.prompt_column)
        context = SampleContext(prompts=[prompt] if isinstance(prompt, str) else None,
                                tool_calls=[case["tool_calls"]] if "tool_calls" in case else None,
                                trajectories=[case["trajectory"]] if "trajectory" in case else None)
        _, per_function, _ = score(rewards, [case["completion"]], columns, config.data.answer_format, case_failures,
                                   context=context)
        for name, count in case_failures.counts.items():
            failures.record(name, count, f"{where}: {case_failures.last_error[name]}")
        for name in names:
            totals[name] += per_function[name][0]
        mismatched = [n for n, v in expected.items() if not meets(per_function[n][0], v)]
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
        shown_expected = " ".join(f"{n}={shown(v)}" for n, v in expected.items()) or "-"
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
