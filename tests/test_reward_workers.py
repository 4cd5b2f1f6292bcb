"""Rewards that cannot hang or crash a run: each call in a killable worker under
`rewards[i].timeout_s`, failures counted per function and sample, `on_failure: zero | drop`.

The functions below run in real spawned worker processes (they are imported there by name).
"""

from __future__ import annotations

import math
import re
import time

import pytest

from grpo_cli.config import RewardSpec
from grpo_cli.errors import UsageError
from grpo_cli.rewards import RewardFailures, SampleContext, load_rewards, score


def sleeps_on_hang(completions, **kwargs):
    if any("hang" in c for c in completions):
        time.sleep(60)
    return [1.0] * len(completions)


def raises_on_boom(completions, **kwargs):
    if any("boom" in c for c in completions):
        raise ValueError("boom in the checker")
    return [1.0] * len(completions)


def answer_or_boom(completions, answer, **kwargs):
    if any("boom" in c for c in completions):
        raise ValueError("boom")
    return [float(a) for a in answer]


def nan_on_odd(completions, **kwargs):
    return [math.nan if "odd" in c else 1.0 for c in completions]


def three_values(completions, **kwargs):
    return [1.0, 1.0, 1.0]


def returns_text(completions, **kwargs):
    return ["1.0" for _ in completions]


def returns_a_number(completions, **kwargs):
    return 1.0


def echo_prompt_len(completions, prompt=None, **kwargs):
    return [float(len(p)) for p in prompt]


def loaded(name: str, timeout_s: float | None = 2.0, on_failure: str = "zero"):
    return load_rewards([RewardSpec(name=f"test_reward_workers:{name}", timeout_s=timeout_s, on_failure=on_failure)])


def test_a_hanging_call_is_killed_and_only_its_group_fails():
    rewards = loaded("sleeps_on_hang", timeout_s=1.0)
    completions = ["ok", "ok", "hang", "ok", "ok", "ok"]  # three groups of 2: the second hangs
    failures = RewardFailures()
    started = time.monotonic()
    scored = score(rewards, completions, {}, "answer_line", failures, group_size=2)
    took = time.monotonic() - started
    name = rewards[0].name
    assert scored.per_function[name] == [1.0, 1.0, 0.0, 0.0, 1.0, 1.0]
    assert failures.counts[name] == 2 and "samples 2-3: timed out after 1 s (worker killed)" in failures.last_error[name]
    assert took < 30, f"a 60 s hang took {took:.0f} s to give up on"  # 1 s limit + a fresh worker's start
    assert rewards[0].worker.process is not None and rewards[0].worker.process.is_alive()  # restarted
    again = score(rewards, ["ok", "ok"], {}, "answer_line", group_size=2)
    assert again.per_function[name] == [1.0, 1.0]
    rewards[0].worker.close()


def test_a_call_that_raises_is_retried_per_sample_so_only_the_bad_sample_fails():
    rewards = loaded("raises_on_boom")
    failures = RewardFailures()
    scored = score(rewards, ["a", "boom", "c", "d"], {}, "answer_line", failures, group_size=4)
    name = rewards[0].name
    assert scored.per_function[name] == [1.0, 0.0, 1.0, 1.0]
    assert failures.counts[name] == 1
    assert failures.last_error[name] == "sample 1: raised ValueError: boom in the checker"
    rewards[0].worker.close()


def test_the_per_sample_retry_keeps_columns_aligned():
    rewards = loaded("answer_or_boom")
    scored = score(rewards, ["a", "boom", "c", "d"], {"answer": ["1", "2", "3", "4"]}, "answer_line", group_size=4)
    assert scored.per_function[rewards[0].name] == [1.0, 0.0, 3.0, 4.0]
    rewards[0].worker.close()


