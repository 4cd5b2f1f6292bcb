"""The typed configuration schema: one dataclass per section, a comment per field.

Every recipe and every command-line override is validated against these
dataclasses before any model, torch or vLLM import. Only this package and
`grpo_cli/cli/` touch OmegaConf/Hydra; everything below receives plain dataclasses.

One module per section: model.py, data.py, rewards.py (a `rewards[i]` entry), rollout.py (tools and the
environment too), trainer.py (and distill), run.py (eval, checkpoint, logging, dist, the whole TrainConfig
and the other commands' configs); errors.py holds ConfigError. Import the names from here.
"""

from grpo_cli.config.data import ANSWER_FORMATS, CHAT_INSTRUCTION, SAMPLER_NAMES, DataConfig, SamplerConfig
from grpo_cli.config.errors import ConfigError, require
from grpo_cli.config.model import BUILTIN_MODEL, LORA_TARGETS, LoraConfig, ModelConfig
from grpo_cli.config.rewards import REWARD_TEMPLATES, REWARD_TRANSFORMS, RewardSpec, check_reward_spec
from grpo_cli.config.rollout import TOOL_REJOIN, EnvironmentSpec, RolloutConfig, ToolSpec
from grpo_cli.config.run import (
    COMMAND_SCHEMAS,
    CheckpointConfig,
    DistConfig,
    EvalCommandConfig,
    EvalConfig,
    ExportCommandConfig,
    LoggingConfig,
    MergeCommandConfig,
    PlotCommandConfig,
    RewardCommandConfig,
    TrainConfig,
)
from grpo_cli.config.trainer import (
    ADVANTAGE_NAMES,
    CORRECTION_NAMES,
    KL_ESTIMATOR_NAMES,
    LOSS_NAMES,
    OBJECTIVE_NAMES,
    POLICY_LOSS_NAMES,
    DistillConfig,
    TrainerConfig,
)

__all__ = [
    "ADVANTAGE_NAMES", "ANSWER_FORMATS", "BUILTIN_MODEL", "CHAT_INSTRUCTION", "COMMAND_SCHEMAS",
    "CORRECTION_NAMES", "CheckpointConfig", "ConfigError", "DataConfig", "DistConfig", "DistillConfig",
    "EnvironmentSpec", "EvalCommandConfig", "EvalConfig", "ExportCommandConfig", "KL_ESTIMATOR_NAMES",
    "LORA_TARGETS", "LOSS_NAMES", "LoggingConfig", "LoraConfig", "MergeCommandConfig", "ModelConfig",
    "OBJECTIVE_NAMES", "POLICY_LOSS_NAMES", "PlotCommandConfig", "REWARD_TEMPLATES", "REWARD_TRANSFORMS",
    "RewardCommandConfig", "RewardSpec", "RolloutConfig", "SAMPLER_NAMES", "SamplerConfig", "TOOL_REJOIN",
    "ToolSpec", "TrainConfig", "TrainerConfig", "check_reward_spec", "require",
]
