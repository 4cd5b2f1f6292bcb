"""Reward functions, their loading and scoring, and the `grpo reward` harness."""

from __future__ import annotations

import json
import math
import random
import sys
import time
from decimal import Decimal
from pathlib import Path

import pytest

from grpo_cli.config import RewardSpec
from grpo_cli.errors import UsageError
from grpo_cli.rewards import (
    ANSWER_FORMATS,
    BUILTIN_REWARDS,
    RewardFailures,
    WeightedReward,
    correct,
    final_answer,
    final_answers,
    format_ok,
    load_reward,
    load_rewards,
    parse_amount,
    required_columns,
    score,
    validate_columns,
)

REPO = Path(__file__).resolve().parents[1]
SHIPPED_CASES = REPO / "recipes" / "bike_pricing_cases.jsonl"


def shipped_cases() -> list[dict]:
    return [json.loads(line) for line in SHIPPED_CASES.read_text(encoding="utf-8").splitlines() if line.strip()]


# ---------------------------------------------------------------------------
# the checker


def test_shipped_cases_hold_at_least_30_checked_cases():
    cases = shipped_cases()
    assert len(cases) >= 30
    assert all("expected" in c and "answer" in c for c in cases)


@pytest.mark.parametrize("case", shipped_cases(), ids=lambda c: c["note"][:40])
def test_every_shipped_case(case):
    expected = case["expected"]
    expected = expected if isinstance(expected, dict) else {"correct": expected}
    prompt = [case.get("question")]  # what the scorer passes as `prompt` (the row's prompt column)
    got = {"correct": correct([case["completion"]], answer=[case["answer"]], answer_format="answer_line",
                              prompt=prompt)[0],
           "format": format_ok([case["completion"]], answer_format="answer_line", prompt=prompt)[0]}
    for name, value in expected.items():
        assert got[name] == value, (name, case["note"])


@pytest.mark.parametrize("text, value", [
    ("48.60", "48.60"), ("$48.60", "48.60"), ("48.6", "48.6"), ("48.600", "48.600"),
    ("1,250.50", "1250.50"), ("€ 12", "12"), ("12 €", "12"), ("-3", "-3"), ("$-3", "-3"), ("-$3", "-3"),
    ("\u22125", "-5"), ("+7", "7"), ("USD 5", "5"), ("5 euros", "5"), ("48.60.", "48.60"), ("**48.60**", "48.60"),
    ("12,345,678", "12345678"), ("0.05", "0.05"),
])
def test_parse_amount_accepts(text, value):
    assert parse_amount(text) == Decimal(value)


@pytest.mark.parametrize("text", [
    "", " ", "abc", "12abc", "1.2.3", "1,25", "48,60", "1,2345", "4.86e1", "--3", "-$-3", "$12$", ".5",
    "\uff14\uff18", "\u0664\u0668", "12 34", "nan", "inf", "1" * 65, None, 12, b"12",
])
def test_parse_amount_rejects(text):
    assert parse_amount(text) is None


def test_answer_tag_format():
    gold = ["48.60"] * 7
    completions = [
        "working...\n<answer>48.60</answer>",
        "<ANSWER> $48.6 </ANSWER>",
        "<answer>48.60</answer> and again <answer>48.6</answer>",  # same value twice: correct, not well-formatted
        "<answer>48.60</answer><answer>50</answer>",  # two different answers
        "Answer: 48.60",  # line format in a tag-format recipe
        "<answer>48.60",  # never closed
        "<answer><answer>48.60</answer>",  # an unclosed tag before a closed one: one answer
    ]
    assert correct(completions, answer=gold, answer_format="answer_tag") == [1, 1, 1, 0, 0, 0, 1]
    assert format_ok(completions, answer_format="answer_tag") == [1, 1, 0, 0, 0, 0, 1]


def test_cent_precision():
    assert final_answer("Answer: 48.6") == Decimal("48.60")
    assert correct(["Answer: 48.59", "Answer: 48.61", "Answer: 48.60"], answer=["48.6"] * 3) == [0, 0, 1]
    assert correct(["Answer: 48.60"], answer=[48.6]) == [1.0]  # a numeric gold column (e.g. from parquet)


