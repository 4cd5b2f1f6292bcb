"""The rollout engines and the training loop end to end, on CPU with the shipped model: the session's
vLLM engine (conftest.vllm_engine) and its one real run (conftest.trained_run), in this process.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def shipped():
    import torch

    from grpo_cli.weights.checkpoint import load_policy, load_tokenizer, resolve_model_path

    path = resolve_model_path("builtin:bike_base")
    torch.manual_seed(0)
    return path, load_policy(path, "float32"), load_tokenizer(path)


def test_vllm_push_changes_engine_logprobs_to_match_trainer(vllm_engine, shipped):
    import torch

    from grpo_cli.algorithm import passes
    from grpo_cli.engines.base import Sampling
    from grpo_cli.prompts.templates import render_plain
    from grpo_cli.step.rollout import sample_seeds

    path, policy, tokenizer = shipped
    prompt = tokenizer(render_plain("A city bike costs 10 per day and Ana keeps it for 3 days. "
                                    "How much does Ana pay in total?"), add_special_tokens=False)["input_ids"]
    out = vllm_engine.generate([prompt], Sampling(4, 1.0, 1.0, 48), sample_seeds(0, 1, 1))
    assert len(out.completion_ids) == 1 and len(out.completion_ids[0]) == 4  # [P][G]
    assert all(len(lp) == len(ids) for lp, ids in zip(out.sampling_logprobs[0], out.completion_ids[0]))
    seq = prompt + out.completion_ids[0][0]
    before = torch.tensor(vllm_engine.score([seq])[0])  # [T-1]

    # One real GRPO-style update would do; a deterministic nudge of every weight is enough to see it move.
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    ids = torch.tensor([seq])
    trainer = passes.token_logprobs_reference(policy, ids, torch.ones_like(ids))[0]  # [T-1]
    assert (trainer - before).abs().max() > 1e-2  # the nudge matters to the trainer...

    vllm_engine.push_weights(policy.state_dict().items())
    after = torch.tensor(vllm_engine.score([seq])[0])  # [T-1]
    assert (after - before).abs().max() > 1e-2  # ...the engine's logprobs moved...
    assert (after - trainer).abs().max() < 1e-3  # ...and now match the trainer's.

    # Put the shipped weights back for other tests sharing the engine.
    from grpo_cli.weights.checkpoint import load_policy
    vllm_engine.push_weights(load_policy(path, "float32").state_dict().items())
    assert (torch.tensor(vllm_engine.score([seq])[0]) - before).abs().max() < 1e-4


def test_sampling_seeds_are_per_prompt_and_reproducible(vllm_engine, shipped):
    _, _, tokenizer = shipped
    from grpo_cli.engines.base import Sampling
    from grpo_cli.prompts.templates import render_plain
    from grpo_cli.step.rollout import sample_seeds

    q = "A city bike costs 10 per day and Ana keeps it for 3 days. How much does Ana pay in total?"
    prompt = tokenizer(render_plain(q), add_special_tokens=False)["input_ids"]
    a = vllm_engine.generate([prompt, prompt], Sampling(4, 1.0, 1.0, 32), sample_seeds(0, 5, 2, group_size=4))
    b = vllm_engine.generate([prompt, prompt], Sampling(4, 1.0, 1.0, 32), sample_seeds(0, 5, 2, group_size=4))
    assert a.completion_ids == b.completion_ids  # same (seed, step) -> same samples
    assert a.completion_ids[0] != a.completion_ids[1]  # two prompts do not share a random stream
    # nor does any sample of one share another's: with seeds one apart (before the fix), the second prompt's
    # samples 0..2 were the first's samples 1..3, token for token
    assert a.completion_ids[1][:3] != a.completion_ids[0][1:]


def test_train_end_to_end_with_vllm(trained_run, shipped):
    """The session's real run (conftest.trained_run): rewards, a push check after every push, the logged
    keys, and a final checkpoint that transformers loads and that training changed."""
    import torch
    from safetensors.torch import load_file

    _, run_dir = trained_run
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1, 2, 3, 4]
    for m in metrics[1:]:
        assert 0.0 <= m["reward/mean"] <= 1.1
        assert m["push_check/max_abs_diff"] < 1e-3  # vLLM's logprobs match the trainer's after every push
        assert m["push_check/tensors_mismatched"] == 0  # and its embedding and norms equal the trainer's
        assert m["mismatch/mean_abs_logprob"] < 1e-3  # and so did the sampling logprobs, before the update
        assert m["kl"] >= 0.0 and m["grad_norm"] > 0.0
        assert m["groups/all_correct_frac"] + m["groups/all_wrong_frac"] <= 1.0
    assert all("eval/pass@1" in metrics[s] for s in (0, 2, 4))
    logged = {"reward/mean", "reward/correct", "reward/format", "kl", "clip_frac", "grad_norm", "lr",
              "completion_len/mean", "completion_len/max", "truncation_rate", "groups/all_correct_frac",
              "groups/all_wrong_frac", "tokens_per_s", "time/generate", "time/reward", "time/logprobs",
              "time/update", "time/push", "time/step"}
    for m in metrics[1:]:
        assert logged <= set(m), logged - set(m)
        assert m["tokens_per_s"] > 0 and m["time/step"] > 0 and 0.0 <= m["truncation_rate"] <= 1.0
        assert 0 < m["completion_len/mean"] <= m["completion_len/max"] <= 160  # the recipe's max_new_tokens
    samples = [json.loads(line) for line in (run_dir / "completions.jsonl").read_text().splitlines()]
    assert {s["step"] for s in samples} == {2, 4} and {"prompt", "completion", "rewards", "advantage"} <= set(samples[0])

    final = run_dir / "checkpoints" / "final"
    assert (final / "model.safetensors").is_file() and (final / "tokenizer.json").is_file()
    from grpo_cli.weights.checkpoint import load_policy

    reloaded = load_policy(str(final), "float32")
    base = load_file(Path(shipped[0]) / "model.safetensors")
    trained = load_file(final / "model.safetensors")
    assert trained.keys() == base.keys()
    assert any(not torch.equal(trained[k], base[k]) for k in base)  # training changed the weights
    assert sum(p.numel() for p in reloaded.parameters()) == sum(p.numel() for p in shipped[1].parameters())


def test_train_with_hf_engine_no_reference_and_offline_wandb(tmp_path, monkeypatch):
    from grpo_cli import train
    from grpo_cli.cli import load_config

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    cfg = load_config("train", ["recipe=bike_pricing", f"output_dir={tmp_path}", "trainer.steps=2",
                                "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=32",
                                "eval.num_problems=2", "eval.every=0", "rollout.push_check_every=1",
                                "trainer.lr=1e-3", "rollout.engine=hf", "trainer.kl_coef=0", "logging.wandb=true"])
    run_dir = tmp_path / "run"
    assert train.run(cfg, run_dir) == 0
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["step"] == 2 and metrics[-1]["kl"] == 0.0
    assert metrics[-1]["mismatch/mean_abs_logprob"] < 1e-3
    # a real wandb run, offline (no API key here), inside the run directory, holding the metrics
    offline = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(offline) == 1
    records = b"".join(p.read_bytes() for p in offline[0].glob("*.wandb"))
    assert b"reward/mean" in records and b"kl" in records


def sampling_mismatch(engine, policy, prompts, temperature):
    """Mean |engine's sampling logprob - trainer's logprob at `temperature`| over the sampled tokens."""
    import torch

    from grpo_cli.algorithm import passes
    from grpo_cli.engines.base import Sampling
    from grpo_cli.step.rollout import sample_seeds

    out = engine.generate(prompts, Sampling(4, temperature, 1.0, 40), sample_seeds(0, 3, len(prompts)))
    total, tokens = 0.0, 0
    for p, prompt in enumerate(prompts):
        for ids, lps in zip(out.completion_ids[p], out.sampling_logprobs[p]):
            seq = torch.tensor([prompt + ids])
            with torch.no_grad():
                trainer = passes.token_logprobs(policy, seq, torch.ones_like(seq), temperature=temperature)[0]
            total += float((trainer[len(prompt) - 1:] - torch.tensor(lps)).abs().sum())
            tokens += len(ids)
    return total / tokens


@pytest.mark.parametrize("engine_kind", ["vllm", "hf"])
def test_sampling_logprobs_are_of_the_distribution_sampled_from_at_any_temperature(engine_kind, vllm_engine, shipped):
    """The engines report each sampled token's logprob after the temperature, as the trainer computes it
    (logits / rollout.temperature): the mismatch metric at T=0.7 stays at its T=1 level. vLLM's default
    (raw logprobs, before the temperature) gave 0.016 here at T=0.7, against 1e-8 at T=1."""
    from grpo_cli.engines.hf import HFEngine
    from grpo_cli.prompts.templates import render_plain
    from grpo_cli.weights.checkpoint import load_policy

    path, _, tokenizer = shipped
    # the shipped weights, as the session's engine holds them (another test nudges the `shipped` policy)
    policy = load_policy(path, "float32")
    engine = vllm_engine if engine_kind == "vllm" else HFEngine(policy, tokenizer)
    prompts = [tokenizer(render_plain(q), add_special_tokens=False)["input_ids"] for q in (
        "A city bike costs 10 per day and Ana keeps it for 3 days. How much does Ana pay in total?",
        "An e-bike costs 18 per day for 4 days with a 10% discount. What is the total price?")]
    at_one, at_cool = (sampling_mismatch(engine, policy, prompts, t) for t in (1.0, 0.7))
    assert at_one < 1e-3 and at_cool < max(2 * at_one, 1e-4), (at_one, at_cool)


def test_vllm_returns_sampling_logprobs_only_for_the_prompts_asked_and_samples_the_same_tokens(vllm_engine, shipped):
    """Sampling.logprob_seeds names the prompts whose samples bring their logprobs back: theirs are the numbers
    an all-prompts call gives, the others' are NaN, and no token changes (a run's samples do not depend on
    rollout.mismatch_groups); evaluation's empty set asks for none."""
    import math

    from grpo_cli.engines.base import NO_LOGPROBS, Sampling
    from grpo_cli.prompts.templates import render_plain
    from grpo_cli.step.rollout import sample_seeds

    _, _, tokenizer = shipped
    prompts = [tokenizer(render_plain(q), add_special_tokens=False)["input_ids"] for q in (
        "A city bike costs 10 per day and Ana keeps it for 3 days. How much does Ana pay in total?",
        "An e-bike costs 18 per day for 4 days with a 10% discount. What is the total price?",
        "A tandem costs 25 per day for 2 days. What is the total price?")]
    seeds = sample_seeds(0, 5, len(prompts), group_size=4)
    every = vllm_engine.generate(prompts, Sampling(4, 1.0, 1.0, 40), seeds)
    some = vllm_engine.generate(prompts, Sampling(4, 1.0, 1.0, 40, logprob_seeds=frozenset([seeds[1]])), seeds)
    none = vllm_engine.generate(prompts, Sampling(4, 1.0, 1.0, 40, logprob_seeds=NO_LOGPROBS), seeds)
    assert every.completion_ids == some.completion_ids == none.completion_ids
    assert some.sampling_logprobs[1] == every.sampling_logprobs[1]
    assert all(not any(math.isnan(x) for lps in group for x in lps) for group in every.sampling_logprobs)
    for group, ids in ((p, every.completion_ids[p]) for p in (0, 2)):
        assert [len(lps) for lps in some.sampling_logprobs[group]] == [len(c) for c in ids]
        assert all(math.isnan(x) for lps in some.sampling_logprobs[group] for x in lps)
    assert all(math.isnan(x) for group in none.sampling_logprobs for lps in group for x in lps)


