"""The typed schema: defaults validate, cross-field checks name the key, every field is documented."""

from __future__ import annotations

import dataclasses
import inspect
import re

import pytest

from grpo_cli import config as schema
from grpo_cli.config import ConfigError, RewardSpec, RolloutConfig, TrainConfig, TrainerConfig


def all_dataclasses():
    return [obj for _, obj in inspect.getmembers(schema, inspect.isclass)
            if dataclasses.is_dataclass(obj) and obj.__module__ == schema.__name__]


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
    from grpo_cli.grpo import LOSSES

    for name in LOSSES:
        assert TrainerConfig(loss=name).loss == name
    accepted = re.search(r"is not one of (.*)$", str(pytest.raises(ConfigError, TrainerConfig, loss="x").value))
    assert sorted(accepted.group(1).split(", ")) == sorted(LOSSES)
