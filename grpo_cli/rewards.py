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
import numbers
import os
import re
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any, NamedTuple

# Answer extraction lives in grpo_cli.answers; these names are re-exported for reward authors.
from grpo_cli.answers import (  # noqa: F401 (re-exported)
    ANSWER_FORMATS,
    as_text,
    final_answer,
    final_answers,
    parse_amount,
    to_cents,
)
from grpo_cli.errors import UsageError

RewardFn = Callable[..., list]


# ---------------------------------------------------------------------------
# built-in rewards


def _prompts(prompt: list | None, n: int) -> list:
    return list(prompt) if prompt is not None else [None] * n


def correct(completions: list, answer: list, answer_format: str = "answer_line", prompt: list | None = None,
            **kwargs: Any) -> list[float]:
    """1.0 when the single final answer equals the gold `answer` at cent precision, else 0.0."""
    scores = []
    for completion, gold, question in zip(completions, answer, _prompts(prompt, len(completions)), strict=True):
        gold_value = parse_amount(str(gold))
        if gold_value is None:
            raise ValueError(f"gold answer {gold!r} is not a number")
        got = final_answer(completion, answer_format, question)
        scores.append(1.0 if got is not None and got == to_cents(gold_value) else 0.0)
    return scores


def format_ok(completions: list, answer_format: str = "answer_line", prompt: list | None = None,
              **kwargs: Any) -> list[float]:
    """1.0 when the final answer is stated exactly once and is a clean number, else 0.0."""
    scores = []
    for completion, question in zip(completions, _prompts(prompt, len(completions)), strict=True):
        raw = final_answers(completion, answer_format, question)
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


def _as_written(raw: str) -> str:
    """A stated answer with its whitespace collapsed and markdown or a full stop around it removed."""
    return " ".join(raw.split()).strip("*_ .")


def _one_stated(completion: Any, answer_format: str, prompt: Any) -> str | None:
    """The completion's final answer as written (stripped), when every stated answer is the same text."""
    stated = {_as_written(raw) for raw in final_answers(completion, answer_format, prompt)}
    return stated.pop() if len(stated) == 1 and "" not in stated else None


# A number followed only by words ("18 dollars", "5 bikes") is that number; math-verify would read the
# words as a product of symbols.
_NUMBER_THEN_WORDS = re.compile(r"([-+]?[$€£]?[0-9][0-9,]*(?:\.[0-9]+)?)[ ]*[A-Za-z][A-Za-z ]*")


def _math_parse(text: str) -> list:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    if m := _NUMBER_THEN_WORDS.fullmatch(text):
        text = m.group(1)
    return parse(f"${text}$", extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()])


def gold_answer(gold: Any) -> str:
    """A gold `answer` column as the bare answer: GSM8K's `... #### 72`, MATH's `\boxed{...}`
    and an `Answer:` line are reduced to what they mark; anything else is taken as it is."""
    text = str(gold)
    for answer_format in ("hash", "boxed", "answer_tag", "answer_line"):
        if (found := _one_stated(text, answer_format, None)) is not None:
            return found
    return text.strip()


def math_equal(completions: list, answer: list, answer_format: str = "answer_line", prompt: list | None = None,
               **kwargs: Any) -> list[float]:
    """1.0 when the completion's single final answer is mathematically equal to the gold `answer`
    (math-verify: `0.5` = `1/2` = `\frac{1}{2}`, `1,000` = `1000`), else 0.0. The gold may be a
    full solution (see `gold_answer`). A completion stating two different answers scores 0."""
    from math_verify import verify

    scores = []
    parsed_gold: dict[str, list] = {}
    for completion, gold, question in zip(completions, answer, _prompts(prompt, len(completions)), strict=True):
        key = gold_answer(gold)
        if key not in parsed_gold:
            parsed_gold[key] = _math_parse(key)
            if not parsed_gold[key]:
                raise ValueError(f"gold answer {gold!r} does not parse as math")
        got = _one_stated(completion, answer_format, question)
        if got is None or len(got) > 200:
            scores.append(0.0)
            continue
        target = _math_parse(got)
        scores.append(1.0 if target and verify(parsed_gold[key], target) else 0.0)
    return scores


def single_answer(completions: list, answer_format: str = "answer_line", prompt: list | None = None,
                  **kwargs: Any) -> list[float]:
    """1.0 when the completion states exactly one final answer (any content: LaTeX, words), else 0.0:
    the format reward for answers that are not plain numbers (`format` wants a clean number)."""
    stated = [final_answers(c, answer_format, q) for c, q in zip(completions, _prompts(prompt, len(completions)),
                                                                  strict=True)]
    return [1.0 if len(raw) == 1 and _as_written(raw[0]) else 0.0 for raw in stated]


