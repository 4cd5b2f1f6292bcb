"""The optimizer side of a run: AdamW's parameter groups, the schedule (from grpo_cli.algorithm.schedules) over its
steps, and the optimizer state's moves off and back onto the device."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from grpo_cli.algorithm.schedules import LR_SCHEDULES
from grpo_cli.config import TrainerConfig

if TYPE_CHECKING:
    import torch


def param_groups(model: torch.nn.Module, lr: float, norm_lr_scale: float) -> list[dict[str, Any]]:
    """AdamW groups of the trainable parameters: normalization gains (1-D weights named *norm*) at
    `lr * norm_lr_scale`, the rest at `lr`.

    Why: Adam moves every weight by about lr a step, whatever its gradient's size. A
    norm gain of ~1 that has to change by ~50% (e.g. to sharpen the output distribution,
    as the final norm sets the logits' scale) then needs thousands of steps at a learning
    rate that is safe for the matrices.
    """
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]  # with LoRA: the adapters
    if norm_lr_scale == 1.0:
        return [{"params": [p for _, p in trainable], "lr": lr}]  # one group: trainer states stay as before
    norms, rest = [], []
    for name, param in trainable:
        (norms if param.ndim == 1 and "norm" in name.lower() else rest).append(param)
    groups = [{"params": rest, "lr": lr}, {"params": norms, "lr": lr * norm_lr_scale}]
    return [group for group in groups if group["params"]]  # LoRA trains no norm


def build_optimizer(model: torch.nn.Module, cfg: TrainerConfig, schedule_steps: int | None = None
                    ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over `param_groups` and its schedule: warm-up, then `cfg.lr_schedule` to `schedule_steps`
    training steps (the run's original trainer.steps; None = `cfg.steps`, a new run).

    `cfg` is the run's `config.TrainerConfig` (imported for annotations only: config imports this module). The
    schedule counts optimizer steps: `ppo_epochs x minibatches` of them per training step.
    """
    import torch

    optimizer = torch.optim.AdamW(param_groups(model, cfg.lr, cfg.norm_lr_scale), lr=cfg.lr,
                                  betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)
    schedule = LR_SCHEDULES[cfg.lr_schedule]
    total = (schedule_steps or cfg.steps) * cfg.ppo_epochs * cfg.minibatches  # optimizer steps the schedule spans
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: schedule(s, cfg.warmup_steps, total))
    return optimizer, scheduler


def move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device | str) -> None:
    """AdamW's moment buffers to `device` (host memory while vLLM generates, back for the update);
    the step counters stay where they are. A no-op when they are there already."""
    for state in optimizer.state.values():
        for key, value in state.items():
            if key != "step" and hasattr(value, "to"):
                state[key] = value.to(device, non_blocking=True)