@pytest.mark.parametrize("fn, failed, reason", [
    ("nan_on_odd", [False, True, False, True], "sample 3: returned nan, not a finite number"),
    ("three_values", [True] * 8, "samples 4-7: returned 3 values for 4 completions"),
    ("returns_text", [True, True, True, True], "sample 3: returned '1.0', not a finite number"),
    ("returns_a_number", [True, True, True, True], "samples 2-3: returned float, not a list of numbers"),
])
def test_wrong_values_name_the_function_and_the_sample(fn, failed, reason):
    completions = ["even", "odd", "even", "odd"] if fn == "nan_on_odd" else ["x"] * len(failed)
    rewards = loaded(fn)
    failures = RewardFailures()
    group = 4 if fn == "three_values" else 2
    scored = score(rewards, completions, {}, "answer_line", failures, group_size=group)
    name = rewards[0].name
    assert [v == 0.0 for v in scored.per_function[name]] == failed
    assert failures.counts[name] == sum(failed)
    assert reason in failures.last_error[name]
    assert scored.dropped == [False] * len(failed)  # on_failure: zero keeps them, scored 0
    rewards[0].worker.close()


def test_on_failure_drop_marks_the_samples_and_in_process_calls_behave_the_same():
    for timeout_s in (2.0, None):  # in a worker, and in this process (timeout_s: null)
        rewards = loaded("raises_on_boom", timeout_s=timeout_s, on_failure="drop")
        scored = score(rewards, ["a", "boom", "c", "d"], {}, "answer_line", group_size=2)
        assert scored.dropped == [False, True, False, False], timeout_s
        assert (rewards[0].worker is None) == (timeout_s is None)
        if rewards[0].worker is not None:
            rewards[0].worker.close()


def test_after_most_samples_fail_the_remaining_groups_are_not_called():
    rewards = loaded("sleeps_on_hang", timeout_s=0.5)
    failures = RewardFailures()
    started = time.monotonic()
    scored = score(rewards, ["hang"] * 8, {}, "answer_line", failures, group_size=2)
    took = time.monotonic() - started
    assert failures.counts[rewards[0].name] == 8 and scored.per_function[rewards[0].name] == [0.0] * 8
    assert took < 20, took  # 3 timeouts (6 of 8 samples > half), not 4 x 60 s
    failures = RewardFailures()
    started = time.monotonic()
    score(rewards, ["hang"] * 200, {}, "answer_line", failures, group_size=2)  # a held-out set's 100 groups
    assert failures.counts[rewards[0].name] == 200
    assert time.monotonic() - started < 30  # 3 timeouts in a row, then the rest is skipped
    rewards[0].worker.close()


def test_the_prompt_reaches_the_worker():
    rewards = loaded("echo_prompt_len")
    scored = score(rewards, ["a", "b"], {}, "answer_line", group_size=1, context=SampleContext(prompts=["abc", "abcdef"]))
    assert scored.per_function[rewards[0].name] == [3.0, 6.0]
    rewards[0].worker.close()


def test_a_lambda_cannot_run_in_a_worker_and_says_so():
    from grpo_cli.rewards import WeightedReward
    from grpo_cli.tools.worker import RewardWorker

    fn = lambda completions, **kw: [1.0] * len(completions)  # noqa: E731
    reward = WeightedReward("lam", fn, 1.0, {}, 1.0, "zero", worker=RewardWorker("lam", fn, 1.0))
    failures = RewardFailures()
    score([reward], ["a"], {}, "answer_line", failures)
    assert "define it at module level, or set timeout_s: null" in failures.last_error["lam"]


@pytest.mark.parametrize("spec, message", [
    (RewardSpec(name="correct", timeout_s=0), "rewards[0].timeout_s: 0 must be > 0 seconds"),
    (RewardSpec(name="correct", on_failure="skip"), "rewards[0].on_failure: 'skip' is not one of zero, drop"),
])
def test_bad_failure_settings_are_refused_at_load(spec, message):
    with pytest.raises(UsageError, match=re.escape(message)):
        load_rewards([spec])
