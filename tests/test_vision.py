"""Vision-language GRPO: the price-tag task, the shipped vision-language base model (grpo_cli/models/bike_vision_base,
built by scripts/make_vision_model.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grpo_cli.tasks import bike_pricing_vision as vision
from grpo_cli.tasks.bike_pricing import RATES

VISION_MODEL = Path(__file__).resolve().parents[1] / "grpo_cli" / "models" / "bike_vision_base"


def pixels(image) -> bytes:
    return image.tobytes()


def test_every_rate_has_its_own_tag_and_a_tag_is_the_same_every_time():
    tags = {rate: pixels(vision.price_tag(rate)) for rate in RATES}
    assert len(set(tags.values())) == len(RATES)
    assert pixels(vision.blank_tag()) not in tags.values()
    assert pixels(vision.price_tag(15, (2, -1))) == pixels(vision.price_tag(15, (2, -1)))
    assert pixels(vision.price_tag(15, (2, -1))) != tags[15]  # the shift moves the digits
    assert vision.price_tag(8).size == (vision.TAG_PIXELS, vision.TAG_PIXELS)
    with pytest.raises(ValueError, match="1 to 99"):
        vision.price_tag(100)


def test_the_rate_is_on_the_tag_and_not_in_the_question():
    train, heldout = vision.splits(300, 50, seed=7)
    again, _ = vision.splits(300, 50, seed=7)
    assert [p.id for p in train] == [p.id for p in again]
    assert {(p.question, p.rate) for p in train}.isdisjoint({(p.question, p.rate) for p in heldout})
    for p in train:
        first_sentence = p.question.split(". ")[0].split("; ")[0]
        assert str(p.rate) not in first_sentence.replace(f"{p.rental.days} day", "")
        row = p.to_row()
        assert pixels(row["image"]) == pixels(vision.price_tag(p.rate, p.shift))
        assert row["answer"] == p.answer and row["solution"].endswith(f"Answer: {p.answer}")
    assert {p.rate for p in train} == set(RATES)
    assert len({p.shift for p in train}) > 20  # the digits move around the tag


def test_shipped_vision_model_files_and_processor():
    from transformers import AutoProcessor

    config = json.loads((VISION_MODEL / "config.json").read_text())
    assert config["model_type"] == "idefics3" and config["architectures"] == ["Idefics3ForConditionalGeneration"]
    text = config["text_config"]
    assert text["model_type"] == "llama" and text["hidden_size"] // text["num_attention_heads"] in (32, 64)
    assert sum(p.stat().st_size for p in VISION_MODEL.iterdir()) <= 10 * 2**20
    processor = AutoProcessor.from_pretrained(VISION_MODEL)
    assert type(processor.image_processor).__name__ == "Idefics3ImageProcessorPil"  # no torchvision needed
    ids = processor(text=["<image>Question: x\nSolution:"], images=[[vision.blank_tag()]])["input_ids"][0]
    plain = processor.tokenizer("Question: x\nSolution:", add_special_tokens=False)["input_ids"]
    assert len(ids) == len(plain) + 3 + processor.image_seq_len  # the markers and the image's tokens
    assert list(ids[-len(plain):]) == plain


def test_shipped_vision_model_reads_the_tag():
    """Teacher-forced on 48 held-out problems: the gold solutions are far likelier with the real tag than with a
    blank one, and the rate's digits (the only thing the tag tells) are where the difference is."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from grpo_cli.prompts.templates import render_plain

    processor = AutoProcessor.from_pretrained(VISION_MODEL)
    model = AutoModelForImageTextToText.from_pretrained(VISION_MODEL, dtype=torch.float32).eval()
    _, heldout = vision.splits(20000, 200, seed=1234)

    def gold_logprob(problems, blank: bool) -> torch.Tensor:
        texts = ["<image>" + render_plain(p.question) + " " + p.solution for p in problems]
        images = [[vision.blank_tag() if blank else p.image()] for p in problems]
        batch = processor(text=texts, images=images, return_tensors="pt", padding=True)
        with torch.no_grad():
            logits = model(**batch).logits[:, :-1].float()  # [B, T-1, V]
        logp = logits.log_softmax(-1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]  # [B, T-1]
        prompt_len = [len(processor(text=["<image>" + render_plain(p.question)], images=[[p.image()]])["input_ids"][0])
                      for p in problems]
        mask = torch.zeros_like(logp)  # [B, T-1] on the solution's tokens
        for i, n in enumerate(prompt_len):
            mask[i, n - 1:] = batch["attention_mask"][i, n:]
        return (logp * mask).sum(-1)  # [B]

    problems = heldout[:48]
    with_tag, blank = gold_logprob(problems, False), gold_logprob(problems, True)
    assert (with_tag > blank).float().mean() >= 0.8
    assert (with_tag - blank).mean() > 2.0  # nats