def test_gold_that_is_not_a_number_is_a_data_error():
    with pytest.raises(ValueError, match="gold answer"):
        correct(["Answer: 1"], answer=["banana"])


def _junk_strings(rng: random.Random, count: int) -> list:
    alphabet = "0123456789.,$€-+ \n\t<>/answerAnswer:*_\x00\x1b\ufffd\u202e\U0001f6b2"
    junk: list = [None, 0, 1.5, b"\xff\xfeAnswer: 1", bytearray(b"Answer: 1"), [], {}, "", "\x00" * 100]
    for _ in range(count):
        junk.append("".join(rng.choice(alphabet) for _ in range(rng.randint(0, 200))))
    return junk


@pytest.mark.parametrize("answer_format", ["answer_line", "answer_tag"])
def test_checkers_never_raise(answer_format):
    junk = _junk_strings(random.Random(0), 500)
    for fn_scores in (correct(junk, answer=["1"] * len(junk), answer_format=answer_format),
                      format_ok(junk, answer_format=answer_format)):
        assert len(fn_scores) == len(junk)
        assert all(s in (0.0, 1.0) for s in fn_scores)


ADVERSARIAL_1MB = {
    "digits": "9" * 1_000_000,
    "digits and commas": "1," * 500_000,
    "answer line of digits and commas": "Answer: " + "1,000" * 200_000,
    "blank lines": "\n" * 1_000_000,
    "spaces": " " * 1_000_000,
    "spaces and tabs then junk": " \t" * 500_000 + "x",
    "empty answer lines": "Answer:\n" * 125_000,
    "answer markers on one line": "Answer:" * 140_000,
    "open tags": "<answer>" * 125_000,
    "one open tag then digits": "<answer>" + "1" * 1_000_000,
    "markdown stars": "*" * 1_000_000,
    "star prefix without the word": "**" * 250_000 + "answe\n" * 100_000,
}


@pytest.mark.parametrize("name", list(ADVERSARIAL_1MB))
def test_checkers_stay_fast_on_1mb(name):
    text = ADVERSARIAL_1MB[name]
    started = time.perf_counter()
    for answer_format in ("answer_line", "answer_tag"):
        assert correct([text], answer=["1"], answer_format=answer_format) == [0.0]
        format_ok([text], answer_format=answer_format)
    assert time.perf_counter() - started < 2.0, "a regex went super-linear"


# ---------------------------------------------------------------------------
# loading


CUSTOM_MODULE = '''
def length_penalty(completions, **kwargs):
    return [-len(c or "") / 100 for c in completions]

def needs_tier(completions, tier, **kwargs):
    return [float(t) for t in tier]

def no_kwargs(completions):
    return [0.0 for _ in completions]

def raises(completions, **kwargs):
    raise RuntimeError("boom")

NOT_CALLABLE = 3
'''


