"""The tasks users bring: the gsm8k and math recipes end to end on local rows in the
hub's format (tests/fixtures), with math-verify rewards and a chat template, and every shipped
recipe's reward case file through `grpo reward`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"


def recipes() -> list[str]:
    return sorted(p.stem for p in (REPO / "recipes").glob("*.yaml"))


def test_every_recipe_ships_a_case_file():
    missing = [r for r in recipes() if not (REPO / "recipes" / f"{r}_cases.jsonl").is_file()]
    assert not missing, f"recipes without recipes/NAME_cases.jsonl: {missing}"


def grpo_reward(capsys, *args: str) -> tuple[int, str]:
    """`grpo reward ...` in this process: (exit code, stdout)."""
    from grpo_cli.cli import main

    capsys.readouterr()
    try:
        code = main(["reward", *args])
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().out


@pytest.mark.parametrize("recipe", recipes())
def test_the_recipes_cases_pass_through_grpo_reward(recipe, capsys):
    cases = REPO / "recipes" / f"{recipe}_cases.jsonl"
    code, out = grpo_reward(capsys, f"recipe={recipe}", f"cases={cases}")
    assert code == 0, out[-3000:]
    lines = [json.loads(line) for line in cases.read_text().splitlines() if line.strip()]
    assert len(lines) >= 6 and all("expected" in c for c in lines)
    assert f"{len(lines)} cases: {len(lines)} passed, 0 failed" in out


@pytest.mark.parametrize("recipe", ["gsm8k", "math", "countdown"])
def test_a_wrong_expectation_fails_grpo_reward(recipe, tmp_path, capsys):
    cases = [json.loads(line) for line in (REPO / "recipes" / f"{recipe}_cases.jsonl").read_text().splitlines()]
    first = cases[0]
    name, value = next(iter(first["expected"].items()))
    first["expected"] = {name: 1 - value}  # flip one expectation
    path = tmp_path / "cases.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in [first, *cases[1:]]))
    code, out = grpo_reward(capsys, f"recipe={recipe}", f"cases={path}")
    assert code == 1, out[-3000:]
    assert f"{len(cases) - 1} passed, 1 failed" in out


def _train(tmp_path: Path, recipe: str, *extra: str) -> Path:
    """The recipe for two steps in this process, on the transformers engine (a small chat model whose
    prompts are the recipe's own); returns the run directory."""
    from grpo_cli import train
    from grpo_cli.cli import load_config

    cfg = load_config("train", [f"recipe={recipe}", f"output_dir={tmp_path}", "model.dtype=float32",
                                "rollout.engine=hf", "rollout.prompts_per_step=2", "rollout.group_size=4",
                                "rollout.max_new_tokens=24", "trainer.steps=2", "trainer.lr=1e-3", "eval.every=2",
                                "checkpoint.every=2", *extra])
    assert train.run(cfg, tmp_path / "run") == 0
    return tmp_path / "run"


@pytest.mark.slow
def test_gsm8k_recipe_runs_on_local_rows_with_math_verify_and_a_chat_template(tmp_path, tiny_chat_model_dir):
    run_dir = _train(
        tmp_path, "gsm8k", f"model.name_or_path={tiny_chat_model_dir}",
        f"data.source={FIXTURES / 'gsm8k_train.jsonl'}", f"data.heldout_source={FIXTURES / 'gsm8k_test.jsonl'}",
        "data.num_heldout=8", "eval.num_problems=8", "rollout.push_check_every=1")
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "reward/math_equal" in m]
    assert [m["step"] for m in steps] == [1, 2]
    assert all(m["reward/failures"] == 0 and "reward/think_format" in m for m in steps)
    assert any("eval/pass@1" in m for m in metrics)
    assert (run_dir / "checkpoints" / "final" / "model.safetensors").is_file()
    # the prompts went through the chat template with the recipe's system prompt
    from transformers import AutoTokenizer

    from grpo_cli.cli import load_config
    from grpo_cli.prompts.templates import render_row

    cfg = load_config("train", ["recipe=gsm8k"])
    row = json.loads((FIXTURES / "gsm8k_train.jsonl").read_text().splitlines()[0])
    prompt = render_row(row, cfg.data, AutoTokenizer.from_pretrained(tiny_chat_model_dir))
    assert prompt.startswith("<|im_start|>system\nYou are a careful math tutor.")
    assert prompt.endswith(f"<|im_start|>user\n{row['question']}<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.slow
def test_a_conversational_dataset_trains_through_the_chat_template(tmp_path, tiny_chat_model_dir):
    """TRL's conversational format: the prompt column holds chat messages (here with their own system turn)."""
    run_dir = _train(
        tmp_path, "gsm8k", f"model.name_or_path={tiny_chat_model_dir}",
        f"data.source={FIXTURES / 'gsm8k_conversational.jsonl'}", "data.heldout_source=null",
        "data.prompt_column=prompt", "data.num_heldout=4", "eval.num_problems=4", "logging.samples_every=1")
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "reward/math_equal" in m] == [1, 2]
    assert all(m.get("reward/failures", 0) == 0 for m in metrics) and any("eval/pass@1" in m for m in metrics)
    samples = [json.loads(line) for line in (run_dir / "completions.jsonl").read_text().splitlines()]
    assert samples and all(s["prompt"].startswith("<|im_start|>system\nYou are a careful math tutor.")
                           for s in samples)


@pytest.mark.slow
def test_math_recipe_runs_on_local_rows_with_boxed_answers(tmp_path, tiny_chat_model_dir):
    run_dir = _train(
        tmp_path, "math", f"model.name_or_path={tiny_chat_model_dir}", f"data.source={FIXTURES / 'math.jsonl'}",
        "data.num_heldout=4", "eval.num_problems=4")
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "reward/math_equal" in m] == [1, 2]
    assert all(m.get("reward/failures", 0) == 0 for m in metrics)


def test_math_fixture_golds_are_what_math_equal_reads():
    """The fixtures are in the hub's format: GSM8K's '#### N' and MATH's \\boxed{} solutions."""
    from grpo_cli.rewards import gold_answer, math_equal

    gsm = [json.loads(line) for line in (FIXTURES / "gsm8k_train.jsonl").read_text().splitlines()]
    assert all("\n#### " in r["answer"] for r in gsm)
    right = [f"<answer>{gold_answer(r['answer'])}</answer>" for r in gsm]
    assert math_equal(right, answer=[r["answer"] for r in gsm], answer_format="answer_tag") == [1.0] * len(gsm)
    wrong = [f"<answer>{int(gold_answer(r['answer'])) + 1}</answer>" for r in gsm]
    assert math_equal(wrong, answer=[r["answer"] for r in gsm], answer_format="answer_tag") == [0.0] * len(gsm)
    rows = [json.loads(line) for line in (FIXTURES / "math.jsonl").read_text().splitlines()]
    assert all("\\boxed{" in r["solution"] for r in rows)
    boxed = [f"so \\boxed{{{gold_answer(r['solution'])}}}" for r in rows]
    assert math_equal(boxed, answer=[r["solution"] for r in rows], answer_format="boxed") == [1.0] * len(rows)

