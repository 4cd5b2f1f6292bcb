"""The training step's stages on their own: the prompt cursor, the train batch, the update's stats,
the rank/device seam (tier 1: CPU, seconds; the 2-rank check launches torchrun)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from grpo_cli.batch import TrainBatch
from grpo_cli.collect import Groups, PromptCursor
from grpo_cli.config import TrainerConfig
from grpo_cli.dist import Dist
from grpo_cli.rewards import RewardFailures, Scores
from grpo_cli.rollout import Rollouts
from grpo_cli.update import NonFiniteGuard, merge_token_means


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
    return Groups([{}] * P, prompt_ids, rollouts, Scores([0.0] * (P * G), {"correct": [0.0] * (P * G)}),
                  RewardFailures(), torch.zeros(P, G), torch.tensor(advantages), zeros, zeros,
                  torch.tensor(keep))


def test_train_batch_keeps_groups_pads_once_and_normalizes_over_the_full_batch():
    prompt_ids = [[1, 2, 3], [4, 5], [6]]
    completion_ids = [[[7], [8, 9]], [[10, 11, 12], [13]], [[14, 15], [16]]]  # [P=3][G=2]
    advantages = [[1.0, -1.0], [0.0, 0.0], [0.5, -0.5]]
    groups = groups_of(prompt_ids, completion_ids, advantages, keep=[True, False, True])
    cfg = TrainerConfig(micro_batch_size=3, loss="token_mean")
    batch = TrainBatch.build(groups, pad_id=0, cfg=cfg, dist=Dist())
    assert batch.prompt_tokens == [[1, 2, 3], [6]]  # the dropped group leaves the batch
    assert batch.prompt_ids.tolist() == [[1, 2, 3], [6, 0, 0]] and batch.prompt_mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch.completions == [[7], [8, 9], [14, 15], [16]] and batch.prompt_index == [0, 0, 1, 1]
    assert batch.normalizer == 6.0  # completion tokens of the whole batch, not of one micro-batch
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
    empty = TrainBatch.build(groups_of(prompt_ids, completion_ids, advantages, [False] * 3), 0, cfg, Dist())
    assert empty.micro_batches == [] and empty.normalizer == 1.0 and empty.train_tokens == 0


def test_merge_token_means_weights_by_tokens_and_keeps_every_key():
    total: dict[str, float] = {}
    merge_token_means(total, {"kl": 0.1, "new_term": 2.0, "tokens": 3.0})
    merge_token_means(total, {"kl": 0.4, "new_term": 0.0, "tokens": 1.0})
    assert total["tokens"] == 4.0
    assert total["kl"] / total["tokens"] == pytest.approx(0.175) and total["new_term"] / total["tokens"] == 1.5


def test_non_finite_guard_warns_then_stops_after_max_bad_steps_in_a_row():
    from grpo_cli.errors import UsageError

    warnings: list[str] = []
    guard = NonFiniteGuard(max_bad_steps=2)
    guard.check({"skipped_nonfinite": 1}, 1, warnings.append)
    guard.check({"skipped_nonfinite": 0}, 2, warnings.append)  # a good step resets the count
    guard.check({"skipped_nonfinite": 1}, 3, warnings.append)
    with pytest.raises(UsageError, match="2 steps in a row"):
        guard.check({"skipped_nonfinite": 1}, 4, warnings.append)
    assert [w.split(":")[0] for w in warnings] == ["step 1", "step 3", "step 4"]


def test_world_of_one_is_the_cpu_and_every_collective_returns_its_input(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    dist = Dist.init()
    assert (dist.rank, dist.world_size, dist.is_main, str(dist.device)) == (0, 1, True, "cpu")
    assert dist.sum([1.5, 2.0]) == [1.5, 2.0] and dist.all(False) is False and dist.broadcast({"a": 1}) == {"a": 1}


def test_preflight_refuses_several_processes_until_they_are_built(monkeypatch):
    from grpo_cli.cli import load_config
    from grpo_cli.errors import UsageError
    from grpo_cli.setup import preflight

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(UsageError, match="WORLD_SIZE=2"):
        preflight(load_config("train", ["recipe=bike_pricing"]))


WORKER = textwrap.dedent('''
    from grpo_cli.dist import Dist
    dist = Dist.init()
    total = dist.sum([float(dist.rank + 1), 0.5])
    agreed = dist.all(dist.rank == 0)
    sent = dist.broadcast({"from": dist.rank})
    print(f"rank {dist.rank}/{dist.world_size} main={dist.is_main} sum={total} all={agreed} got={sent['from']}")
    dist.barrier()
''')


@pytest.mark.slow
def test_two_gloo_ranks_reduce_and_broadcast(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--master-addr", "127.0.0.1", "--master-port", "0", str(script)],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = sorted(line for line in out.stdout.splitlines() if line.startswith("rank "))
    assert lines == ["rank 0/2 main=True sum=[3.0, 1.0] all=False got=0",
                     "rank 1/2 main=False sum=[3.0, 1.0] all=False got=0"]
