"""How a step's sequences are grouped into forward/backward passes (grpo_cli.train.make_micro_batches)."""

from __future__ import annotations

import random

import pytest

from grpo_cli.train import make_micro_batches


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