# <think>reasoning</think> then <answer>X</answer> and nothing else: the layout DeepSeek-R1 trained with.
_THINK_ANSWER = re.compile(r"\s*<think>[^<]*(?:<(?!/?think>|/?answer>)[^<]*)*</think>\s*<answer>[^<]*</answer>\s*")


def think_format(completions: list, **kwargs: Any) -> list[float]:
    """1.0 when the completion is exactly `<think>...</think>` followed by `<answer>...</answer>`
    (whitespace around them allowed, no second think or answer tag), else 0.0."""
    return [1.0 if (text := as_text(c)) is not None and _THINK_ANSWER.fullmatch(text) else 0.0
            for c in completions]


# ---------------------------------------------------------------------------
# countdown: a safe arithmetic parser (never eval)

MAX_EXPRESSION_CHARS = 120
_EXPR_TOKEN = re.compile(r"\s*(?:([0-9]+)|([-+*/()×÷−]))")
_SYNONYMS = {"×": "*", "÷": "/", "−": "-"}


def parse_expression(text: str) -> tuple[Fraction, list[int]] | None:
    """`(12 - 7) * 3` -> (Fraction(15), [12, 7, 3]): its exact value and the numbers it uses, in order.
    Whole numbers, + - * / and parentheses only (no unary minus, no implicit product); None for
    anything else, a division by zero, or over MAX_EXPRESSION_CHARS characters."""
    text = text.strip()
    if not text or len(text) > MAX_EXPRESSION_CHARS:
        return None
    tokens, position = [], 0
    while position < len(text):
        m = _EXPR_TOKEN.match(text, position)
        if m is None:
            return None
        tokens.append(int(m.group(1)) if m.group(1) else _SYNONYMS.get(m.group(2), m.group(2)))
        position = m.end()
    numbers: list[int] = []

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
        if i < len(tokens) and isinstance(tokens[i], int):
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


def _countdown_expression(completion: Any, numbers: Any, answer_format: str, prompt: Any):
    """(value, uses every given number exactly once) of the completion's final expression, or None."""
    stated = _one_stated(completion, answer_format, prompt)
    parsed = parse_expression(stated.split("=")[0]) if stated is not None else None
    if parsed is None:
        return None
    value, used = parsed
    return value, sorted(used) == sorted(int(n) for n in numbers)


def countdown(completions: list, numbers: list, target: list, answer_format: str = "answer_line",
              prompt: list | None = None, **kwargs: Any) -> list[float]:
    """1.0 when the final answer is an expression that uses each of `numbers` exactly once with + - * /
    and equals `target` exactly (fractions allowed on the way), else 0.0. `Answer: (12 - 7) * 3` and
    `Answer: (12 - 7) * 3 = 15` both state the expression; any correct expression counts."""
    scores = []
    for completion, given, goal, question in zip(completions, numbers, target, _prompts(prompt, len(completions)),
                                                 strict=True):
        got = _countdown_expression(completion, given, answer_format, question)
        scores.append(1.0 if got is not None and got[1] and got[0] == int(goal) else 0.0)
    return scores


def countdown_valid(completions: list, numbers: list, answer_format: str = "answer_line",
                    prompt: list | None = None, **kwargs: Any) -> list[float]:
    """1.0 when the final answer is a well-formed expression using each of `numbers` exactly once,
    whatever its value (the format reward of the countdown recipe), else 0.0."""
    scores = []
    for completion, given, question in zip(completions, numbers, _prompts(prompt, len(completions)), strict=True):
        got = _countdown_expression(completion, given, answer_format, question)
        scores.append(1.0 if got is not None and got[1] else 0.0)
    return scores


BUILTIN_REWARDS: dict[str, RewardFn] = {
    "correct": correct,
    "format": format_ok,
    "overlong": overlong,
    "math_equal": math_equal,
    "think_format": think_format,
    "single_answer": single_answer,
    "countdown": countdown,
    "countdown_valid": countdown_valid,
}


# ---------------------------------------------------------------------------
# loading


