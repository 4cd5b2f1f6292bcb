"""The built-in reward functions a recipe names (`correct`, `format`, `math_equal`, ...), in BUILTIN_REWARDS.

A reward function is a plain function `(completions: list[str], **columns) -> list[float]`: the
dataset's columns arrive by name (e.g. `answer=[...]`, one value per completion), plus
`answer_format`, `prompt`, `completion_tokens` and `max_new_tokens`; every function takes
`**kwargs` so it can ignore what it does not need. These never raise on a completion, whatever it
holds, and use only regexes that run in linear time, so a 1 MB adversarial string costs milliseconds.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from grpo_cli.rewards.answers import as_text, final_answer, final_answers, parse_amount, to_cents
from grpo_cli.tools.arithmetic import parse_expression

RewardFn = Callable[..., list]


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
             buffer: int = 32, trajectory_tokens: list | None = None, max_trajectory_tokens: int | None = None,
             **kwargs: Any) -> list[float]:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), from each completion's token count |y|
    and the cap L = rollout.max_new_tokens (both passed by the trainer and by `grpo eval`):

        0 for |y| <= L - buffer;   ((L - buffer) - |y|) / buffer for L - buffer < |y| <= L;   -1 beyond L.

    A linear fall from 0 to -1 over the last `buffer` tokens before the cap (set it with
    `args: {buffer: N}`), so long answers are discouraged before they are cut off. In a tool run like is
    compared with like: the whole trajectory's tokens (the replies' too) against the trajectory cap, the
    length that cuts it off.
    """
    if trajectory_tokens is not None and max_trajectory_tokens is not None:
        completion_tokens, max_new_tokens = trajectory_tokens, max_trajectory_tokens
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
# countdown


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


def environment(completions: list, environment_reward: list | None = None, **kwargs: Any) -> list[float]:
    """Each trajectory's environment's own score, its `reward()` (rollout.environment; docs/tools.md). A
    trajectory whose environment failed has none: the call fails, and the samples count as failed."""
    if environment_reward is None:
        raise ValueError("no environment_reward: the 'environment' reward needs rollout.environment with a reward()")
    if None in environment_reward:
        raise ValueError(f"{environment_reward.count(None)} of {len(environment_reward)} environments gave no reward")
    return [float(r) for r in environment_reward]


BUILTIN_REWARDS: dict[str, RewardFn] = {
    "correct": correct,
    "format": format_ok,
    "overlong": overlong,
    "math_equal": math_equal,
    "think_format": think_format,
    "single_answer": single_answer,
    "countdown": countdown,
    "countdown_valid": countdown_valid,
    "environment": environment,
}

