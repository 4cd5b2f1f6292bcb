"""The training step's stages on their own: the prompt cursor, the train batch, the update's stats,
the rank/device seam (tier 1: CPU, seconds; Dist at 2 ranks is checked in test_distributed.py)."""

from __future__ import annotations

import pytest
import torch

from grpo_cli.algorithm.grpo import LossParams
from grpo_cli.config import SamplerConfig, TrainerConfig
from grpo_cli.dist import Dist
from grpo_cli.engines.base import Rollouts
from grpo_cli.prompts.pool import PromptPool
from grpo_cli.prompts.rows import PromptCursor
from grpo_cli.report.watch import NonFiniteGuard
from grpo_cli.rewards import RewardFailures, Scores
from grpo_cli.step.batch import TrainBatch
from grpo_cli.step.collect import Groups
from grpo_cli.step.update import DeviceSums


def test_cursor_walks_a_seeded_order_then_reshuffles_per_epoch():
    cursor = PromptCursor(5, seed=3)
    first = cursor.take(3, step=1) + cursor.take(2, step=2)
    assert sorted(first) == list(range(5))  # one epoch: every row once
    assert first == PromptCursor(5, seed=3).take(5, step=1)  # the order is a function of the seed
    wrapped = cursor.take(5, step=7)  # a new epoch, ordered by seed + step
    assert sorted(wrapped) == list(range(5))
    again = PromptCursor(5, seed=3)
    again.take(5, step=1)
    assert again.take(5, step=7) == wrapped


def test_cursor_state_round_trip_continues_exactly():
    cursor = PromptCursor(7, seed=0)
    cursor.take(9, step=1)  # past one epoch
    state = cursor.state_dict()
    expected = cursor.take(10, step=2)
    restored = PromptCursor(7, seed=0)
    restored.load_state_dict(state)
    assert restored.take(10, step=2) == expected


def groups_of(prompt_ids, completion_ids, advantages, keep):
    P, G = len(completion_ids), len(completion_ids[0])
    rollouts = Rollouts(prompt_ids, completion_ids,
                        [[[-0.5] * len(c) for c in group] for group in completion_ids],
                        [["x"] * G for _ in range(P)], [[False] * G for _ in range(P)])
    zeros = torch.zeros(P, dtype=torch.bool)
    return Groups([{}] * P, prompt_ids, rollouts,
                  Scores([0.0] * (P * G), {"correct": [0.0] * (P * G)}, [False] * (P * G)),
                  RewardFailures(), torch.zeros(P, G), torch.tensor(advantages), zeros, zeros,
                  torch.tensor(keep), dropped=torch.zeros(P, G, dtype=torch.bool))


def test_train_batch_keeps_groups_pads_once_and_normalizes_over_the_full_batch():
    prompt_ids = [[1, 2, 3], [4, 5], [6]]
    completion_ids = [[[7], [8, 9]], [[10, 11, 12], [13]], [[14, 15], [16]]]  # [P=3][G=2]
    advantages = [[1.0, -1.0], [0.0, 0.0], [0.5, -0.5]]
    groups = groups_of(prompt_ids, completion_ids, advantages, keep=[True, False, True])
    cfg = TrainerConfig(micro_batch_size=3, loss="token_mean")
    batch = TrainBatch.build(groups, pad_id=0, cfg=cfg, dist=Dist(), loss_params=LossParams())
    assert batch.prompt_tokens == [[1, 2, 3], [6]]  # the dropped group leaves the batch
    (part,) = batch.minibatches
    assert part.prompt_ids.tolist() == [[1, 2, 3], [6, 0, 0]] and part.prompt_mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch.completions == [[7], [8, 9], [14, 15], [16]] and batch.prompt_index == [0, 0, 1, 1]
    assert part.normalizer == 6.0  # completion tokens of the whole batch, not of one micro-batch
    assert batch.train_tokens == 2 * 3 + 2 * 1 + 6
    rows = [j for mb in batch.micro_batches for j in mb.rows]
    assert sorted(rows) == [0, 1, 2, 3] and [len(mb.rows) for mb in batch.micro_batches] == [3, 1]
    for mb in batch.micro_batches:
        for i, j in enumerate(mb.rows):
            n = len(batch.completions[j])
            assert mb.ids[i, :n].tolist() == batch.completions[j] and mb.mask[i].sum() == n
            assert mb.prompt_index[i] == batch.prompt_index[j]
            assert mb.advantages[i, 0] == [1.0, -1.0, 0.5, -0.5][j]
            assert mb.sampling_logprobs[i].tolist() == [-0.5] * n + [0.0] * (mb.ids.shape[1] - n)
    empty = TrainBatch.build(groups_of(prompt_ids, completion_ids, advantages, [False] * 3), 0, cfg, Dist(),
                             LossParams())
    assert empty.micro_batches == [] and empty.minibatches == [] and empty.train_tokens == 0