@dataclass(frozen=True)
class WeightedReward:
    name: str  # as written in the recipe: a builtin name or "module:function"
    fn: RewardFn
    weight: float
    args: dict = field(default_factory=dict)  # the recipe's extra keyword arguments (rewards[i].args)
    timeout_s: float | None = None  # per call (one prompt's group); None = called in the trainer's process, no limit
    on_failure: str = "zero"  # a sample it fails on scores 0 ("zero") or leaves the loss ("drop")
    correctness: bool = False  # the task's correctness check (pass@1, zero-variance groups, best checkpoint)
    worker: Any = field(default=None, compare=False, repr=False)  # reward_worker.RewardWorker when timeout_s is set


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
    """The recipe's `rewards` list (RewardSpec) -> loaded functions with weights. Fails at the edge.
    Exactly one is the correctness check (`correctness: true`, or the only reward)."""
    marked = [i for i, spec in enumerate(specs) if spec.correctness]
    if len(marked) > 1 or (not marked and len(specs) > 1):
        raise UsageError(f"rewards: {len(marked)} are marked correctness: true; mark exactly one, the task's "
                         "correctness check (pass@1, the zero-variance groups, the best checkpoint)")
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
        timeout_s = getattr(spec, "timeout_s", None)
        on_failure = getattr(spec, "on_failure", "zero")
        if timeout_s is not None and not (math.isfinite(timeout_s) and timeout_s > 0):
            raise UsageError(f"rewards[{i}].timeout_s: {timeout_s} must be > 0 seconds, or null for no limit")
        if on_failure not in ON_FAILURE:
            raise UsageError(f"rewards[{i}].on_failure: '{on_failure}' is not one of {', '.join(ON_FAILURE)}")
        fn = load_reward(spec.name)
        worker = None
        if timeout_s is not None:
            from grpo_cli.reward_worker import RewardWorker

            worker = RewardWorker(spec.name, fn, float(timeout_s))
        loaded.append(WeightedReward(spec.name, fn, float(spec.weight), args, timeout_s, on_failure,
                                     spec.correctness or len(specs) == 1, worker))
    return loaded


def correctness_name(rewards: list[WeightedReward]) -> str:
    """The name of the reward that is the task's correctness check: the one marked, or the only one."""
    return next(r.name for r in rewards if r.correctness or len(rewards) == 1)


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


ON_FAILURE = ("zero", "drop")
MAX_TIMEOUTS_IN_A_ROW = 3  # then a function's remaining calls in this scoring are skipped (a held-out set has 200 groups)


@dataclass
class RewardFailures:
    """Samples a reward function could not score: it raised, timed out, returned the wrong count or type,
    or a value that is not a finite number. The caller decides when too many is too many."""

    counts: Counter = field(default_factory=Counter)  # function name -> samples it failed on
    last_error: dict[str, str] = field(default_factory=dict)  # function name -> the latest reason, one line

    def record(self, name: str, samples: int, reason: str) -> None:
        self.counts[name] += samples
        self.last_error[name] = reason

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def _invoke(reward: WeightedReward, completions: list, kwargs: dict[str, Any]) -> tuple[str, Any]:
    """One call: in the reward's worker (under its time limit) or, without timeout_s, in this process."""
    from grpo_cli.reward_worker import call_in_process

    if reward.worker is not None:
        return reward.worker.call(completions, kwargs)
    return call_in_process(reward.fn, completions, kwargs)


def _as_score(value: Any) -> float | None:
    if isinstance(value, numbers.Real):  # int, float, bool, numpy scalars; not strings or tensors
        x = float(value)
        return x if math.isfinite(x) else None
    return None


def _score_chunk(reward: WeightedReward, completions: list, per_sample: dict[str, list], fixed: dict[str, Any],
                 first: int, failed: list[bool], reasons: list[str]) -> tuple[list[float], str]:
    """Scores of one call's completions (samples first..first+n-1 of the batch); failures marked in `failed`.
    `per_sample` holds the keyword arguments with one value per completion (the columns, the prompts,
    the token counts), `fixed` the others. A call that raises is retried one sample at a time, so only
    the samples it fails on are lost. Also returns the call's outcome tag ("ok", "raised", "timeout", ...)."""
    n = len(completions)
    tag, out = _invoke(reward, completions, {**per_sample, **fixed})
    if tag == "raised" and n > 1:
        scores = []
        for j in range(n):
            one = {k: v[j : j + 1] for k, v in per_sample.items()}
            scores += _score_chunk(reward, completions[j : j + 1], one, fixed, first + j, failed, reasons)[0]
        return scores, tag
    if tag != "ok":
        where = f"sample {first}" if n == 1 else f"samples {first}-{first + n - 1}"
        reasons.append(f"{where}: {out}")
        failed[first : first + n] = [True] * n
        return [0.0] * n, tag
    if len(out) != n:
        reasons.append(f"samples {first}-{first + n - 1}: returned {len(out)} values for {n} completions")
        failed[first : first + n] = [True] * n
        return [0.0] * n, tag
    scores = []
    for j, value in enumerate(out):
        x = _as_score(value)
        if x is None:
            reasons.append(f"sample {first + j}: returned {value!r:.40}, not a finite number")
            failed[first + j] = True
        scores.append(0.0 if x is None else x)
    return scores, tag