# ---------------------------------------------------------------------------- rows with images


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_a_row_takes_a_path_bytes_a_pil_image_or_a_datasets_image_and_each_is_named(tmp_path):
    import io

    from grpo_cli.prompts.images import attach_images, image_name

    tag = vision.price_tag(12)
    (tmp_path / "pics").mkdir()
    tag.save(tmp_path / "pics" / "tag.png")
    png = io.BytesIO()
    vision.price_tag(20).convert("L").save(png, format="PNG")  # grey: read as RGB
    rows = [{"q": "a", "image": "pics/tag.png"}, {"q": "b", "image": png.getvalue()},
            {"q": "c", "image": vision.price_tag(25)}, {"q": "d", "image": {"bytes": None, "path": "pics/tag.png"}},
            {"q": "e", "image": ["pics/tag.png", png.getvalue()]}]
    assert attach_images(rows, "image", str(tmp_path / "rows.jsonl"))
    assert [len(r["image"]) for r in rows] == [1, 1, 1, 1, 2]
    assert all(i.mode == "RGB" and i.size == (56, 56) for r in rows for i in r["image"])
    assert rows[0]["image"][0].tobytes() == tag.tobytes()
    assert image_name(rows[0]["image"][0]) == "pics/tag.png"
    assert image_name(rows[1]["image"][0]).startswith("sha1:")
    assert image_name(rows[1]["image"][0]) == image_name(rows[4]["image"][1])  # the same pixels, the same name
    assert image_name(rows[1]["image"][0]) != image_name(rows[2]["image"][0])
    text_rows = [{"q": "a"}, {"q": "b"}]
    assert not attach_images(text_rows, "image", "x.jsonl") and text_rows == [{"q": "a"}, {"q": "b"}]
    assert not attach_images([{"q": "a", "image": "pics/tag.png"}], None, "x.jsonl")  # data.image_column=null


@pytest.mark.parametrize("value, message", [
    ("pics/missing.png", "row 1 (counting from 0): column 'image': image file 'pics/missing.png' not found"),
    (b"not a picture", "row 1 (counting from 0): column 'image': the image's bytes are not in an image format PIL reads"),
    (None, "row 1 (counting from 0): column 'image' has no image, and other rows have"),
    (7, "row 1 (counting from 0): column 'image': a value of type int where an image goes"),
])
def test_an_unreadable_or_missing_image_fails_its_row_in_one_line(tmp_path, value, message):
    from grpo_cli.errors import UsageError
    from grpo_cli.prompts.images import attach_images

    rows = [{"q": "a", "image": vision.price_tag(8)}, {"q": "b", "image": value}]
    with pytest.raises(UsageError) as e:
        attach_images(rows, "image", str(tmp_path / "rows.jsonl"))
    assert message in str(e.value) and "\n" not in str(e.value)
    assert str(e.value).startswith("data.source: '")


def test_an_image_that_claims_too_many_pixels_fails_its_row_without_being_decoded(tmp_path):
    import io

    from PIL import Image

    from grpo_cli.errors import UsageError
    from grpo_cli.prompts.images import attach_images

    bomb = io.BytesIO()
    Image.new("1", (20000, 20000)).save(bomb, format="PNG")  # 48 KB of PNG for 400M pixels
    with pytest.raises(UsageError, match="row 0 \\(counting from 0\\): column 'image': the image's bytes claim more "
                                         "than PIL's limit of 178,956,970 pixels"):
        attach_images([{"q": "a", "image": bomb.getvalue()}], "image", str(tmp_path / "rows.jsonl"))


def test_one_question_asked_of_two_pictures_is_two_problems_in_the_split(tmp_path):
    from grpo_cli.config import DataConfig
    from grpo_cli.prompts.rows import load_splits

    for rate in RATES:
        vision.price_tag(rate).save(tmp_path / f"{rate}.png")
    rows = [{"question": "What is the daily rate on the tag?", "answer": str(r), "image": f"{r}.png"} for r in RATES]
    data = DataConfig(source=str(write_rows(tmp_path / "rows.jsonl", rows)), num_heldout=2, seed=3)
    train, heldout = load_splits(data)
    assert len(train) == len(RATES) - 2 and len(heldout) == 2  # the same question, none dropped as a repeat
    assert {r["answer"] for r in train + heldout} == {str(r) for r in RATES}
    assert all(r["image"][0].size == (56, 56) for r in train + heldout)