def test_minibatches_split_whole_groups_and_truncated_completions_can_leave():
    prompt_ids = [[1], [2, 2], [3, 3, 3]]
    completion_ids = [[[7], [8, 9]], [[10, 11, 12], [13]], [[14, 15], [16]]]  # [P=3][G=2]
    groups = groups_of(prompt_ids, completion_ids, [[1.0, -1.0]] * 3, keep=[True] * 3)
    groups.rollouts.truncated[1][0] = True  # the 3-token completion hit the cap
    cfg = TrainerConfig(minibatches=2, loss="grpo", mask_truncated=True)
    batch = TrainBatch.build(groups, pad_id=0, cfg=cfg, dist=Dist(), loss_params=LossParams())
    assert batch.completions == [[7], [8, 9], [13], [14, 15], [16]]  # [10, 11, 12] left the loss
    first, second = batch.minibatches
    assert first.prompt_ids.tolist() == [[1, 0], [2, 2]] and second.prompt_ids.tolist() == [[3, 3, 3]]
    assert (first.normalizer, second.normalizer) == (3.0, 2.0)  # each optimizer step: its own sequences
    assert [batch.completions[j] for mb in second.micro_batches for j in mb.rows] == [[16], [14, 15]]
    assert all(int(i) == 0 for mb in second.micro_batches for i in mb.prompt_index)  # local to its minibatch


def test_device_sums_weight_token_means_by_tokens_and_keep_every_key():
    from grpo_cli.algorithm.grpo import LossStats

    sums = DeviceSums()
    sums.add_stats(LossStats(("kl", "new_term", "tokens"), torch.tensor([0.1, 2.0, 3.0])))
    sums.add_stats(LossStats(("kl", "new_term", "tokens"), torch.tensor([0.4, 0.0, 1.0])))
    total, mismatch_sum, mismatch_tokens = sums.read()
    assert total["tokens"] == 4.0
    assert total["kl"] / total["tokens"] == pytest.approx(0.175) and total["new_term"] / total["tokens"] == 1.5
    assert (mismatch_sum, mismatch_tokens) == (0.0, 0.0)  # none added


def test_non_finite_guard_warns_then_stops_after_max_bad_steps_in_a_row():
    from grpo_cli.errors import RunFailure

    warnings: list[str] = []
    guard = NonFiniteGuard(max_bad_steps=2)
    guard.check({"skipped_nonfinite": 1}, 1, warnings.append)
    guard.check({"skipped_nonfinite": 0}, 2, warnings.append)  # a good step resets the count
    guard.check({"skipped_nonfinite": 1}, 3, warnings.append)
    with pytest.raises(RunFailure, match="2 steps in a row"):
        guard.check({"skipped_nonfinite": 1}, 4, warnings.append)
    assert [w.split(":")[0] for w in warnings] == ["step 1", "step 3", "step 4"]


