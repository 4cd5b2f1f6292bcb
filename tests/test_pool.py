"""The prompt pool (data.sampler): uniform is the plain cursor, the samplers pass over settled prompts and
favour the column values that carry signal, no prompt starves, and a resume replays every choice."""

from __future__ import annotations

import io
import random

import pytest
import torch

from grpo_cli.config import ConfigError, SamplerConfig
from grpo_cli.errors import UsageError
from grpo_cli.prompts.pool import KEEP, PromptPool, column_values
from grpo_cli.prompts.rows import PromptCursor


def true_rate(row: int) -> float:
    """A synthetic task: a third of the rows always right, a third always wrong, a third in between."""
    return (1.0, 0.0, 0.5)[row % 3]


def observed(row: int, step: int, group_size: int = 8) -> float:
    """A group's pass rate for `row` at `step`: the in-between rows vary, the others are settled."""
    if true_rate(row) in (0.0, 1.0):
        return true_rate(row)
    rng = random.Random(f"{row}/{step}")
    return sum(rng.random() < 0.5 for _ in range(group_size)) / group_size


def drive(pool: PromptPool, first: int, stop: int, last: int | None = None, per_step: int = 4,
          ahead: int = 0) -> dict[int, list[int]]:
    """Steps first..stop of a run of `last` steps as the loop runs them with rollout.max_staleness=`ahead`: the
    draw of step t+ahead happens before step t is recorded. Returns the rows drawn, by step."""
    last = stop if last is None else last
    drawn: dict[int, list[int]] = {}
    for s in range(first, min(first + ahead, last + 1)):  # what `fill` draws before the loop: those not drawn yet
        if s not in pool.pending:
            drawn[s] = pool.take(per_step, s)
    for step in range(first, stop + 1):
        if step + ahead <= last and ahead:
            drawn[step + ahead] = pool.take(per_step, step + ahead)
        elif not ahead:
            drawn[step] = pool.take(per_step, step)
        rows = pool.pending[step]
        pool.record(step, [observed(r, step) for r in rows])
    return drawn


def steps_of(drawn: dict[int, list[int]]) -> list[list[int]]:
    return [drawn[s] for s in sorted(drawn)]


def test_uniform_draws_the_cursor_order():
    pool, cursor = PromptPool(10, 3, SamplerConfig()), PromptCursor(10, 3)
    for step in range(1, 30):
        assert pool.take(4, step) == cursor.take(4, step)
        pool.record(step, [0.0] * 4)  # settled groups change nothing under uniform
    assert pool.metrics(29)["pool/passed_over"] == 0


def test_skip_settled_passes_over_settled_prompts_and_none_starves():
    sampler = SamplerConfig(name="skip_settled", floor=0.1, max_skips=3)
    pool, uniform = PromptPool(30, 0, sampler), PromptPool(30, 0, SamplerConfig())
    steps = steps_of(drive(pool, 1, 600))
    plain = steps_of(drive(uniform, 1, 600))
    settled = [sum(true_rate(r) in (0.0, 1.0) for r in rows) / len(rows) for rows in steps[60:]]
    settled_uniform = [sum(true_rate(r) in (0.0, 1.0) for r in rows) / len(rows) for rows in plain[60:]]
    assert sum(settled_uniform) / len(settled_uniform) == pytest.approx(2 / 3, abs=0.02)
    assert sum(settled) / len(settled) < 0.45  # most draws are the rows that still vary
    # no prompt starves: each is taken at least once within max_skips + 1 turns, i.e. every few epochs
    last_taken = {row: 0 for row in range(30)}
    longest_gap = 0
    for step, rows in enumerate(steps, start=1):
        for row in rows:
            longest_gap = max(longest_gap, step - last_taken[row])
            last_taken[row] = step
    assert max(pool.skips.values(), default=0) <= sampler.max_skips
    epoch_steps = 30 / 4
    assert longest_gap <= (sampler.max_skips + 2) * epoch_steps * 2  # a settled row still comes back
    assert all(step > 600 - 60 for step in last_taken.values())


def test_signal_by_column_favours_the_values_with_signal_and_keeps_the_rest():
    values = [("easy", "hard", "mid")[r % 3] for r in range(300)]  # the column follows true_rate: 1, 0, 0.5
    sampler = SamplerConfig(name="signal_by_column", column="tier", floor=0.2, decay=0.9)
    pool = PromptPool(300, 1, sampler, values)
    steps = steps_of(drive(pool, 1, 200))
    late = [values[r] for rows in steps[50:] for r in rows]
    shares = {v: late.count(v) / len(late) for v in ("easy", "hard", "mid")}
    assert shares["mid"] > 0.55  # the value whose groups vary, well over its third
    assert shares["easy"] > 0.05 and shares["hard"] > 0.05  # the floor keeps the others coming
    metrics = pool.metrics(200)
    assert metrics["pool/signal/mid"] > 0.9 and metrics["pool/signal/easy"] < 0.05
    assert metrics["pool/seen"] > 100