@pytest.fixture
def custom_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(CUSTOM_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_rewards"
    sys.modules.pop("my_rewards", None)


def test_load_builtin_and_custom(custom_module):
    assert load_reward("correct") is correct
    assert load_reward("format") is format_ok
    assert set(BUILTIN_REWARDS) == {"correct", "format", "overlong", "math_equal", "think_format", "single_answer", "countdown",
                                   "countdown_valid", "environment"}
    fn = load_reward(f"{custom_module}:length_penalty")
    assert fn(["abcd"]) == [-0.04]


@pytest.mark.parametrize("name, message", [
    ("corect", "did you mean 'correct'"),
    ("no_such_module_xyz:fn", "cannot import module 'no_such_module_xyz'"),
    ("my_rewards:missing", "has no function 'missing'"),
    ("my_rewards:NOT_CALLABLE", "is not callable"),
    ("my_rewards:no_kwargs", "must accept **kwargs"),
    ("my_rewards:", "package.module:function"),
])
def test_load_reward_errors_are_one_line(custom_module, name, message):
    with pytest.raises(UsageError) as info:
        load_reward(name)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_load_rewards_keeps_weights_and_rejects_duplicates():
    loaded = load_rewards([RewardSpec(name="correct", weight=1.0, correctness=True), RewardSpec(name="format", weight=0.1)])
    assert [(r.name, r.fn, r.weight) for r in loaded] == [("correct", correct, 1.0), ("format", format_ok, 0.1)]
    with pytest.raises(UsageError, match="listed twice"):
        load_rewards([RewardSpec(name="correct", correctness=True), RewardSpec(name="correct")])


def test_required_columns_and_validate_columns(custom_module):
    assert required_columns(correct) == ["answer"]
    assert required_columns(format_ok) == []
    assert required_columns(load_reward("my_rewards:needs_tier")) == ["tier"]
    rows = [{"question": "q", "answer": "1"}, {"question": "q"}, {"question": "q", "answer": None}]
    with pytest.raises(UsageError, match=r"row 1: no 'answer' column"):
        validate_columns(rows, ["answer"])
    loaded = load_rewards([RewardSpec(name="correct")])
    with pytest.raises(UsageError, match=r"row 1: no 'answer'"):
        validate_columns(rows, loaded)  # the loaded rewards work as `needed` too
    validate_columns(rows[:1], loaded)
    validate_columns(rows, load_rewards([RewardSpec(name="format")]))


# ---------------------------------------------------------------------------
# scoring


def _weighted(name, fn, weight=1.0):
    return WeightedReward(name, fn, weight)


def test_score_weights_and_per_function():
    rewards = [_weighted("correct", correct, 1.0), _weighted("format", format_ok, 0.5)]
    completions = ["Answer: 2", "Answer: 3", "nothing"]
    total, per_function, dropped = score(rewards, completions, {"answer": ["2", "2", "2"]}, "answer_line")
    assert dropped == [False, False, False]
    assert per_function == {"correct": [1.0, 0.0, 0.0], "format": [1.0, 1.0, 0.0]}
    assert total == [1.5, 0.5, 0.0]
    scored = score(rewards, completions, {"answer": ["2", "2", "2"]}, "answer_line")
    assert scored.total == total and list(scored.per_function) == ["correct", "format"]


@pytest.mark.parametrize("bad_fn, failed_samples, reason", [
    (lambda completions, **kw: 1 / 0, 3, "raised ZeroDivisionError"),
    (lambda completions, **kw: [1.0], 3, "returned 1 values for 3 completions"),
    (lambda completions, **kw: [math.nan, 1.0, math.inf], 2, "sample 2: returned inf, not a finite number"),
    (lambda completions, **kw: ["x", None, 1.0], 2, "sample 1: returned None, not a finite number"),
    (lambda completions, **kw: None, 3, "returned NoneType, not a list of numbers"),
])
def test_a_failing_reward_scores_zero_and_is_counted(bad_fn, failed_samples, reason):
    rewards = [_weighted("format", format_ok), _weighted("bad", bad_fn, 2.0)]
    failures = RewardFailures()
    total, per_function, _ = score(rewards, ["Answer: 1"] * 3, {}, "answer_line", failures)
    assert per_function["format"] == [1.0, 1.0, 1.0]
    assert all(v in (0.0, 1.0) for v in per_function["bad"])
    assert sum(v == 0.0 for v in per_function["bad"]) == failed_samples
    assert failures.counts["bad"] == failed_samples and failures.total == failed_samples
    assert reason in failures.last_error["bad"]
    assert all(math.isfinite(t) for t in total)


def test_failures_accumulate_across_calls():
    failures = RewardFailures()
    rewards = [_weighted("bad", lambda completions, **kw: 1 / 0)]
    for _ in range(3):
        score(rewards, ["a", "b"], {}, "answer_line", failures)
    assert failures.counts["bad"] == 6


def test_score_rejects_misaligned_or_reserved_columns():
    rewards = [_weighted("format", format_ok)]
    with pytest.raises(ValueError, match="column 'answer' has 1 values for 2"):
        score(rewards, ["a", "b"], {"answer": ["1"]}, "answer_line")
    with pytest.raises(ValueError, match="answer_format"):
        score(rewards, ["a"], {"answer_format": ["x"]}, "answer_line")


def test_columns_arrive_by_name(custom_module):
    rewards = [_weighted("tier", load_reward("my_rewards:needs_tier"))]
    _, per_function, _ = score(rewards, ["a", "b"], {"tier": [1, 3], "answer": ["1", "2"]}, "answer_line")
    assert per_function["tier"] == [1.0, 3.0]


# ---------------------------------------------------------------------------
# the `grpo reward` harness, through the command (in this process; test_cli.py runs one from a shell)


def test_harness_passes_the_shipped_cases(cli):
    result = cli("reward", "recipe=bike_pricing", f"cases={SHIPPED_CASES}")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 failed" in result.stdout
    assert "FAIL" not in result.stdout


def test_harness_exits_1_on_a_wrong_expected(cli, tmp_path):
    cases = tmp_path / "cases.jsonl"
    cases.write_text(json.dumps({"completion": "Answer: 5", "answer": "5", "expected": 1}) + "\n"
                     + json.dumps({"completion": "Answer: 5", "answer": "6", "expected": {"correct": 1}}) + "\n"
                     + json.dumps({"completion": "Answer: 5", "answer": "6"}) + "\n")
    result = cli("reward", "recipe=bike_pricing", f"cases={cases}")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "1 passed, 1 failed, 1 without expected" in result.stdout


def test_harness_exits_1_when_a_custom_reward_crashes(cli, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "my_rewards.py").write_text(CUSTOM_MODULE)
    cases = tmp_path / "cases.jsonl"
    cases.write_text(json.dumps({"completion": "Answer: 5", "answer": "5", "expected": 1}) + "\n")
    result = cli("reward", "recipe=bike_pricing", f"cases={cases}",
                      "rewards=[{name:correct,correctness:true},{name:'my_rewards:raises'}]", cwd=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "ERR" in result.stdout and "boom" in result.stdout


@pytest.mark.parametrize("content, message", [
    (None, "not found"),
    ('{"completion": "Answer: 1", "answer": "1"}\n{not json}\n', "cases.jsonl:2: not valid JSON"),
    ('{"answer": "1"}\n', "cases.jsonl:1: no 'completion' field"),
    ('{"completion": "Answer: 1"}\n', "cases.jsonl:1: no 'answer' field"),
    ('{"completion": "Answer: 1", "answer": "1", "expected": {"corect": 1}}\n', "not a reward of this recipe"),
    ('[1, 2]\n', "must be a JSON object"),
    ("\n\n", "holds no cases"),
])
def test_harness_usage_errors_exit_2_with_one_line(cli, tmp_path, content, message):
    cases = tmp_path / "cases.jsonl"
    if content is not None:
        cases.write_text(content)
    result = cli("reward", "recipe=bike_pricing", f"cases={cases}")
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.stderr


def test_overlong_is_dapos_soft_punishment_by_hand():
    from grpo_cli.rewards import overlong

    lengths = [3, 6, 7, 8, 10, 11]  # cap 10, buffer 4: free up to 6, then -1/4 a token, -1 beyond the cap
    assert overlong(["x"] * 6, completion_tokens=lengths, max_new_tokens=10, buffer=4) == \
        [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]
    with pytest.raises(ValueError, match="completion_tokens"):
        overlong(["x"])
    with pytest.raises(ValueError, match="buffer"):
        overlong(["x"], completion_tokens=[1], max_new_tokens=10, buffer=0)


def test_reward_args_reach_the_function_and_token_counts_come_from_the_scorer():
    from grpo_cli.rewards import SampleContext, load_rewards, score

    loaded = load_rewards([RewardSpec(name="overlong", args={"buffer": 2})])
    scored = score(loaded, ["a", "b"], {}, "answer_line", max_new_tokens=10, context=SampleContext(completion_tokens=[8, 9]))
    assert scored.per_function["overlong"] == [0.0, -0.5]
    with pytest.raises(UsageError, match="rewards\\[0\\].args: max_new_tokens is passed by the scorer"):
        load_rewards([RewardSpec(name="overlong", args={"max_new_tokens": 5})])


def test_overlong_in_a_tool_run_compares_the_trajectory_with_its_cap():
    """Like with like: a trajectory's tokens (the replies' too) against the trajectory cap, which is what cuts
    it off, not the model's tokens against it (issue 36). The scorer passes both from the tool run."""
    from grpo_cli.rewards import SampleContext, load_rewards, score

    loaded = load_rewards([RewardSpec(name="overlong", args={"buffer": 4})])
    context = SampleContext(completion_tokens=[5, 5], trajectory_tokens=[8, 20], max_trajectory_tokens=20)
    scored = score(loaded, ["a", "b"], {}, "answer_line", max_new_tokens=10, context=context)
    assert scored.per_function["overlong"] == [0.0, -1.0]  # 8 of 20 is free; 20 of 20 reached the cap


# ---------------------------------------------------------------------------
# one rule per answer format


@pytest.mark.parametrize("answer_format, text, answers", [
    ("answer_line", "54 - 5.4 = 48.6. Answer: 48.6", [" 48.6"]),
    ("answer_line", "Answer: 1\nso... final answer: 2", [" 1", " 2"]),
    ("answer_line", "**Answer:** 7", ["** 7"]),
    ("answer_line", "the answers: 3", []),  # 'answers' is another word
    ("answer_line", "Reanswer: 3", []),
    ("answer_tag", "<answer>1</answer> then <ANSWER>2</ANSWER>", ["1", "2"]),
    ("answer_tag", "<answer>1<answer>2</answer>", ["2"]),
    ("boxed", "so \\boxed{\\frac{1}{2}} and that is it", ["\\frac{1}{2}"]),
    ("boxed", "\\boxed{a{b{c}}d} \\boxed {e}", ["a{b{c}}d", "e"]),
    ("boxed", "\\boxed{\\boxed{1}}", ["\\boxed{1}"]),  # a box inside a box is part of its contents
    ("boxed", "\\boxed{1", []),
    ("boxed", "\\fbox{3}", ["3"]),
    ("hash", "2 + 2 = 4\n#### 4", [" 4"]),
    ("hash", "see #### 4 inline", []),  # a #### line must open its line
])
def test_final_answers_one_rule_per_format(answer_format, text, answers):
    assert final_answers(text, answer_format) == answers


def test_extraction_is_linear_on_adversarial_text():
    import time

    junk = ["\\boxed{" * 100_000, "answer:" * 100_000, "<answer>" * 100_000, "####" * 100_000 + "\n" * 1000,
            "{" * 500_000 + "\\boxed{" + "}" * 10]
    started = time.perf_counter()
    for text in junk:
        for answer_format in ANSWER_FORMATS:
            final_answers(text, answer_format)
    assert time.perf_counter() - started < 2.0


def test_the_prompt_copy_is_skipped_before_extraction():
    question = "The sign says Answer: 54.00. How much does Ana pay for 3 days at 18?"
    assert final_answers(question, "answer_line", prompt=question) == []
    assert final_answers(question + "\nAnswer: 54", "answer_line", prompt=question) == [" 54"]
    assert final_answers("Answer: 5", "answer_line", prompt="short") == [" 5"]


@pytest.mark.parametrize("text, ok", [
    ("<think>a</think><answer>1</answer>", 1.0),
    ("  <think>two\nlines</think>\n\n<answer>x</answer>\n", 1.0),
    ("<think>a</think><answer>1</answer> trailing", 0.0),
    ("<answer>1</answer>", 0.0),
    ("<think>a</think>", 0.0),
    ("<think>a<think>b</think><answer>1</answer>", 0.0),
    ("<think>a</think><answer>1</answer><answer>2</answer>", 0.0),
    ("<think>a < b</think><answer>1</answer>", 1.0),
])
def test_think_format(text, ok):
    from grpo_cli.rewards import think_format

    assert think_format([text]) == [ok]


def test_math_equal_and_single_answer():
    from grpo_cli.rewards import math_equal, single_answer

    gold = ["#### 0.5"] * 5
    got = ["<answer>1/2</answer>", "<answer>\\frac{1}{2}</answer>", "<answer>0.50</answer>", "<answer>2</answer>",
           "no tag"]
    assert math_equal(got, answer=gold, answer_format="answer_tag") == [1.0, 1.0, 1.0, 0.0, 0.0]
    assert single_answer(["\\boxed{x}", "\\boxed{x}\\boxed{y}", "none"], answer_format="boxed") == [1.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="does not parse as math"):
        math_equal(["<answer>1</answer>"], answer=[""], answer_format="answer_tag")
