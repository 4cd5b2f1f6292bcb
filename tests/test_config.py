"""The typed schema: defaults validate, cross-field checks name the key, every field is documented."""

from __future__ import annotations

import dataclasses
import inspect
import re

import pytest

from grpo_cli import config as schema
from grpo_cli.config import ConfigError, DistConfig, RewardSpec, RolloutConfig, TrainConfig, TrainerConfig


def all_dataclasses():
    return [obj for _, obj in inspect.getmembers(schema, inspect.isclass)
            if dataclasses.is_dataclass(obj) and obj.__module__.startswith(schema.__name__ + ".")]


def test_every_field_has_a_comment():
    for cls in all_dataclasses():
        body = inspect.getsource(cls)
        own = [f for f in dataclasses.fields(cls) if re.search(rf"^    {f.name}:", body, re.MULTILINE)]
        assert own or cls.__bases__ != (object,), cls.__name__
        for f in own:
            line = re.search(rf"^    {f.name}:.*$", body, re.MULTILINE).group(0)
            assert "  # " in line, f"{cls.__name__}.{f.name} has no comment"


def test_defaults_validate():
    cfg = TrainConfig(task="t", rewards=[RewardSpec(name="correct")])
    assert cfg.rollout.group_size >= 2 and cfg.trainer.kl_coef >= 0


@pytest.mark.parametrize(
    ("build", "key"),
    [
        (lambda: RolloutConfig(group_size=1), "rollout.group_size"),
        (lambda: RolloutConfig(temperature=0.0), "rollout.temperature"),
        (lambda: RolloutConfig(engine="tgi"), "rollout.engine"),
        (lambda: TrainerConfig(clip_eps=1.5), "trainer.clip_eps"),
        (lambda: TrainerConfig(kl_coef=-1.0), "trainer.kl_coef"),
        (lambda: TrainerConfig(betas=[0.9]), "trainer.betas"),
        (lambda: TrainerConfig(loss="tokenmean"), "trainer.loss"),
        (lambda: TrainConfig(task="t"), "rewards"),
        (lambda: TrainConfig(task="t", rewards=[RewardSpec(name="correct")],
                             eval=schema.EvalConfig(num_problems=10_000)), "eval.num_problems"),
    ],
)
def test_bad_values_name_the_full_key(build, key):
    with pytest.raises(ConfigError) as err:
        build()
    assert str(err.value).startswith(f"{key}:")


def test_trainer_loss_accepts_exactly_the_losses_table():
    from grpo_cli.algorithm.grpo import LOSSES

    for name in LOSSES:
        assert TrainerConfig(loss=name).loss == name
    accepted = re.search(r"is not one of (.*)$", str(pytest.raises(ConfigError, TrainerConfig, loss="x").value))
    assert sorted(accepted.group(1).split(", ")) == sorted(LOSSES)


@pytest.mark.parametrize(("build", "message"), [
    (lambda: RolloutConfig(max_staleness=1, engine="hf"), "rollout.max_staleness: needs rollout.engine=vllm"),
    (lambda: RolloutConfig(max_staleness=1, sleep_mode="on"), "rollout.max_staleness: samples while the trainer"),
    (lambda: RolloutConfig(max_staleness=1, tensor_parallel_size=2), "rollout.max_staleness: needs rollout.tensor_"),
    (lambda: RolloutConfig(max_staleness=1, dynamic_sampling=True), "rollout.max_staleness: does not combine"),
    (lambda: RolloutConfig(max_staleness=-1), "rollout.max_staleness: must be >= 0"),
    (lambda: RolloutConfig(overlap="sometimes"), "rollout.overlap: 'sometimes' is not one of auto, thread, off"),
    (lambda: TrainConfig(task="t", rewards=[RewardSpec(name="correct")], rollout=RolloutConfig(max_staleness=1),
                         trainer=TrainerConfig(offload_optimizer=True)), "trainer.offload_optimizer: moves AdamW's"),
    (lambda: RolloutConfig(placement="apart"), "rollout.placement: 'apart' is not one of colocated, split"),
    (lambda: RolloutConfig(placement="split", engine="hf"), "rollout.placement: split gives the generator rank"),
    (lambda: TrainConfig(task="t", rewards=[RewardSpec(name="correct")], rollout=RolloutConfig(placement="split")),
     "rollout.placement: split needs at least one trainer rank besides rollout.generator_ranks=1, and the job has 1 "
     "processes (dist.nproc_per_node=1 x dist.nnodes=1); e.g. dist.nproc_per_node=2"),
    (lambda: TrainConfig(task="t", rewards=[RewardSpec(name="correct")],
                         rollout=RolloutConfig(placement="split", generator_ranks=4),
                         dist=DistConfig(nproc_per_node=2, nnodes=2)), "rollout.placement: split needs at least one "
                                                                       "trainer rank besides rollout.generator_ranks=4"),
    (lambda: RolloutConfig(generator_ranks=2), "rollout.generator_ranks: 2: only a split job has generator ranks"),
    (lambda: RolloutConfig(placement="split", generator_ranks=0), "rollout.generator_ranks: must be >= 1"),
    (lambda: TrainConfig(task="t", rewards=[RewardSpec(name="correct")],
                         rollout=RolloutConfig(placement="split", prompts_per_step=5),
                         dist=DistConfig(nproc_per_node=3)),  # two trainer ranks share the prompts
     "rollout.prompts_per_step: 5 does not split over 2 processes"),
])
def test_settings_that_cannot_sample_ahead_or_split_are_refused(build, message):
    """rollout.max_staleness > 0 samples while the trainer steps: what cannot run beside the update is refused
    with the key that decides it, before any model loads."""
    with pytest.raises(ConfigError) as err:
        build()
    assert str(err.value).startswith(message)
    RolloutConfig(max_staleness=1, sleep_mode="auto")  # auto turns sleep off for it (rollout.sleep_wanted)


@pytest.mark.parametrize(("staleness", "asked", "runs"), [(0, "auto", "none"), (1, "auto", "tis"), (2, "auto", "tis"),
                                                          (1, "none", "none"), (0, "seq_mask", "seq_mask")])
def test_mismatch_correction_auto_is_tis_exactly_when_samples_are_stale(staleness, asked, runs):
    cfg = TrainConfig(task="t", rewards=[RewardSpec(name="correct")], rollout=RolloutConfig(max_staleness=staleness),
                      trainer=TrainerConfig(mismatch_correction=asked))
    assert cfg.trainer.mismatch_correction == runs


@pytest.mark.parametrize(("groups", "correction", "asked"), [(1, "none", [11]), (2, "none", [11, 12]), (0, "none", []),
                                                             (-1, "none", None), (1, "tis", None), (0, "seq_mask", None)])
def test_the_sampling_logprobs_come_back_for_every_group_a_correction_reads_and_for_the_first_groups_else(
        groups, correction, asked):
    """rollout.mismatch_groups picks the first groups of a step, by seed (which a rank's share keeps), when only the
    mismatch metric reads the engine's logprobs; a correction reads every group's."""
    from grpo_cli.step.rollout import training_sampling

    cfg = TrainConfig(task="t", rewards=[RewardSpec(name="correct")], rollout=RolloutConfig(mismatch_groups=groups),
                      trainer=TrainerConfig(mismatch_correction=correction))
    sampling = training_sampling(cfg, [11, 12, 13])
    assert sampling.logprob_seeds == (None if asked is None else frozenset(asked))
    with pytest.raises(ConfigError, match="rollout.mismatch_groups"):
        RolloutConfig(mismatch_groups=-2)