# ---------------------------------------------------------------------------- what a run refuses, before any weights


VISION_RECIPE = ["recipe=bike_pricing_vision", "data.num_train=200", "data.num_heldout=20", "eval.num_problems=20"]


@pytest.mark.parametrize("overrides, first_words", [
    (["model.name_or_path=builtin:bike_base"], "model.name_or_path: the train rows of 'builtin:bike_pricing_vision' "
                                                "carry images (data.image_column=image), and builtin:bike_base is a "
                                                "text-only model (Qwen2ForCausalLM)"),
    (["rollout.max_staleness=1"], "rollout.max_staleness: the train rows"),
    (["rollout.engine=hf"], "rollout.engine: hf does not sample with images"),
    (["rollout.max_new_tokens=500"], "rollout.max_new_tokens=500 exceeds the model's context of 512 tokens"),
])
def test_grpo_check_refuses_what_a_vision_run_cannot_do_in_one_line(cli, overrides, first_words):
    result = cli("check", *VISION_RECIPE, *overrides)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and first_words in lines[0], lines


def test_a_tool_run_with_images_is_refused(cli):
    result = cli("check", "recipe=bike_pricing_tools", "data.source=builtin:bike_pricing_vision",
                 "model.name_or_path=builtin:bike_vision_base", "data.num_train=50", "data.num_heldout=10",
                 "eval.num_problems=10")
    assert result.returncode == 2
    assert "rollout.tools: the train rows of 'builtin:bike_pricing_vision' carry images" in result.stderr
    assert "tool runs and environments with images are not supported" in result.stderr


def test_the_prompt_length_check_counts_each_images_tokens():
    from grpo_cli.cli import load_config
    from grpo_cli.errors import UsageError
    from grpo_cli.preflight import preflight

    task = preflight(load_config("train", VISION_RECIPE))
    row = max(task.train_rows + task.heldout_rows, key=lambda r: len(task.encode(r)))
    expanded = len(task.vision.expand(task.encode(row), task.images(row)))
    assert expanded == len(task.encode(row)) - 1 + len(task.vision.image_tokens(task.images(row)[0]))
    budget = 512 - expanded + 1  # the prompt fits without its image's tokens, not with them
    with pytest.raises(UsageError, match=f"its prompt of {expanded} tokens \\+ rollout.max_new_tokens={budget} "
                                         "exceeds the model's context of 512 tokens"):
        preflight(load_config("train", VISION_RECIPE + [f"rollout.max_new_tokens={budget}"]))


# ---------------------------------------------------------------------------- vLLM samples with the images


@pytest.mark.slow
def test_vllm_expands_the_images_as_the_trainer_does_and_greedy_equals_transformers_before_and_after_a_push():
    """One engine on the shipped model: vLLM's prompt ids (the images' tokens in place) are Vision.expand's, its
    greedy completions are transformers' token for token, and a push (which clears vLLM's encoded images) leaves
    both so; a blank tag changes what it answers."""
    import torch
    from transformers import AutoModelForImageTextToText
    from vllm import SamplingParams

    from grpo_cli.cli import load_config
    from grpo_cli.engines.base import Sampling
    from grpo_cli.engines.vllm import VLLMEngine
    from grpo_cli.preflight import preflight
    from grpo_cli.weights.checkpoint import checkpoint_weights

    cfg = load_config("train", VISION_RECIPE + ["rollout.kv_cache_gib=0.25"])
    task = preflight(cfg)
    rows = task.heldout_rows[:3]
    prompt_ids = [task.encode(row) for row in rows]
    engine = VLLMEngine(task.model_path, cfg.model, cfg.rollout, seed=0, image_column="image")
    try:
        outs = engine.llm.generate([engine._prompt(ids, row) for ids, row in zip(prompt_ids, rows)],
                                   SamplingParams(max_tokens=1), use_tqdm=False)
        assert [list(o.prompt_token_ids) for o in outs] == [task.vision.expand(ids, task.images(row))
                                                           for ids, row in zip(prompt_ids, rows)]
        greedy = Sampling(1, 0.0, 1.0, 160)
        before = engine.generate(prompt_ids, greedy, list(range(len(rows))), rows).completion_ids
        engine.push_weights(checkpoint_weights(task.model_path).items())
        after = engine.generate(prompt_ids, greedy, list(range(len(rows))), rows).completion_ids
        blank_rows = [{**row, "image": [vision.blank_tag()]} for row in rows]
        blank = engine.generate(prompt_ids, greedy, list(range(len(rows))), blank_rows).completion_ids
    finally:
        del engine
    assert after == before and blank != before
    model = AutoModelForImageTextToText.from_pretrained(task.model_path, dtype=torch.float32).eval()
    eos = task.tokenizer.eos_token_id
    for ids, row, [ours] in zip(prompt_ids, rows, before):
        inputs = task.vision.pixels([task.images(row)])
        expanded = torch.tensor([task.vision.expand(ids, task.images(row))])
        with torch.no_grad():
            out = model.generate(input_ids=expanded, attention_mask=torch.ones_like(expanded), **inputs,
                                 do_sample=False, max_new_tokens=160, eos_token_id=eos, pad_token_id=eos)
        assert [t for t in out[0, expanded.shape[1]:].tolist() if t != eos] == [t for t in ours if t != eos]