def test_temperature_zero_is_greedy_on_both_engines(vllm_engine, shipped):
    """Sampling(temperature=0) is greedy decoding: the transformers engine (whose generate refuses temperature
    0) writes the same tokens as vLLM, whatever the seeds."""
    from grpo_cli.engines.base import Sampling
    from grpo_cli.engines.hf import HFEngine
    from grpo_cli.prompts.templates import render_plain
    from grpo_cli.weights.checkpoint import load_policy

    path, _, tokenizer = shipped
    engine = HFEngine(load_policy(path, "float32"), tokenizer)
    prompts = [tokenizer(render_plain(q), add_special_tokens=False)["input_ids"] for q in (
        "A city bike costs 10 per day and Ana keeps it for 3 days. How much does Ana pay in total?",
        "An e-bike costs 18 per day for 4 days with a 10% discount. What is the total price?")]
    greedy = Sampling(1, 0.0, 1.0, 60)
    hf, again = engine.generate(prompts, greedy, [1, 2]), engine.generate(prompts, greedy, [7, 8])
    assert hf.completion_ids == again.completion_ids == vllm_engine.generate(prompts, greedy, [1, 2]).completion_ids


def test_the_exact_push_check_sees_a_skipped_push_that_the_logprob_check_misses(vllm_engine, shipped_weights):
    """One small AdamW step (lr 1e-6) that never reaches the engine: invisible to the logprob check within its
    tolerance, caught element for element, at fp32 on the real engine and at bf16 through vLLM's own weight
    loader (a bf16 engine holds what that loader copies in)."""
    import torch
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    from grpo_cli.step.sync import EXACT_TENSORS, exact_push_check, mismatched_elements, push_check
    from grpo_cli.weights.checkpoint import load_policy, resolve_model_path

    policy = load_policy(resolve_model_path("builtin:bike_base"), "float32")
    vllm_engine.push_weights(policy.state_dict().items())
    differ, compared = exact_push_check(vllm_engine, policy)
    assert differ == 0 and compared == sum(policy.state_dict()[n].numel() for n in EXACT_TENSORS)
    bf16_engine = {}
    for name in EXACT_TENSORS:  # what a bf16 engine's load leaves in its parameters after the push
        bf16_engine[name] = torch.empty(policy.state_dict()[name].shape, dtype=torch.bfloat16)
        default_weight_loader(bf16_engine[name], policy.state_dict()[name])

    ids = torch.randint(0, 500, (2, 24), generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-6, weight_decay=0.0)
    policy(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()  # the trainer moves on; the push is skipped
    try:
        logprob_gap = push_check(vllm_engine, policy, [ids[0].tolist()], [4])
        assert logprob_gap < 0.02  # under any bf16 tolerance (config: >= 0.02): the logprob check passes
        differ, _ = exact_push_check(vllm_engine, policy)
        assert differ > compared // 2  # fp32: an Adam step moves nearly every element
        moved = sum(mismatched_elements(bf16_engine[n], policy.state_dict()[n]) for n in EXACT_TENSORS)
        assert 0 < moved < compared // 10  # bf16: a few elements cross a rounding boundary, and that is enough
        print(f"skipped push: logprob gap {logprob_gap:.2e}; fp32 {differ}/{compared}, bf16 {moved}/{compared} differ")
    finally:
        vllm_engine.push_weights(shipped_weights.items())


def test_a_teacher_that_fits_the_engine_is_evaluated_by_it_and_the_policy_is_pushed_back(vllm_engine, shipped):
    """train.teacher_heldout on the vLLM engine: a teacher with the policy's tensors is sampled by the run's own
    engine with the student's step-0 seeds, so a copy of the policy scores exactly the policy's own held-out
    pass@1, a scrambled copy none, and afterwards the engine samples the policy again (the same pass@1 as
    before)."""
    import torch
    from test_stages import stage_state

    from grpo_cli.cli import load_config
    from grpo_cli.preflight import preflight
    from grpo_cli.step.heldout import HeldoutSet
    from grpo_cli.train import heldout_eval, teacher_heldout
    from grpo_cli.weights.checkpoint import load_policy

    path, _, _ = shipped
    cfg = load_config("train", ["recipe=bike_pricing", "distill.teacher=builtin:bike_base", "eval.num_problems=32"])
    task = preflight(cfg)
    heldout = HeldoutSet.build(task.heldout_rows[:32], task.encode, task.reward_fns, cfg.data)
    policy = load_policy(path, "float32")
    scrambled = load_policy(path, "float32")
    with torch.no_grad():
        for p in scrambled.parameters():
            p.copy_(p[torch.randperm(p.shape[0], generator=torch.Generator().manual_seed(0))])
    run = {"task": task, "heldout": heldout, "policy": policy, "engine": vllm_engine}
    before = heldout_eval(stage_state(**run), cfg, 0)["eval/pass@1"]
    assert teacher_heldout(stage_state(**run, teacher=load_policy(path, "float32")), cfg) == {
        "eval/teacher_pass@1": before}
    assert teacher_heldout(stage_state(**run, teacher=scrambled), cfg) == {"eval/teacher_pass@1": 0.0}
    assert heldout_eval(stage_state(**run), cfg, 0)["eval/pass@1"] == before > 0.1