def _call_reward(reward: WeightedReward, completions: list, per_sample: dict[str, list], fixed: dict[str, Any],
                 failures: RewardFailures, group_size: int) -> tuple[list[float], list[bool]]:
    """([N] scores, [N] failed) of one function, one call per group of `group_size` completions.
    Once it has failed on more than half the samples, or timed out on MAX_TIMEOUTS_IN_A_ROW calls in
    a row, its remaining groups are not called and count as failed: each call could cost a full
    timeout, and a training run stops on a function that fails on most samples anyway."""
    n = len(completions)
    failed, reasons, scores = [False] * n, [], []
    fixed = {**fixed, **reward.args}
    timeouts_in_a_row = 0
    for first in range(0, n, group_size):
        chunk = slice(first, min(first + group_size, n))
        if sum(failed) > n / 2 or timeouts_in_a_row >= MAX_TIMEOUTS_IN_A_ROW:
            failed[chunk] = [True] * len(completions[chunk])
            scores += [0.0] * len(completions[chunk])
            continue
        group = {k: v[chunk] for k, v in per_sample.items()}
        chunk_scores, tag = _score_chunk(reward, completions[chunk], group, fixed, first, failed, reasons)
        scores += chunk_scores
        timeouts_in_a_row = timeouts_in_a_row + 1 if tag == "timeout" else 0
    if any(failed):
        failures.record(reward.name, sum(failed), reasons[-1] if reasons else "skipped after most samples failed")
    return scores, failed


class Scores(NamedTuple):
    total: list[float]  # [N] weighted sum over the reward functions
    per_function: dict[str, list[float]]  # name -> [N] raw scores, in recipe order
    dropped: list[bool] | None = None  # [N] a reward with on_failure=drop failed on it: it leaves the loss


# keyword names the scorer itself passes (the last three when the caller knows them: grpo train, grpo eval)
_RESERVED = ("completions", "answer_format", "completion_tokens", "max_new_tokens", "prompt")


def score(rewards: list[WeightedReward], completions: list, columns: dict[str, list], answer_format: str,
          failures: RewardFailures | None = None, completion_tokens: list[int] | None = None,
          max_new_tokens: int | None = None, prompts: list[str] | None = None,
          group_size: int | None = None) -> Scores:
    """Score N completions with every reward; columns are aligned with completions (each [N]).
    `completion_tokens` ([N] token counts), `max_new_tokens` (the cap) and `prompts` ([N] the
    question each completion answers, passed as `prompt`) reach the functions when given.

    Each function is called once per group of `group_size` consecutive completions (one prompt's
    group; None = all N in one call), in its worker under `timeout_s` when it has one. A function
    that fails scores 0 on the samples it failed, `failures` (when given) counts them, and with
    on_failure=drop those samples are marked in `Scores.dropped`.
    """
    n = len(completions)
    for name, values in columns.items():
        if name in _RESERVED:
            raise ValueError(f"a dataset column is named '{name}', which reward functions receive as an argument; "
                             "rename the column")
        if len(values) != n:
            raise ValueError(f"column '{name}' has {len(values)} values for {n} completions")
    failures = failures if failures is not None else RewardFailures()
    per_sample = {**columns, **{k: v for k, v in (("completion_tokens", completion_tokens), ("prompt", prompts))
                                if v is not None}}
    fixed = {"answer_format": answer_format, **({"max_new_tokens": max_new_tokens} if max_new_tokens else {})}
    per_function, dropped = {}, [False] * n
    for r in rewards:
        per_function[r.name], failed = _call_reward(r, completions, per_sample, fixed, failures,
                                                    group_size or max(n, 1))
        if r.on_failure == "drop":
            dropped = [d or f for d, f in zip(dropped, failed, strict=True)]
    total = [sum(r.weight * per_function[r.name][i] for r in rewards) for i in range(n)]
    return Scores(total, per_function, dropped)


def close_workers(rewards: list[WeightedReward]) -> None:
    """End the reward workers (at the end of a run; a killed run's workers exit on their own)."""
    for r in rewards:
        if r.worker is not None:
            r.worker.close()


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


def expected_scores(case: dict, reward_names: list[str], correctness: str, where: str) -> dict[str, float]:
    """A case's `expected` as {function name: value}; a bare number is the correctness reward's value."""
    expected = case.get("expected")
    if expected is None:
        return {}
    if isinstance(expected, int | float):
        return {correctness: float(expected)}
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
    expectations = [expected_scores(c, names, correctness_name(rewards), w) for c, w in zip(cases, wheres, strict=True)]
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
        prompt = case.get(config.data.prompt_column)
        _, per_function, _ = score(rewards, [case["completion"]], columns, config.data.answer_format, case_failures,
                                   prompts=[prompt] if isinstance(prompt, str) else None)
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
