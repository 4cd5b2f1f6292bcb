"""Helpers of the training step: micro-batching (batch.make_micro_batches), optimizer groups and lr schedules (optim)."""

from __future__ import annotations

import random

import pytest

from grpo_cli.step.batch import make_micro_batches


def test_every_sequence_lands_in_exactly_one_pass_shortest_first():
    lengths = [50, 10, 30, 10, 70, 20]
    batches = make_micro_batches(lengths, max_seqs=2)
    assert sorted(j for b in batches for j in b) == list(range(6))
    assert [[lengths[j] for j in b] for b in batches] == [[10, 10], [20, 30], [50, 70]]


def test_token_cap_bounds_rows_times_longest_row():
    rng = random.Random(0)
    lengths = [rng.randint(20, 200) for _ in range(64)]
    batches = make_micro_batches(lengths, max_seqs=64, max_tokens=1024)
    assert sorted(j for b in batches for j in b) == list(range(64))
    for b in batches:
        assert len(b) * max(lengths[j] for j in b) <= 1024
    # sorted and capped: far less padding than 4 passes of 16 in arrival order
    padded = sum(len(b) * max(lengths[j] for j in b) for b in batches)
    arrival = sum(16 * max(lengths[i:i + 16]) for i in range(0, 64, 16))
    assert padded < 0.8 * arrival


def test_a_sequence_longer_than_the_token_cap_gets_its_own_pass():
    batches = make_micro_batches([5, 400, 6], max_seqs=8, max_tokens=100)
    assert batches == [[0, 2], [1]]


@pytest.mark.parametrize("max_seqs", [1, 3])
def test_sequence_cap_without_token_cap(max_seqs):
    batches = make_micro_batches(list(range(10, 0, -1)), max_seqs=max_seqs)
    assert all(len(b) <= max_seqs for b in batches)
    assert len(batches) == -(-10 // max_seqs)


def test_param_groups_put_norm_gains_at_the_scaled_lr():
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from grpo_cli.step.optim import param_groups

    model = Qwen2ForCausalLM(Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=2, vocab_size=64))
    everything = {id(p) for p in model.parameters()}
    (single,) = param_groups(model, 1e-3, 1.0)
    assert {id(p) for p in single["params"]} == everything and single["lr"] == 1e-3

    rest, norms = param_groups(model, 1e-3, 10.0)
    assert {id(p) for p in rest["params"]} | {id(p) for p in norms["params"]} == everything
    assert not {id(p) for p in rest["params"]} & {id(p) for p in norms["params"]}
    norm_names = {n for n, p in model.named_parameters() if id(p) in {id(q) for q in norms["params"]}}
    assert norm_names == {"model.norm.weight"} | {f"model.layers.{i}.{k}.weight" for i in range(2)
                                                  for k in ("input_layernorm", "post_attention_layernorm")}
    assert norms["lr"] == pytest.approx(1e-2) and rest["lr"] == 1e-3
    # the warm-up schedule scales both groups alike
    opt = torch.optim.AdamW([rest, norms])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([5e-4, 5e-3])
    assert sched.get_last_lr()[0] == pytest.approx(5e-4)


def test_lr_schedules_warm_up_then_hold_or_decay_to_zero():
    from grpo_cli.algorithm.schedules import LR_SCHEDULES

    total, warmup = 100, 10
    for name, fn in LR_SCHEDULES.items():
        factors = [fn(i, warmup, total) for i in range(total)]
        assert factors[:warmup] == pytest.approx([(i + 1) / warmup for i in range(warmup)]), name
        assert factors[warmup] == pytest.approx(1.0), name
        assert all(a >= b for a, b in zip(factors[warmup:], factors[warmup + 1:])), name  # never rises after warm-up
    assert LR_SCHEDULES["constant"](99, warmup, total) == 1.0
    assert LR_SCHEDULES["linear"](99, warmup, total) == pytest.approx(1 / 90)
    assert LR_SCHEDULES["linear"](55, warmup, total) == pytest.approx(0.5)
    assert LR_SCHEDULES["cosine"](55, warmup, total) == pytest.approx(0.5)
    assert LR_SCHEDULES["cosine"](99, warmup, total) < 0.001
    assert LR_SCHEDULES["linear"](0, 0, 1) == 1.0  # a one-step run still takes its step


def test_unknown_lr_schedule_is_a_config_error():
    from grpo_cli.cli import UsageError, load_config

    with pytest.raises(UsageError, match="lr_schedule"):
        load_config("train", ["recipe=bike_pricing", "trainer.lr_schedule=exp"])


def sample_streams(seeds: list[int], group_size: int) -> list[int]:
    """The seed of every sample of a step: vLLM seeds sample g of a request from `seed + g` (as the tool loop
    does), [P*G]."""
    return [seed + g for seed in seeds for g in range(group_size)]


@pytest.mark.parametrize(("num_prompts", "group_size"), [(8, 8), (3, 16), (200, 1), (64, 4), (64, 128), (1024, 128)])
def test_no_two_samples_of_a_step_share_a_random_stream(num_prompts, group_size):
    """Sample g of prompt p and sample g-1 of prompt p+1 once drew from one stream (seeds base + p). Now every
    sample of a step, the dynamic-sampling rounds' (streams 2, 3) and the held-out set's (stream 1) included,
    has a seed of its own, for any run seed and step and at any batch size (8,192 samples a step once gave the
    held-out set training's seeds; 131,072 made neighbouring steps share them); a rank's slice of the seeds is
    the same slice at any world size, since the seeds are drawn for the whole step."""
    from grpo_cli.step.rollout import sample_seeds

    for run_seed in (0, 1, 12345):
        steps = {}
        for step in (0, 1, 2, 259, 20_000):
            steps[step] = sample_streams(sample_seeds(run_seed, step, num_prompts, 0, group_size), group_size)
            streams = steps[step] + [s for stream in (2, 3, 64) for s in
                                     sample_streams(sample_seeds(run_seed, step, num_prompts, stream, group_size),
                                                    group_size)]
            assert len(set(streams)) == len(streams), (run_seed, step)
            heldout = sample_streams(sample_seeds(run_seed, step, 200, stream=1, group_size=4), 4)
            assert not set(heldout) & set(streams) and len(set(heldout)) == len(heldout)
            assert all(0 <= s < 2**31 for s in steps[step]) and all(2**31 <= s < 2**63 for s in streams[len(steps[step]):] + heldout)
        training = [s for seeds in steps.values() for s in seeds]
        assert len(set(training)) == len(training)  # steps share no seed
        assert steps[1][0] - steps[0][0] == 104_729 * max(1, -(-num_prompts * group_size // 104_729))
    assert sample_seeds(0, 7, 8, group_size=8) == sample_seeds(0, 7, 8, group_size=8)  # a pure function
    with pytest.raises(ValueError, match="no slot"):
        sample_seeds(0, 1, 8, stream=65)