@pytest.mark.parametrize("name", sorted(KEEP))
@pytest.mark.parametrize("ahead", [0, 2])
def test_a_resume_replays_every_choice(name, ahead):
    """A pool saved after step 40 of 100 (through torch.save and a weights_only load, as a checkpoint) and
    driven on draws the same rows as the uninterrupted pool, with rollout.max_staleness=`ahead` draws
    pending in the checkpoint."""
    values = [str(r % 3) for r in range(50)]
    sampler = SamplerConfig(name=name, column="tier", max_skips=2)
    straight = drive(PromptPool(50, 7, sampler, values), 1, 100, ahead=ahead)
    first = PromptPool(50, 7, sampler, values)
    before = drive(first, 1, 40, last=100, ahead=ahead)
    assert sorted(first.pending) == list(range(41, 41 + ahead))  # drawn ahead, saved with the pool
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    resumed = PromptPool(50, 7, sampler, values)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    after = drive(resumed, 41, 100, ahead=ahead)
    assert {**before, **after} == straight
    if name != "uniform":
        assert steps_of(straight) != steps_of(drive(PromptPool(50, 7, SamplerConfig(), values), 1, 100,
                                                    ahead=ahead))  # the sampler did choose


def test_a_pool_saved_before_the_pool_existed_resumes_as_its_cursor():
    cursor = PromptCursor(12, 5)
    cursor.take(7, 1)
    pool = PromptPool(12, 5, SamplerConfig(name="skip_settled"))
    pool.load_state_dict(cursor.state_dict())  # an older checkpoint: order and position only
    assert pool.take(5, 2) == cursor.take(5, 2) and pool.rates == {}


def test_record_refuses_a_count_that_does_not_match_the_draw():
    pool = PromptPool(10, 0, SamplerConfig())
    pool.take(4, 1)
    with pytest.raises(ValueError, match="drew 4 prompts and recorded 3"):
        pool.record(1, [0.0, 1.0, 0.5])


@pytest.mark.parametrize("overrides, message", [
    ({"name": "bandit"}, "data.sampler.name: 'bandit' is not one of uniform, skip_settled, signal_by_column"),
    ({"floor": 0.0}, "data.sampler.floor: must be in (0, 1]"),
    ({"band": [0.6, 0.4]}, "data.sampler.band: [0.6, 0.4] must be [low, high]"),
    ({"visits": 0}, "data.sampler.visits: must be >= 1"),
    ({"decay": 1.0}, "data.sampler.decay: must be in [0, 1)"),
    ({"max_skips": -1}, "data.sampler.max_skips: must be >= 0"),
])
def test_bad_sampler_settings_name_the_key(overrides, message):
    with pytest.raises(ConfigError) as raised:
        SamplerConfig(**overrides)
    assert message in str(raised.value)


def test_a_sampler_refuses_to_choose_prompts_by_a_correctness_check_the_run_does_not_train_on(cli):
    """recipe=bike_pricing_rm trains on a reward model and logs the checker with weight 0: a pool reading the
    checker's pass rates would steer the run by the gold score. Refused before any model loads; the same sampler
    on bike_pricing (the checker trained on) is not."""
    refused = cli("train", "recipe=bike_pricing_rm", "data.sampler.name=skip_settled")
    assert refused.returncode == 2 and "data.sampler.name: skip_settled chooses prompts by their groups' pass rate " \
        "under the correctness check, rewards[1] correct, which has weight 0 here" in refused.stderr
    assert cli("check", "recipe=bike_pricing_rm", "data.sampler.name=uniform").returncode == 0
    assert cli("check", "recipe=bike_pricing", "data.sampler.name=skip_settled").returncode == 0


def test_a_column_missing_from_a_row_is_named():
    rows = [{"question": "a", "tier": 1}, {"question": "b"}]
    assert column_values(rows, SamplerConfig()) is None  # only signal_by_column reads it
    with pytest.raises(UsageError, match="data.sampler.column: train row 1 has no column 'tier'"):
        column_values(rows, SamplerConfig(name="signal_by_column"))


def test_grpo_check_prints_the_sampler_and_flags_its_unused_settings(cli):
    result = cli("check", "recipe=countdown", "data.sampler.name=skip_settled", "data.sampler.decay=0.5",
                 "data.num_train=500")
    assert result.returncode == 0, result.stderr
    assert ("prompts: data.sampler.name=skip_settled, a row whose last 1 group(s) were settled is passed over (a "
            "group is settled at pass rate <= 0 or >= 1); taken anyway with probability 0.1, and always after 4 "
            "passes in a row") in result.stdout
    assert "warning: data.sampler.decay: unused with data.sampler.name=skip_settled" in result.stdout
    assert "never acts" not in result.stdout  # Countdown at 500 rows: 2,080 draws go over them four times
    result = cli("check", "recipe=bike_pricing", "data.sampler.name=skip_settled")
    assert ("warning: data.sampler.name=skip_settled: the run draws at most 2080 of 20000 train rows, so no prompt "
            "comes back and it never acts") in result.stdout
    result = cli("check", "recipe=bike_pricing")
    assert "prompts: data.sampler.name=uniform, every train row at its turn" in result.stdout
    assert "data.sampler" not in result.stdout.split("prompts:")[1].split("\n", 1)[1]  # no warning by default


def test_a_sampler_column_the_data_lacks_stops_the_run_before_any_model_loads(cli, tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(f'{{"question": "q{i}", "answer": "{i}"}}\n' for i in range(30)))
    result = cli("train", "recipe=bike_pricing", f"data.source={rows}", "data.num_heldout=5", "eval.num_problems=5",
                 "data.sampler.name=signal_by_column", f"output_dir={tmp_path / 'runs'}")
    assert result.returncode == 2, result.stdout[-500:]
    assert "data.sampler.column: train row 0 has no column 'tier' (its columns: answer, question)" in result.stderr
