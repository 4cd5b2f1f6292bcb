"""The run's state and the task it trains on: the types every stage of a step reads.

`Task` is what pre-flight checked (the prompts, the rewards, the model and its tokenizer, the tools);
`Start` is where a run starts (step 0, or a resumed checkpoint); `RunState` holds both with the models,
the engine, the optimizer and the prompt pool, from a run's first step to its last. They are built by
`grpo_cli.step.setup`, the run's composition root, which stands above every stage.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpo_cli.config import DataConfig
from grpo_cli.dist.ranks import Dist
from grpo_cli.engines.base import Engine
from grpo_cli.prompts.images import Vision
from grpo_cli.prompts.pool import PromptPool
from grpo_cli.prompts.templates import render_row
from grpo_cli.rewards.load import WeightedReward
from grpo_cli.step.heldout import HeldoutSet
from grpo_cli.tools.load import LoadedTool, tool_schemas

if TYPE_CHECKING:
    import torch

    from grpo_cli.rewards.teacher import ServedTeacher


@dataclass
class Task:
    """What preflight checked: the prompts, the rewards, the model and its tokenizer."""

    train_rows: list[dict[str, Any]]  # the train split, in dataset order
    heldout_rows: list[dict[str, Any]]  # the fixed held-out split
    reward_fns: list[WeightedReward]  # in recipe order (one of them is the correctness check)
    model_path: str  # the base model's directory (or hub id): the reference, and the start of a new run
    tokenizer: Any  # the model's tokenizer (a transformers tokenizer, pad token set)
    data: DataConfig  # how a row becomes a prompt (template, prompt column) and how its answer is marked
    tools: list[LoadedTool] = dataclasses.field(default_factory=list)  # rollout.tools, loaded (docs/tools.md)
    teacher_path: str | None = None  # distill.teacher's directory (or hub id), checked against the tokenizer
    vision: Vision | None = None  # rows with images: the vision-language model's processor (prompts.images); None = text

    def encode(self, row: dict[str, Any]) -> list[int]:
        """A row's prompt, rendered with data.template, as token ids: one image token per image (what vLLM takes
        with the images; `Vision.expand` gives the trainer's prompt)."""
        return self.tokenizer(render_row(row, self.data, self.tokenizer, self.tool_schemas, self.vision),
                              add_special_tokens=False)["input_ids"]

    @property
    def tokenizer_files(self) -> Any:
        """What a checkpoint saves beside the weights (`save_pretrained`): a vision-language model's processor (its
        tokenizer with it), else the tokenizer."""
        return self.vision.processor if self.vision is not None else self.tokenizer

    def images(self, row: dict[str, Any]) -> list[Any]:
        """A row's images ([] for a text row)."""
        return self.vision.images(row) if self.vision is not None else []

    @property
    def tool_schemas(self) -> list[dict] | None:
        """The chat-format tools' JSON schemas, shown in every prompt; None otherwise."""
        return tool_schemas(self.tools)


@dataclass
class Start:
    """Where a run starts: step 0 from the base model, or a resumed run's newest checkpoint."""

    step: int  # the last step already done (0 for a new run)
    path: str  # the weights the policy (and the engine) load
    state: dict[str, Any] | None  # the checkpoint's trainer state (None for a new run)
    schedule_steps: int  # the training steps the lr schedule spans: the original run's trainer.steps
    info: dict[str, Any] = dataclasses.field(default_factory=dict)  # the checkpoint's checkpoint.json


@dataclass
class RunState:
    """What a run holds from its first step to its last, built once by `start_run`. Every stage of a step
    takes it and the config section it reads (the whole TrainConfig when it reads several)."""

    task: Task  # the prompts, the rewards, the base model and its tokenizer
    dist: Dist  # this process's rank, the world size, the device; the loop's collectives
    run_dir: Path  # where metrics, logs and checkpoints go
    start: Start  # step 0 from the base model, or the checkpoint a resume continues from
    policy: torch.nn.Module  # the model being trained (inside its FSDP2 root at world size > 1)
    reference: torch.nn.Module | None  # the frozen reference for the KL term; None when trainer.kl_coef = 0 or with LoRA
    engine: Engine  # the rollout engine (rollout.engine), holding a copy of the policy's weights
    optimizer: torch.optim.Optimizer  # AdamW over the policy's parameters
    scheduler: torch.optim.lr_scheduler.LambdaLR  # warm-up and trainer.lr_schedule, over optimizer steps
    pool: PromptPool  # which train rows each step draws: the seeded order, the sampler's record (saved for an exact resume)
    heldout: HeldoutSet  # the eval.num_problems held-out problems every evaluation samples
    teacher: torch.nn.Module | ServedTeacher | None = None  # distill.teacher: frozen here, or served (None without)
    best_pass: float = -1.0  # the best held-out pass@1 so far; checkpoints/best holds that model
    history: list[dict[str, Any]] = field(default_factory=list)  # every step's metrics, for the summary
