"""Prompt sources: the builtin generator, local JSONL/Parquet files, the hub's error path, and `grpo export`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_cli.config import DataConfig
from grpo_cli.errors import UsageError
from grpo_cli.prompts.rows import load_splits
from grpo_cli.tasks import bike_pricing

FIXTURES = Path(__file__).parent / "fixtures"


def rows_of(n: int) -> list[dict]:
    return [{"question": f"What is {i} + 1?", "answer": f"{i + 1}.00", "level": i % 3} for i in range(n)]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def write_parquet(path: Path, rows: list[dict]) -> Path:
    import datasets

    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return path


def questions(rows: list[dict]) -> set[str]:
    return {r["question"] for r in rows}


# ---------------------------------------------------------------------------
# builtin


def test_builtin_rows_match_the_generator():
    train, heldout = load_splits(DataConfig(num_train=200, num_heldout=30, seed=9))
    expected_train, expected_heldout = bike_pricing.splits(200, 30, seed=9)
    assert train == [p.to_row() for p in expected_train]
    assert heldout == [p.to_row() for p in expected_heldout]
    assert len(heldout) == 30 and not questions(train) & questions(heldout)
    assert {"question", "answer", "solution", "tier", "id"} <= set(train[0])


def test_builtin_tiers_are_passed_through():
    train, heldout = load_splits(DataConfig(num_train=50, num_heldout=10, tiers=[3]))
    assert {r["tier"] for r in train + heldout} == {3}


@pytest.mark.parametrize("config, message", [
    (DataConfig(source="builtin:bike_prices"), "unknown builtin task 'bike_prices'; available: builtin:bike_pricing"),
    (DataConfig(tiers=[4]), "data: tiers must be"),
    (DataConfig(heldout_source="x.jsonl"), "data.heldout_source: a builtin generator"),
])
def test_builtin_errors(config, message):
    with pytest.raises(UsageError) as info:
        load_splits(config)
    assert message in str(info.value)


# ---------------------------------------------------------------------------
# files


@pytest.mark.parametrize("writer, suffix", [(write_jsonl, ".jsonl"), (write_parquet, ".parquet")])
def test_file_source_holds_out_a_seeded_fixed_size_set(tmp_path, writer, suffix):
    rows = rows_of(50)
    path = writer(tmp_path / f"data{suffix}", rows)
    train, heldout = load_splits(DataConfig(source=str(path), num_heldout=10, seed=1))
    assert len(heldout) == 10 and len(train) == 40
    assert questions(train) | questions(heldout) == questions(rows)
    assert not questions(train) & questions(heldout)
    assert all(set(r) == {"question", "answer", "level"} for r in train + heldout)  # extra columns kept
    by_question = {r["question"]: r for r in rows}
    assert all(by_question[r["question"]] == r for r in train + heldout)  # values survive the round trip
    again = load_splits(DataConfig(source=str(path), num_heldout=10, seed=1))
    assert again == (train, heldout)
    _, other_heldout = load_splits(DataConfig(source=str(path), num_heldout=10, seed=2))
    assert questions(other_heldout) != questions(heldout)


def test_train_never_repeats_a_heldout_question(tmp_path):
    rows = rows_of(20) * 3  # every question three times
    path = write_jsonl(tmp_path / "dupes.jsonl", rows)
    train, heldout = load_splits(DataConfig(source=str(path), num_heldout=5, seed=0))
    assert len(heldout) == 5
    assert not questions(train) & questions(heldout)


def test_custom_prompt_column(tmp_path):
    rows = [{"problem": f"p{i}", "answer": "1"} for i in range(5)]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    train, heldout = load_splits(DataConfig(source=str(path), prompt_column="problem", num_heldout=2))
    assert len(train) == 3 and len(heldout) == 2


def test_heldout_source_gives_the_held_out_rows(tmp_path):
    rows = rows_of(30)
    source = write_jsonl(tmp_path / "train.jsonl", rows)
    held = write_jsonl(tmp_path / "heldout.jsonl", rows[:8] + [{"question": "extra?", "answer": "0", "level": 0}])
    train, heldout = load_splits(DataConfig(source=str(source), heldout_source=str(held), num_heldout=8))
    assert heldout == rows[:8]  # the first num_heldout rows, in file order
    assert train == rows[8:]  # the source minus held-out questions, in file order
    with pytest.raises(UsageError, match="has 9 rows, fewer than data.num_heldout=20"):
        load_splits(DataConfig(source=str(source), heldout_source=str(held), num_heldout=20))


# ---------------------------------------------------------------------------
# conversational prompts: a prompt column of chat messages (TRL's format)

CONVERSATION = FIXTURES / "gsm8k_conversational.jsonl"


def test_a_conversation_column_loads_under_the_chat_template_and_splits_by_its_messages():
    rows = [json.loads(line) for line in CONVERSATION.read_text().splitlines()]
    train, heldout = load_splits(DataConfig(source=str(CONVERSATION), prompt_column="prompt", template="chat",
                                            num_heldout=4))
    assert len(heldout) == 4 and len(train) == len(rows) - 4
    assert all(row in rows for row in train + heldout) and not [r for r in train if r in heldout]
    doubled = load_splits(DataConfig(source=str(CONVERSATION), heldout_source=str(CONVERSATION),
                                     prompt_column="prompt", template="chat", num_heldout=4))
    assert doubled[0] == rows[4:]  # a conversation held out is never trained on (compared by its messages)


@pytest.mark.parametrize("prompt, template, message", [
    ([{"role": "user", "content": "2+2?"}], "plain",
     "column 'prompt' holds chat messages, which go through the model's chat template; set data.template=chat"),
    ([], "chat", "holds chat messages, but an empty list of messages"),
    ([{"role": "user", "text": "2+2?"}], "chat", "message 0 is not a {role, content} object"),
    ([{"role": "robot", "content": "2+2?"}], "chat", "message 0 has role 'robot' (roles: system, user, assistant)"),
    ([{"role": "user", "content": ""}], "chat", "message 0's content is not text or is empty"),
    ([{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}], "chat",
     "the last message is the assistant's; a prompt ends with the user's turn"),
    (7, "chat", "column 'prompt' is not text (a prompt is text or a list of chat messages)"),
])
def test_a_bad_conversation_is_one_line_naming_its_row(tmp_path, prompt, template, message):
    rows = [{"prompt": [{"role": "user", "content": f"{i}+1?"}], "answer": "1"} for i in range(3)]
    path = write_jsonl(tmp_path / "c.jsonl", [*rows, {"prompt": prompt, "answer": "4"}])
    with pytest.raises(UsageError) as info:
        load_splits(DataConfig(source=str(path), prompt_column="prompt", template=template, num_heldout=1))
    text = str(info.value)
    first_bad = 3 if template == "chat" else 0  # under the plain template every conversation is refused
    assert f"row {first_bad} (counting from 0)" in text and message in text and "\n" not in text, text


def test_a_conversation_renders_as_it_is_and_rewards_read_its_question(tiny_chat_model_dir):
    from transformers import AutoTokenizer

    from grpo_cli.prompts.templates import render_row
    from grpo_cli.rewards import SampleContext, score
    from grpo_cli.rewards.load import WeightedReward

    row = json.loads(CONVERSATION.read_text().splitlines()[0])
    data = DataConfig(source=str(CONVERSATION), prompt_column="prompt", template="chat", system_prompt="ignored")
    text = render_row(row, data, AutoTokenizer.from_pretrained(tiny_chat_model_dir))
    system, question = (m["content"] for m in row["prompt"])
    assert text == (f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n"
                    "<|im_start|>assistant\n")  # its own system turn; no data.instruction appended

    seen = []

    def spy(completions, prompt, **kwargs):
        seen.extend(prompt)
        return [1.0] * len(completions)

    fns = [WeightedReward("spy", spy, 1.0)]
    columns = {"prompt": [row["prompt"]] * 2, "answer": [row["answer"]] * 2}  # the prompt column is named prompt
    scores = score(fns, ["a", "b"], columns, "answer_tag", context=SampleContext(prompts=columns["prompt"]))
    assert scores.total == [1.0, 1.0] and seen == [question, question]


def _file(tmp_path: Path, name: str, content: str | None) -> str:
    path = tmp_path / name
    if content is not None:
        path.write_text(content, encoding="utf-8")
    return str(path)


@pytest.mark.parametrize("name, content, overrides, message", [
    ("missing.jsonl", None, {}, "file '{path}' not found"),
    ("data.csv", "question\nq\n", {}, "is not a .jsonl, .json or .parquet file"),
    ("empty.jsonl", "", {}, "'{path}' is empty"),
    ("blank.jsonl", "\n\n", {}, "it has no rows"),
    ("bad.jsonl", '{"question": "a"}\n{"question": "b"}\n{"question": oops}\n', {}, "line 3 is not valid JSON"),
    ("list.jsonl", '{"question": "a"}\n[1, 2]\n', {}, "line 2 is not a JSON object"),
    ("bad.parquet", "not parquet", {}, "cannot read '{path}'"),
    ("nocol.jsonl", '{"text": "a"}\n{"text": "b"}\n', {}, "has no column 'question' (columns: text)"),
    ("nullrow.jsonl", '{"question": "a"}\n{"question": "b"}\n{"answer": "1"}\n', {},
     "row 2 (counting from 0): column 'question' is missing"),
    ("emptyq.jsonl", '{"question": "a"}\n{"question": "  "}\n', {}, "row 1 (counting from 0): column 'question' is empty"),
    ("small.jsonl", '{"question": "a"}\n{"question": "b"}\n', {"num_heldout": 2}, "has 2 rows, but data.num_heldout=2"),
    ("same.jsonl", '{"question": "a"}\n{"question": "a"}\n', {"num_heldout": 1}, "every row of"),
])
def test_file_errors_are_one_line_and_name_the_problem(tmp_path, name, content, overrides, message):
    path = _file(tmp_path, name, content)
    with pytest.raises(UsageError) as info:
        load_splits(DataConfig(source=path, **overrides))
    assert message.format(path=path) in str(info.value)
    assert "\n" not in str(info.value)


# ---------------------------------------------------------------------------
# hub (no network here: only the error path)


def test_hub_source_without_a_name():
    with pytest.raises(UsageError, match="names no dataset"):
        load_splits(DataConfig(source="hub:"))


def test_hub_source_offline_is_a_one_line_error(tmp_path):
    code = ("from grpo_cli.config import DataConfig\nfrom grpo_cli.prompts.rows import load_splits\n"
            "from grpo_cli.cli import UsageError\n"
            "try:\n    load_splits(DataConfig(source='hub:someone/nothing-here@test'))\n"
            "except UsageError as e:\n    print(e)\n")
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HOME=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert "cannot load hub dataset 'someone/nothing-here' (split 'test')" in out.stdout, out.stdout + out.stderr


# ---------------------------------------------------------------------------
# `grpo export`, through the command (in this process; test_cli.py runs one from a shell)


SMALL = ["data.num_train=120", "data.num_heldout=15", "eval.num_problems=15"]


def test_export_round_trip(cli, tmp_path):
    out = tmp_path / "exported" / "nested"
    result = cli("export", "recipe=bike_pricing", f"out={out}", *SMALL)
    assert result.returncode == 0, result.stderr
    assert "wrote 120 train rows" in result.stdout and "wrote 15 held-out rows" in result.stdout
    train_file, heldout_file = out / "train.jsonl", out / "heldout.jsonl"
    exported_train = [json.loads(line) for line in train_file.read_text().splitlines()]
    exported_heldout = [json.loads(line) for line in heldout_file.read_text().splitlines()]
    train, heldout = load_splits(DataConfig(num_train=120, num_heldout=15))
    assert (exported_train, exported_heldout) == (train, heldout)

    # Training from the exported files gives back exactly the same split...
    again = load_splits(DataConfig(source=str(train_file), heldout_source=str(heldout_file), num_heldout=15))
    assert again == (train, heldout)
    # ...and a lone exported file works as a plain jsonl source too.
    alone_train, alone_heldout = load_splits(DataConfig(source=str(train_file), num_heldout=15))
    assert len(alone_heldout) == 15 and len(alone_train) == 105

    # The exported files go through `grpo export` again unchanged.
    out2 = tmp_path / "again"
    result = cli("export", "recipe=bike_pricing", f"out={out2}", *SMALL,
                      f"data.source={train_file}", f"data.heldout_source={heldout_file}")
    assert result.returncode == 0, result.stderr
    assert (out2 / "train.jsonl").read_text() == train_file.read_text()
    assert (out2 / "heldout.jsonl").read_text() == heldout_file.read_text()


def test_export_errors_exit_2(cli, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    result = cli("export", "recipe=bike_pricing", f"out={blocker}", *SMALL)
    assert result.returncode == 2 and "is not a directory" in result.stderr
    result = cli("export", "recipe=bike_pricing", f"out={tmp_path / 'o'}", *SMALL,
                      f"data.source={tmp_path / 'nope.jsonl'}")
    assert result.returncode == 2 and "not found" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