def test_world_of_one_is_the_cpu_and_every_collective_returns_its_input(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    dist = Dist.init()
    assert (dist.rank, dist.world_size, dist.is_main, str(dist.device)) == (0, 1, True, "cpu")
    assert dist.sum([1.5, 2.0]) == [1.5, 2.0] and dist.all(False) is False and dist.broadcast({"a": 1}) == {"a": 1}


def test_a_batch_that_does_not_split_over_the_processes_is_refused_before_any_model_loads(monkeypatch):
    from grpo_cli.cli import load_config
    from grpo_cli.errors import UsageError
    from grpo_cli.preflight import preflight

    with pytest.raises(UsageError, match=r"rollout.prompts_per_step: 8 does not split over 3 processes"):
        load_config("train", ["recipe=bike_pricing", "dist.nproc_per_node=3"])
    with pytest.raises(UsageError, match=r"rollout.tensor_parallel_size: 2 does not divide the 1 processes"):
        load_config("train", ["recipe=bike_pricing", "rollout.tensor_parallel_size=2"])
    with pytest.raises(UsageError, match=r"rollout.tensor_parallel_size: splits a vLLM engine"):
        load_config("train", ["recipe=bike_pricing", "rollout.tensor_parallel_size=2", "rollout.engine=hf",
                              "dist.nproc_per_node=2"])
    cfg = load_config("train", ["recipe=bike_pricing"])  # plain torchrun: only WORLD_SIZE knows the count
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(UsageError, match=r"8 does not split over 3 processes \(WORLD_SIZE\)"):
        preflight(cfg)
    # a split job: WORLD_SIZE=2, one trainer takes every prompt, so an odd count runs (issue 54: check took it,
    # and both ranks then refused it at start)
    split = load_config("train", ["recipe=bike_pricing", "rollout.placement=split", "dist.nproc_per_node=2",
                                  "rollout.prompts_per_step=7"])
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert preflight(split) is not None


def test_each_rank_takes_a_contiguous_share_and_the_shares_cover_everything():
    from grpo_cli.step.batch import rank_share

    shares = [Dist(rank=r, world_size=3).share(8) for r in range(3)]
    assert shares == [range(0, 3), range(3, 6), range(6, 8)]
    assert [rank_share(range(4, 6), r, 3) for r in range(3)] == [range(4, 5), range(5, 6), range(6, 6)]


def stage_state(**parts):
    """A RunState that holds only what the stage under test reads (the rest None), at world size 1."""
    import dataclasses

    from grpo_cli.step.state import RunState

    unset = {f.name: None for f in dataclasses.fields(RunState) if f.name not in ("best_pass", "history")}
    return RunState(**{**unset, "dist": Dist(), **parts})


def tiny_policy(seed: int = 0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    return Qwen2ForCausalLM(config).train()


def run_update(micro_batch_size: int, ppo_epochs: int = 2, minibatches: int = 2, around=lambda update: update()):
    """One training step's update on a fixed synthetic batch; returns the weights after it and the stats.
    `around` runs the update itself (a test counts what happens inside it)."""
    from grpo_cli.config import RewardSpec, RolloutConfig, TrainConfig
    from grpo_cli.step.optim import build_optimizer
    from grpo_cli.step.update import fill_logprobs, loss_params, update

    g = torch.Generator().manual_seed(1)
    P, G = 4, 4
    prompt_ids = [torch.randint(1, 40, (3 + p,), generator=g).tolist() for p in range(P)]
    completion_ids = [[torch.randint(1, 40, (2 + (p + i) % 5,), generator=g).tolist() for i in range(G)]
                      for p in range(P)]
    advantages = torch.randn(P, G, generator=g).tolist()
    groups = groups_of(prompt_ids, completion_ids, advantages, keep=[True] * P)
    cfg = TrainConfig(task="t", rewards=[RewardSpec(name="correct")], rollout=RolloutConfig(prompts_per_step=P),
                      trainer=TrainerConfig(lr=3.0, kl_coef=0.0, ppo_epochs=ppo_epochs, minibatches=minibatches,
                                            micro_batch_size=micro_batch_size, clip_eps=0.2))
    policy = tiny_policy()
    _, scheduler = build_optimizer(policy, cfg.trainer)
    # Plain SGD here: Adam divides by the gradient's own size, so float noise in a near-zero gradient
    # becomes a full lr step, and weights after Adam cannot show that two splits agree.
    optimizer = torch.optim.SGD(policy.parameters(), lr=3.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, scheduler.lr_lambdas[0])
    params = loss_params(cfg)
    batch = TrainBatch.build(groups, 0, cfg.trainer, Dist(), params)
    state = stage_state(policy=policy, optimizer=optimizer, scheduler=scheduler)
    fill_logprobs(state, batch, groups, cfg)
    stats = around(lambda: update(state, batch, params, cfg))
    return {k: v.detach().clone() for k, v in policy.state_dict().items()}, stats, scheduler


def test_two_epochs_move_the_ratio_and_clip_and_the_micro_batch_split_changes_nothing():
    whole, stats, scheduler = run_update(micro_batch_size=64)
    assert stats["ratio"] != pytest.approx(1.0, abs=1e-3) and stats["clip_frac"] > 0  # later steps reuse samples
    assert scheduler.last_epoch == 4  # 2 epochs x 2 minibatches optimizer steps, each counted by the schedule
    split, split_stats, _ = run_update(micro_batch_size=1)
    for name, value in whole.items():
        torch.testing.assert_close(split[name], value, rtol=1e-5, atol=1e-6, msg=name)
    for key in ("loss", "ratio", "clip_frac", "kl", "entropy", "grad_norm"):
        assert split_stats[key] == pytest.approx(stats[key], rel=1e-5, abs=1e-7), key


def test_one_epoch_one_minibatch_keeps_the_ratio_at_one():
    _, stats, scheduler = run_update(micro_batch_size=3, ppo_epochs=1, minibatches=1)
    assert stats["ratio"] == pytest.approx(1.0) and stats["clip_frac"] == 0.0 and scheduler.last_epoch == 1


def loop_cfg(P: int, **trainer):
    from grpo_cli.config import RewardSpec, RolloutConfig, TrainConfig

    return TrainConfig(task="t", rewards=[RewardSpec(name="correct")], rollout=RolloutConfig(prompts_per_step=P),
                       trainer=TrainerConfig(**{"lr": 3.0, "kl_coef": 0.0, "micro_batch_size": 5, **trainer}))


def synthetic_groups(P: int = 3, G: int = 4, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    prompt_ids = [torch.randint(1, 40, (3 + p,), generator=g).tolist() for p in range(P)]
    completion_ids = [[torch.randint(1, 40, (2 + (p + i) % 4,), generator=g).tolist() for i in range(G)]
                      for p in range(P)]
    return groups_of(prompt_ids, completion_ids, torch.randn(P, G, generator=g).tolist(), keep=[True] * P)


def sgd_update(groups, cfg):
    """One update of a fresh tiny policy on `groups` with plain SGD; returns the weights and the batch."""
    from grpo_cli.step.update import fill_logprobs, loss_params, update

    policy = tiny_policy()
    optimizer = torch.optim.SGD(policy.parameters(), lr=cfg.trainer.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    params = loss_params(cfg)
    batch = TrainBatch.build(groups, 0, cfg.trainer, Dist(), params)
    state = stage_state(policy=policy, optimizer=optimizer, scheduler=scheduler)
    fill_logprobs(state, batch, groups, cfg)
    update(state, batch, params, cfg)
    return {k: v.detach().clone() for k, v in policy.state_dict().items()}, batch


def test_the_mismatch_metric_reads_only_the_samples_that_brought_their_logprobs_back():
    """Samples sampled without logprobs carry NaN (rollout.mismatch_groups): the metric is the mean over the others'
    tokens (as if only they were in the batch), None when no sample has any, and the update is the same bits."""
    import math

    from grpo_cli.step.update import fill_logprobs, loss_params, update

    def run(groups):
        cfg = loop_cfg(3, micro_batch_size=64)
        policy = tiny_policy()
        optimizer = torch.optim.SGD(policy.parameters(), lr=cfg.trainer.lr)
        params = loss_params(cfg)
        batch = TrainBatch.build(groups, 0, cfg.trainer, Dist(), params)
        state = stage_state(policy=policy, optimizer=optimizer,
                            scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0))
        fill_logprobs(state, batch, groups, cfg)
        stats = update(state, batch, params, cfg)
        return {k: v.detach().clone() for k, v in policy.state_dict().items()}, stats["mismatch/mean_abs_logprob"]

    known, part, unknown, alone = (synthetic_groups() for _ in range(4))
    for groups, asked in ((part, {0}), (unknown, set())):
        groups.rollouts.sampling_logprobs = [[lps if p in asked else [math.nan] * len(lps) for lps in group]
                                             for p, group in enumerate(groups.rollouts.sampling_logprobs)]
    alone.keep = torch.tensor([True, False, False])  # group 0 alone in the batch
    (w_known, m_known), (w_part, m_part), (w_unknown, m_unknown) = run(known), run(part), run(unknown)
    assert m_part == pytest.approx(run(alone)[1], rel=1e-5) and m_part != pytest.approx(m_known, rel=1e-3)
    assert m_unknown is None and math.isfinite(m_known)
    assert all(w_known[k].equal(w_part[k]) and w_known[k].equal(w_unknown[k]) for k in w_known)


def test_seq_mask_rejection_is_the_update_without_the_rejected_samples():
    """A sample rejected by trainer.mismatch_correction=seq_mask leaves the loss and the normalizer: the
    update equals the one where those samples never entered the batch."""
    from grpo_cli.step.update import batch_logprobs

    P, G = 3, 4
    groups = synthetic_groups(P, G)
    cfg = loop_cfg(P, mismatch_correction="seq_mask")
    batch = TrainBatch.build(groups, 0, cfg.trainer, Dist(), LossParams())
    own = batch_logprobs(tiny_policy(), batch, cfg.trainer.logprob_chunk_tokens, 1.0)  # the trainer's logprobs
    rejected = {(0, 1), (2, 0), (2, 3)}
    for mb, lp in zip(batch.micro_batches, own):
        for i, j in enumerate(mb.rows):
            slot, g = batch.group_of[j]
            n = len(batch.completions[j])
            offset = 3.0 if (slot, g) in rejected else 0.0  # geometric-mean ratio e^3 > seq_mask_high
            groups.rollouts.sampling_logprobs[slot][g] = (lp[i, :n] - offset).tolist()
    masked, masked_batch = sgd_update(groups, cfg)
    assert masked_batch.minibatches[0].normalizer == P * G - len(rejected)  # grpo: the sequences in the loss

    groups.dropped = torch.tensor([[(p, g) in rejected for g in range(G)] for p in range(P)])
    alone, _ = sgd_update(groups, loop_cfg(P))
    for name, value in alone.items():
        torch.testing.assert_close(masked[name], value, rtol=1e-5, atol=1e-6, msg=name)
    assert any(not masked[k].equal(tiny_policy().state_dict()[k]) for k in masked)  # the update moved weights


def test_kl_in_reward_keeps_dropped_samples_out_of_their_groups_statistics():
    """With trainer.kl_in_reward, the advantages recomputed from the penalised rewards leave the samples a
    reward with on_failure=drop failed on out of their group's mean and std, as the normal path does."""
    from grpo_cli.algorithm import grpo
    from grpo_cli.step.update import fill_logprobs

    P, G = 2, 4
    groups = synthetic_groups(P, G)
    groups.reward = torch.tensor([[1.0, 0.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    groups.dropped = torch.tensor([[False, True, False, False], [False, False, False, False]])
    cfg = loop_cfg(P, kl_coef=0.5, kl_in_reward=True)
    from grpo_cli.step.update import loss_params

    batch = TrainBatch.build(groups, 0, cfg.trainer, Dist(), loss_params(cfg))
    fill_logprobs(stage_state(policy=tiny_policy(), reference=tiny_policy(seed=1)), batch, groups, cfg)
    advantage, penalty = {}, {}
    for mb in batch.micro_batches:
        kl = grpo.KL_ESTIMATORS["k3"](mb.old_logprobs, mb.ref_logprobs)  # [b, Tc]
        for i, j in enumerate(mb.rows):
            advantage[batch.group_of[j]] = float(mb.advantages[i, 0])
            penalty[batch.group_of[j]] = float((kl[i] * mb.mask[i]).sum())
    assert (0, 1) not in advantage  # the dropped sample is not in the batch
    valid = [0, 2, 3]
    rewards = torch.tensor([[float(groups.reward[0, g]) - 0.5 * penalty[(0, g)] for g in valid]])  # [1, 3]
    expected = grpo.group_std_advantages(rewards)[0]  # its group is its three valid samples
    assert [advantage[(0, g)] for g in valid] == pytest.approx(expected.tolist(), abs=1e-5)


@pytest.fixture(scope="module")
def hf_engine(tmp_path_factory):
    """transformers generate on a tiny random model with the shipped tokenizer: a real engine, in seconds."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from grpo_cli.engines.hf import HFEngine
    from grpo_cli.weights.checkpoint import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("builtin:bike_base"))
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return HFEngine(Qwen2ForCausalLM(config), tokenizer), tokenizer


def even_rows_solved(completions, id, **kwargs):
    """Every sample of an even row scores 1 (no variance); odd rows score by text length parity."""
    return [1.0 if i % 2 == 0 else float(len(c) % 2) for c, i in zip(completions, id)]


def test_dynamic_sampling_adds_rounds_until_enough_groups_have_signal(hf_engine):
    from grpo_cli.config import DataConfig, RewardSpec, RolloutConfig, TrainConfig
    from grpo_cli.rewards import WeightedReward
    from grpo_cli.step.collect import collect_groups
    from grpo_cli.step.state import Task
    from grpo_cli.step.timer import StepTimer

    engine, tokenizer = hf_engine
    rows = [{"id": i, "question": f"q{i}"} for i in range(40)]
    rewards = [WeightedReward("even_rows_solved", even_rows_solved, 1.0)]
    task = Task(rows, [], rewards, "", tokenizer, DataConfig())

    cfg = TrainConfig(task="t", rewards=[RewardSpec(name="correct")],
                      rollout=RolloutConfig(prompts_per_step=4, group_size=4, max_new_tokens=6, dynamic_sampling=True,
                                            max_sampling_rounds=5))

    def collect(pool):
        return collect_groups(stage_state(task=task, engine=engine, pool=pool), cfg, 3, StepTimer())

    pool = PromptPool(len(rows), 0, SamplerConfig())
    groups = collect(pool)
    varied = ~(groups.all_correct | groups.all_wrong)
    assert groups.rounds >= 2 and len(groups.rows) == 4 * groups.rounds  # each round: 4 more prompts
    assert int(groups.keep.sum()) == 4  # exactly prompts_per_step groups enter the loss...
    assert bool((varied | ~groups.keep).all())  # ...each with reward variance
    assert all(r["id"] % 2 == 1 for r, k in zip(groups.rows, groups.keep.tolist()) if k)
    assert pool.cursor.position == 4 * groups.rounds
    drawn = list(pool.pending[3])
    assert [rows[i] for i in drawn] == groups.rows  # every round's prompts, in the groups' order
    pool.record(3, groups.pass_rate.tolist())  # what the loop records: one pass rate per group of every round
    assert [pool.rates[i] for i in drawn] == [[rate] for rate in groups.pass_rate.tolist()]
    assert all(pool.rates[i] == [1.0] for i in drawn if i % 2 == 0)  # an even row: every sample right
    again = collect(PromptPool(len(rows), 0, SamplerConfig()))  # a pure function of (seed, step, round, prompt)
    assert again.rollouts.completion_ids == groups.rollouts.completion_ids
    cfg.rollout.dynamic_sampling = False
    single = collect(PromptPool(len(rows), 0, SamplerConfig()))
    assert single.rounds == 1 and bool(single.keep.all())  # off: one round, every group kept
    assert single.rollouts.completion_ids == groups.rollouts.completion_ids[:4]  # round 0 samples as before


def test_the_optimizer_state_round_trips_exactly_with_two_parameter_groups(tmp_path):
    """AdamW's moments go to optimizer/ by parameter name (torch.distributed.checkpoint) and come back exactly."""
    from grpo_cli.step.optim import build_optimizer
    from grpo_cli.weights.checkpoint import load_optimizer, save_optimizer

    policy = tiny_policy()
    optimizer, _ = build_optimizer(policy, TrainerConfig(norm_lr_scale=0.5))  # two groups: norms, the rest
    policy(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    optimizer.step()
    saved = optimizer.state_dict()
    fresh, _ = build_optimizer(policy, TrainerConfig(norm_lr_scale=0.5))
    save_optimizer(optimizer, policy, tmp_path / "optimizer")
    load_optimizer(fresh, policy, tmp_path / "optimizer", saved["param_groups"])
    restored = fresh.state_dict()
    assert restored["param_groups"] == saved["param_groups"]
    assert restored["state"].keys() == saved["state"].keys()
    for i, values in saved["state"].items():
        for key, value in values.items():
            assert restored["state"][i][key].equal(value), (i, key)


def counting_syncs(monkeypatch, counts: list[int]):
    """An `around` for run_update: counts the host reads of a tensor (item, tolist, float, int, bool) that
    grpo_cli's own code makes inside the update (on a GPU each one waits for the device; transformers' own
    are not counted) and appends the count to `counts`."""
    import sys

    def around(update):
        calls = [0]
        for name in ("item", "tolist", "__float__", "__int__", "__bool__"):
            original = getattr(torch.Tensor, name)

            def counted(self, *args, _original=original, **kwargs):
                calls[0] += "/grpo_cli/" in sys._getframe(1).f_code.co_filename
                return _original(self, *args, **kwargs)

            monkeypatch.setattr(torch.Tensor, name, counted)
        try:
            return update()
        finally:
            monkeypatch.undo()
            counts.append(calls[0])

    return around


def test_the_update_reads_the_device_once_per_optimizer_step_whatever_the_micro_batches(monkeypatch):
    """4 optimizer steps (2 epochs x 2 minibatches) over 16 samples, as 1 micro-batch a step or as 4 of one
    sample each: one host sync per optimizer step (its loss and grad norm) and one for the step's stats."""
    counts: list[int] = []
    _, whole, _ = run_update(micro_batch_size=64, around=counting_syncs(monkeypatch, counts))
    _, split, _ = run_update(micro_batch_size=1, around=counting_syncs(monkeypatch, counts))
    assert counts == [4 + 1, 4 + 1]
    assert split["kl"] == pytest.approx(whole["kl"], abs=1e-7) and split["loss"] == pytest.approx(whole["loss"], rel=1e-5)


def test_the_prompt_gradient_builds_up_in_float32_when_the_prompt_states_are_bf16():
    """Under bf16 autocast on a GPU the shared prompt pass's states come out bf16 (on the CPU the cache keeps
    them in float32, so they are cast here, inside the graph): their gradient leaves are float32, so the
    sum over micro-batches rounds once, and the backward through the prompt pass takes it in bf16."""
    from grpo_cli.algorithm import passes

    policy = tiny_policy()
    prompt_ids = torch.tensor([[3, 4, 5, 6], [7, 8, 9, 0]])  # [P, Tp] right-padded
    prompt_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    completion = torch.tensor([[11, 12], [13, 14], [15, 16]])  # [b, Tc]
    full = passes.prompt_states(policy, prompt_ids, prompt_mask)
    states = passes.PromptStates([(k.to(torch.bfloat16), v.to(torch.bfloat16)) for k, v in full.kv],
                                 full.final.to(torch.bfloat16), full.mask)
    leaves = passes.prompt_leaves(states)
    assert all(t.dtype == torch.float32 for pair in leaves.kv for t in pair) and leaves.final.dtype == torch.float32
    for rows in ([0, 1], [2]):  # two micro-batches add into the same leaves
        logps = passes.completion_logprobs(policy, leaves, torch.tensor([0, 1, 0])[rows], completion[rows],
                                           torch.ones(len(rows), 2, dtype=torch.long))
        logps.sum().backward()
    assert leaves.kv[0][1].grad.dtype == torch.float32 and leaves.kv[0][1].grad.abs().sum() > 0
    policy.zero_grad()
    passes.prompt_backward(states, leaves)  # a float32 gradient into bf16 outputs: cast, not refused
    embed = policy.get_input_embeddings().weight.grad
    assert embed is not None and embed[[3, 4, 5, 6, 7, 8, 9]].abs().sum() > 0  # the prompts' tokens got their share
