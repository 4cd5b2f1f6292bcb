"""recipe=bike_pricing_tools: its generator, its two renderings of a solution, its shipped base model, its
reward cases, and a few real training steps with the calculator.

The vLLM measurement of the base model (tool-call share, sampled and greedy pass@1, right when calling vs
not) is scripts/make_base_model.py's, from disk; the training run's figures are in the README.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from grpo_cli.tasks import bike_pricing_tools as task
from grpo_cli.tools import calculator

REPO = Path(__file__).resolve().parents[1]
MODEL_DIR = REPO / "grpo_cli" / "models" / "bike_tools_base"
CASES = REPO / "recipes" / "bike_pricing_tools_cases.jsonl"


@pytest.fixture(scope="module")
def problems():
    return task.splits(2000, 100, 1234)


def test_splits_are_deterministic_disjoint_and_cover_the_tiers(problems):
    train, heldout = problems
    again_train, again_heldout = task.splits(2000, 100, 1234)
    assert [p.question for p in train] == [p.question for p in again_train]
    assert [p.question for p in heldout] == [p.question for p in again_heldout]
    assert not {p.question for p in train} & {p.question for p in heldout}
    assert [p.question for p in task.splits(50, 100, 1234)[1]] == [p.question for p in heldout]  # num_train-free
    assert {p.tier for p in train} == {1, 2, 3}
    assert {p.tier for p in task.splits(30, 10, 1234, tiers=(2,))[0]} == {2}
    with pytest.raises(ValueError, match="tiers"):
        task.splits(10, 10, 1234, tiers=(4,))


def test_prices_have_cents_and_every_line_is_what_the_calculator_says(problems):
    train, _ = problems
    with_cents = sum(bool(re.search(r"\d+\.(?!00)\d\d per day|\d+\.(?!00)\d\d a day", p.question)) for p in train)
    assert with_cents > 0.95 * len(train)  # harder arithmetic than bike_pricing's whole-unit prices
    calls = 0
    for p in train:
        for line in p.lines:
            if line.expression:
                assert calculator(line.expression) == line.value, (p.question, line)
                calls += 1
        assert p.lines[-1] == task.Line("Answer: ", None, p.answer)
        assert p.solution.endswith(f"\nAnswer: {p.answer}")
    assert calls > 2 * len(train)  # tier 1 one call, tier 2 three, tier 3 up to five


def test_the_tool_rendering_is_the_plain_solution_with_each_computation_called(problems):
    train, _ = problems
    for p in train[:300]:
        segments = task.tool_segments(p)
        assert segments[-1][1] and segments[-1][0].endswith(f"Answer: {p.answer}")
        for (text, by_model), (after, _) in zip(segments, segments[1:]):
            if by_model:  # a model turn ends at the close tag, and the tool's result follows
                assert text.endswith(task.CALL_CLOSE) and after.startswith(task.RESULT_OPEN)
            else:
                assert re.fullmatch(r"<result>\d+\.\d\d</result>", text)
        joined = "".join(text for text, _ in segments)
        plain = re.sub(r"<calc>(.*?)</calc><result>(.*?)</result>", r"\1 = \2", joined)
        assert plain == p.solution
        assert sum(not by_model for _, by_model in segments) == sum(bool(line.expression) for line in p.lines)


def test_the_shipped_base_model_fits_the_size_class_and_its_tokenizer_splits_the_turns(problems):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert sum(f.stat().st_size for f in MODEL_DIR.iterdir()) < 5 * 2**20
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR)
    assert sum(p.numel() for p in model.parameters()) < 1_500_000
    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    for p in problems[1][:20]:  # each turn as the rollout tokenizes it round-trips, and the tags are tokens
        for j, (text, _) in enumerate(task.tool_segments(p)):
            text = (" " if j == 0 else "") + text
            ids = tokenizer.encode(text, add_special_tokens=False)
            assert tokenizer.decode(ids) == text
    close = tokenizer.encode("x: <calc>7 x 17.35</calc>", add_special_tokens=False)
    assert tokenizer.decode(close[-1:]).endswith(">") and "calc" in tokenizer.decode(close[-2:])


def test_the_reward_cases_hold_trajectories_with_tool_results():
    """(tests/test_tasks.py runs every recipe's case file through `grpo reward`.) A case's completion is the
    model's words: its trajectory with the tool results left out."""
    cases = [json.loads(line) for line in CASES.read_text().splitlines()]
    assert sum("<result>" in c.get("trajectory", "") for c in cases) >= 6
    assert not any("<result>" in c["completion"] for c in cases)
    assert all(re.sub(r"<result>.*?</result>", "", c["trajectory"], flags=re.S) == c["completion"]
               for c in cases if "trajectory" in c)
    assert any(not call["ok"] for c in cases for call in c.get("tool_calls", []))  # an error result too
    assert {c["expected"]["correct"] for c in cases} == {0, 1}


def test_a_few_steps_of_the_recipe_call_the_calculator_and_log_the_tool_and_greedy_curves(tmp_path):
    """Three real steps of recipe=bike_pricing_tools on its shipped model (the transformers engine: a second
    vLLM engine cannot live in the test process, conftest.py): samples call the calculator and read its
    results, and the held-out evaluations log greedy accuracy, the call shares and pass@1 by calling."""
    from grpo_cli import train
    from grpo_cli.cli import load_config
    from grpo_cli.report.plot import plot_runs

    cfg = load_config("train", ["recipe=bike_pricing_tools", "rollout.engine=hf", "trainer.steps=3",
                                "rollout.prompts_per_step=4", "rollout.group_size=4", "eval.num_problems=8",
                                "eval.samples_per_problem=2", "eval.every=3", "checkpoint.every=0",
                                "logging.samples_every=1", f"output_dir={tmp_path}"])
    assert train.run(cfg, tmp_path / "run") == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = [m for m in rows if m["step"] > 0]
    assert len(trained) == 3
    assert sum(m["tools/calls_per_sample"] for m in trained) > 0 and all(m["tools/failed_per_sample"] == 0
                                                                       for m in trained)
    for m in (rows[0], rows[-1]):  # step 0 and step 3: held-out, sampled and greedy
        assert 0 <= m["eval/greedy_accuracy"] <= 1 and 0 <= m["eval/greedy_call_share"] <= 1
        assert 0 <= m["eval/tools/call_share"] <= 1
        assert "eval/tools/pass@1_calling" in m or "eval/tools/pass@1_not_calling" in m
    samples = [json.loads(line) for line in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    called = [s for s in samples if any(t["role"] == "tool" for t in s["turns"])]
    assert called
    for s in called:  # each result is the calculator's answer to the expression the model wrote
        for t in (t for t in s["turns"] if t["role"] == "tool"):
            assert t["tool"] == "calculator" and t["result"] == calculator(t["argument"])
            assert f"<calc>{t['argument']}</calc><result>{t['result']}</result>" in s["trajectory"]
    out = plot_runs([tmp_path / "run"], tmp_path / "metrics.png")
    width = int.from_bytes(out.read_bytes()[16:20], "big")  # the PNG header's width: a fourth column, tool use
    assert width == 2100  # 21 inches at 100 dpi; a run without tools is 16
