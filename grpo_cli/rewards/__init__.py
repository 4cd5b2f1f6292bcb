"""Rewards: everything a reward author touches, in one package.

- answers.py: what final answer a completion states, one rule per `data.answer_format`.
- builtin.py: the built-in reward functions (`correct`, `format`, `math_equal`, `countdown`, ...).
- load.py: a recipe's `rewards` list -> weighted, checked functions; the correctness check.
- score.py: scoring completions per prompt's group, with failures counted instead of raised.
- model.py, judge.py, fit.py: a learned reward model and an LLM judge, in process or served; cutting their input to fit.
- teacher.py: the distillation teacher's per-token logprobs (`distill.teacher`).
- cases.py: the `grpo reward` harness.

A custom reward is `(completions: list[str], **columns) -> list[float]`; the names below are its
toolkit (`from grpo_cli.rewards import final_answer`). A reward with `timeout_s` runs in grpo_cli.tools.worker's
killable process; `parse_expression` is grpo_cli.tools.arithmetic's exact parser (never `eval`).
"""

from grpo_cli.rewards.answers import ANSWER_FORMATS, as_text, final_answer, final_answers, parse_amount, to_cents
from grpo_cli.rewards.builtin import (
    BUILTIN_REWARDS,
    correct,
    countdown,
    countdown_valid,
    format_ok,
    gold_answer,
    math_equal,
    overlong,
    single_answer,
    think_format,
)
from grpo_cli.rewards.load import (
    WeightedReward,
    correctness_name,
    load_reward,
    load_rewards,
    needed_columns,
    required_columns,
    validate_columns,
)
from grpo_cli.rewards.score import RewardFailures, SampleContext, Scores, score
from grpo_cli.tools.arithmetic import parse_expression

__all__ = [
    "ANSWER_FORMATS", "BUILTIN_REWARDS", "RewardFailures", "Scores", "WeightedReward", "as_text", "correct",
    "correctness_name", "countdown", "countdown_valid", "final_answer", "final_answers", "format_ok", "gold_answer",
    "load_reward", "load_rewards", "math_equal", "needed_columns", "overlong", "parse_amount", "parse_expression",
    "required_columns", "SampleContext", "score", "single_answer", "think_format", "to_cents", "validate_columns",
]