# ---------------------------------------------------------------------------- a run (the long tier: make test-long)


@pytest.mark.slow
def test_a_vision_run_checkpoints_with_its_processor_resumes_bit_exactly_and_evaluates_on_images(tmp_path):
    """A 4-step run of the recipe on one engine (a push check every step): its checkpoint holds the processor and
    loads as a vision-language model, completions.jsonl names the tags, the run resumed from its step-2
    checkpoint ends with the same weights and logged values, and `grpo eval` of the checkpoint with blank tags
    scores under its own pass@1 with the tags."""
    import dataclasses
    import shutil

    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from grpo_cli import evaluate, train
    from grpo_cli.cli import load_config
    from grpo_cli.engines.vllm import VLLMEngine
    from grpo_cli.step.sync import VISION_EXACT_TENSORS
    from grpo_cli.weights.checkpoint import checkpoint_weights

    overrides = ["recipe=bike_pricing_vision", "data.num_train=400", "data.num_heldout=16", "trainer.steps=4",
                 "rollout.prompts_per_step=4", "rollout.group_size=4", "eval.num_problems=16", "eval.every=2",
                 "checkpoint.every=2", "rollout.push_check_every=1", "trainer.lr=1e-3", "logging.samples_every=2",
                 "rollout.kv_cache_gib=0.25", f"output_dir={tmp_path}"]
    cfg = load_config("train", overrides)
    engine = VLLMEngine(str(VISION_MODEL), cfg.model, cfg.rollout, cfg.trainer.seed, image_column="image")
    base = checkpoint_weights(VISION_MODEL)
    run_dir = tmp_path / "run"
    assert train.run(cfg, run_dir, engine=engine) == 0
    final = run_dir / "checkpoints" / "final"
    assert (final / "processor_config.json").is_file()
    assert type(AutoProcessor.from_pretrained(final)).__name__ == "Idefics3Processor"
    AutoModelForImageTextToText.from_pretrained(final)
    samples = [json.loads(line) for line in (run_dir / "completions.jsonl").read_text().splitlines()]
    assert samples and all(s["images"][0].startswith("bikev-") and s["images"][0].endswith(".png") for s in samples)
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["push_check/tensors_mismatched"] for m in logged if "push_check/tensors_mismatched" in m] == [0.0] * 4
    assert all(m["push_check/max_abs_diff"] < 1e-4 for m in logged if "push_check/max_abs_diff" in m)
    assert set(engine.read_weights(VISION_EXACT_TENSORS)) == set(VISION_EXACT_TENSORS)  # the exact check sees them

    copy = tmp_path / "crashed"
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("final", "best", "metrics.png"))
    engine.push_weights(base.items())
    assert train.run(dataclasses.replace(cfg, resume=str(copy)), copy, engine=engine) == 0
    a, b = (load_file(d / "checkpoints" / "final" / "model.safetensors") for d in (run_dir, copy))
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    wall_clock = ("time/", "elapsed_s", "tokens_per_s", "memory/")
    runs = [[{k: v for k, v in json.loads(line).items() if not any(w in k for w in wall_clock)}
             for line in (d / "metrics.jsonl").read_text().splitlines()] for d in (run_dir, copy)]
    assert runs[0] == runs[1]

    scores = {}
    for name, image in (("tags", None), ("blank", "blank")):
        eval_cfg = load_config("eval", [f"checkpoint={final}", "recipe=bike_pricing_vision", "data.num_train=400",
                                        "data.num_heldout=16", "eval.num_problems=16", "eval.samples_per_problem=4",
                                        f"out={tmp_path}/{name}.json", "samples_jsonl=true"])
        if image:  # the same problems with a blank tag each
            source, heldout = blank_rows(tmp_path, eval_cfg.data)
            eval_cfg = dataclasses.replace(eval_cfg, data=dataclasses.replace(
                eval_cfg.data, source=str(source), heldout_source=str(heldout)))
        assert evaluate.run(eval_cfg, engine=engine) == 0
        scores[name] = json.loads((tmp_path / f"{name}.json").read_text())["pass@1"]
        named = [json.loads(line) for line in (tmp_path / f"{name}.samples.jsonl").read_text().splitlines()]
        assert all(isinstance(s["columns"]["image"][0], str) for s in named)
    assert scores["blank"] < scores["tags"]


