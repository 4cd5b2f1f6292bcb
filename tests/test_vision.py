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