def blank_rows(tmp_path: Path, data) -> tuple[Path, Path]:
    """(a file source, a held-out file): the built-in task's held-out problems, each with a blank tag, as the
    held-out rows, and a few other questions as the source's (a split needs train rows)."""
    from grpo_cli.prompts.rows import load_splits

    vision.blank_tag().save(tmp_path / "blank.png")
    _, heldout = load_splits(data)
    rows = [{k: v for k, v in row.items() if k != "image"} | {"image": "blank.png"} for row in heldout]
    others = [{**rows[0], "question": f"{rows[0]['question']} ({i})"} for i in range(4)]
    return write_rows(tmp_path / "others.jsonl", others), write_rows(tmp_path / "blank_heldout.jsonl", rows)


def test_grpo_reward_hands_a_cases_images_to_a_reward_that_looks_at_them(cli, tmp_path):
    """A case's `image` is read as a run's rows are (relative to the cases file): a reward that reads the pixels
    scores the tag apart from a blank one, and a missing image is one line naming the case."""
    (tmp_path / "inkmod.py").write_text(
        "def inked(completions, image, **kwargs):  # 1 when the picture has ink on it\n"
        "    return [float(im[0].convert('L').getextrema()[0] < 100) for im in image]\n")
    vision.price_tag(18).save(tmp_path / "tag.png")
    vision.blank_tag().save(tmp_path / "blank.png")
    cases = [{"completion": "Answer: 1", "image": "tag.png", "expected": {"inkmod:inked": 1}},
             {"completion": "Answer: 1", "image": ["blank.png"], "expected": {"inkmod:inked": 0}}]
    write_rows(tmp_path / "cases.jsonl", cases)
    reward = "rewards=[{name:inkmod:inked,weight:1.0,correctness:true,timeout_s:null}]"
    result = cli("reward", "recipe=bike_pricing_vision", reward, f"cases={tmp_path / 'cases.jsonl'}", cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr
    assert "2 cases: 2 passed, 0 failed" in result.stdout
    write_rows(tmp_path / "bad.jsonl", [{**cases[0], "image": "gone.png"}])
    result = cli("reward", "recipe=bike_pricing_vision", reward, f"cases={tmp_path / 'bad.jsonl'}", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().endswith("bad.jsonl:1: 'image': image file 'gone.png' not found")


def test_grpo_check_counts_the_vision_tower(cli):
    import torch
    from transformers import AutoModelForImageTextToText

    from grpo_cli.estimate import model_shape, parameter_count, vision_parameter_count

    model = AutoModelForImageTextToText.from_pretrained(VISION_MODEL, dtype=torch.float32)
    shape = model_shape("builtin:bike_vision_base")
    assert parameter_count(shape) == sum(p.numel() for p in model.parameters())
    assert vision_parameter_count(shape) == sum(p.numel() for n, p in model.named_parameters() if "text_model" not in n
                                                and n != "lm_head.weight")
    result = cli("check", *VISION_RECIPE)
    assert result.returncode == 0, result.stderr
    assert "1.4M parameters (the vision tower and connector 0.24M of them, frozen)" in result.stdout


def test_grpo_export_writes_the_images_as_files_that_load_back_as_the_same_pixels(cli, tmp_path):
    from grpo_cli.cli import load_config
    from grpo_cli.prompts.rows import load_splits

    result = cli("export", *VISION_RECIPE, f"out={tmp_path}")
    assert result.returncode == 0, result.stderr
    row = json.loads((tmp_path / "heldout.jsonl").read_text().splitlines()[0])
    assert row["image"].startswith("images/bikev-") and (tmp_path / row["image"]).is_file()
    cfg = load_config("train", VISION_RECIPE)
    _, heldout = load_splits(cfg.data)
    files = load_config("train", VISION_RECIPE + [f"data.source={tmp_path / 'train.jsonl'}",
                                                  f"data.heldout_source={tmp_path / 'heldout.jsonl'}"])
    _, again = load_splits(files.data)
    assert [r["question"] for r in again] == [r["question"] for r in heldout]
    assert [r["image"][0].tobytes() for r in again] == [r["image"][0].tobytes() for r in heldout]
