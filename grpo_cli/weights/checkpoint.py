"""Model files: where a model lives, loading it, and writing Hugging Face checkpoints.

Weights are read and written only as safetensors (no pickle). A checkpoint is
written into a temporary sibling directory and renamed into place, so a
checkpoint directory is either complete or absent.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpo_cli.config import TrainConfig
from grpo_cli.dist import Dist
from grpo_cli.errors import UsageError
from grpo_cli.weights.model_files import (  # noqa: F401  where a model lives, also reachable from here
    BUILTIN_PREFIX,
    MODELS_DIR,
    damaged_weights,
    is_vision_language,
    resolve_model_path,
    safetensors_damage,
)

if TYPE_CHECKING:
    import torch

    from grpo_cli.prompts.pool import PromptPool


COMPLETE_MARKER = "checkpoint.json"  # written last; its presence marks a complete checkpoint
# The layout of a resumable checkpoint (checkpoint.json, trainer_state.pt, optimizer/). A resume reads only
# this version; a change to what those files hold raises it (see CHANGELOG.md).
FORMAT_VERSION = 1


def torch_dtype(name: str) -> torch.dtype:
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_policy(path: str, dtype: str) -> torch.nn.Module:
    """A causal LM (or a vision-language model: `is_vision_language`) from safetensors only (use_safetensors
    refuses pickled .bin weights)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    auto = AutoModelForImageTextToText if is_vision_language(AutoConfig.from_pretrained(path)) else AutoModelForCausalLM
    return auto.from_pretrained(path, dtype=torch_dtype(dtype), use_safetensors=True)


def load_processor(path: str) -> Any:
    """A vision-language model's processor (its image processor and tokenizer), from the model's files."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(path)
    if processor.tokenizer.pad_token_id is None:
        processor.tokenizer.pad_token = processor.tokenizer.eos_token
    return processor


EMBED_SUFFIXES = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight")  # input embeddings a tied lm_head reuses


def checkpoint_weights(path: Path | str) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint, in checkpoint format, from safetensors only (never pickle).

    A model with tied embeddings stores no `lm_head.weight`; it is added as the embedding,
    because the engine's layer-wise reload silently leaves a model half-updated when a key
    is missing (see VLLMEngine.push_weights).
    """
    from safetensors.torch import load_file

    path = Path(path)

    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(path.glob("*.safetensors")):
        try:
            tensors.update(load_file(str(shard)))
        except Exception as e:
            raise UsageError(f"'{shard}' is corrupted or truncated (safetensors: {' '.join(str(e).split())})") from None
    if "lm_head.weight" not in tensors:
        embed = next((key for key in tensors if key.endswith(EMBED_SUFFIXES)), None)
        if embed is None:
            raise UsageError(f"'{path}' has neither lm_head.weight nor an input embedding to tie it to")
        tensors["lm_head.weight"] = tensors[embed]
    return tensors


TRAINER_STATE = "trainer_state.pt"  # LR schedule, data order, RNG states, AdamW's groups (tensors and plain types)
OPTIMIZER_DIR = "optimizer"  # AdamW's moments by parameter name, in torch.distributed.checkpoint's format
STEP_PREFIX = "step_"  # periodic checkpoints are checkpoints/step_000010, ...


# A LoRA checkpoint: peft's adapter files (docs/lora.md), beside the tokenizer and checkpoint.json
ADAPTER_CONFIG = "adapter_config.json"  # peft's files: what PeftModel.from_pretrained and vLLM's LoRA loader read
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def is_adapter_dir(path: str | Path) -> bool:
    """Whether a directory holds a peft adapter (a LoRA checkpoint) rather than a whole model."""
    return (Path(path) / ADAPTER_CONFIG).is_file()


def adapter_base(path: str | Path) -> str | None:
    """The base model an adapter directory was trained on (its adapter_config.json), or None."""
    try:
        return json.loads((Path(path) / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    except (OSError, ValueError):
        return None


def adapter_rank(path: str | Path) -> int:
    """The rank r of the adapter saved in `path`."""
    return int(json.loads((Path(path) / ADAPTER_CONFIG).read_text())["r"])


def save_checkpoint(model: torch.nn.Module, tokenizer: Any, path: Path, info: dict[str, Any],
                    trainer_state: dict[str, Any] | None = None, optimizer: torch.optim.Optimizer | None = None,
                    dist: Dist | None = None) -> Path:
    """Write model (safetensors) + tokenizer + config to `path` atomically; returns `path`. A LoRA policy
    writes its adapters in peft's format (adapter_model.safetensors, adapter_config.json), not the base.

    The files go to `path.tmp-PID` first; the marker file is written last, then the
    directory is renamed into place. A crash mid-save leaves at most a `.tmp-*`
    directory that loaders ignore, and any older checkpoint untouched.

    With `trainer_state`, `optimizer`'s moments go to OPTIMIZER_DIR with torch.distributed.checkpoint
    (each rank writes its shards; a run resumes from them at any world size). At world size > 1
    every rank calls this: the weights are gathered one tensor at a time and rank 0 writes them,
    the Hugging Face files and the marker.
    """
    # here, not at the top: dist.shard imports torch, and this module's file checks are on the torch-free path of
    # grpo check and the run directory look-ups
    from grpo_cli.dist.shard import full_tensors, unwrap

    world, main = (dist.world_size, dist.is_main) if dist is not None else (1, True)
    path = Path(path)
    pid = dist.broadcast(os.getpid()) if world > 1 else os.getpid()  # one directory name for every rank
    tmp = path.with_name(f"{path.name}.tmp-{pid}")
    if main:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    if world > 1:
        dist.barrier()
        tied = tied_duplicates(unwrap(model))  # lm_head.weight when tied: written once, as save_pretrained does
        peft = hasattr(unwrap(model), "peft_config")  # a LoRA policy (lora.is_adapter_model): its adapters alone
        names = [name for name, _ in _named_params(model)] if peft else None
        weights = {name: tensor.cpu() for name, tensor in full_tensors(model, names) if main and name not in tied}
        if main:
            unwrap(model).save_pretrained(tmp, state_dict=weights, safe_serialization=True)
        del weights
    else:
        model.save_pretrained(tmp, safe_serialization=True)
    if trainer_state is not None and optimizer is not None:
        save_optimizer(optimizer, model, tmp / OPTIMIZER_DIR)
    if main:
        tokenizer.save_pretrained(tmp)
        if trainer_state is not None:
            import torch

            torch.save(trainer_state, tmp / TRAINER_STATE)
        with open(tmp / COMPLETE_MARKER, "w") as f:
            json.dump(info, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        if path.exists():
            old = path.with_name(f"{path.name}.old-{pid}")
            path.rename(old)
            tmp.rename(path)
            shutil.rmtree(old)
        else:
            tmp.rename(path)
    if world > 1:
        dist.barrier()  # no rank reads or prunes checkpoints before this one is in place
    return path


def tied_duplicates(model: torch.nn.Module) -> set[str]:
    """state_dict names that repeat an earlier entry's tensor (a tied lm_head)."""
    seen, repeats = set(), set()
    for name, tensor in model.state_dict(keep_vars=True).items():  # the parameters themselves: tied ones repeat
        if id(tensor) in seen:
            repeats.add(name)
        seen.add(id(tensor))
    return repeats


def _named_params(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The trainable parameters by their Hugging Face name (the same at any world size); with LoRA the adapters."""
    # here, not at the top: dist.shard imports torch, and this module's file checks are on the torch-free path of
    # grpo check and the run directory look-ups
    from grpo_cli.dist.shard import unwrap

    return [(name, p) for name, p in unwrap(model).named_parameters() if p.requires_grad]


def save_optimizer(optimizer: torch.optim.Optimizer, model: torch.nn.Module, path: Path) -> None:
    """AdamW's per-parameter state (moments, step) keyed by parameter name, with torch.distributed.checkpoint:
    sharded tensors as each rank holds them; DCP reshards them on load for another world size."""
    import warnings

    import torch.distributed.checkpoint as dcp

    state = {"state": {name: dict(optimizer.state[p]) for name, p in _named_params(model) if p in optimizer.state}}
    with warnings.catch_warnings():  # one process without a process group: DCP says so in a warning
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(path))


def load_optimizer(optimizer: torch.optim.Optimizer, model: torch.nn.Module, path: Path,
                   param_groups: list[dict[str, Any]]) -> None:
    """The inverse of `save_optimizer`, into this run's (possibly differently sharded) parameters."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    saved = set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    named = _named_params(model)
    template: dict[str, dict[str, Any]] = {}
    for name, p in named:
        keys = [k[len(f"state.{name}."):] for k in saved if k.startswith(f"state.{name}.")
                and "." not in k[len(f"state.{name}."):]]
        if keys:  # a moment has the parameter's shape (and sharding); `step` is a scalar
            template[name] = {k: torch.zeros(()) if k == "step" else torch.zeros_like(p) for k in keys}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load({"state": template}, checkpoint_id=str(path))
    position = {id(p): i for i, p in enumerate(p for group in optimizer.param_groups for p in group["params"])}
    index = {name: position[id(p)] for name, p in named}  # state_dict numbers parameters in group order
    optimizer.load_state_dict({"state": {index[name]: value for name, value in template.items()},
                               "param_groups": param_groups})


def checkpoint_info(step: int, cfg: TrainConfig, base_model: str, pass_at_1: float | None, world_size: int) -> dict[str, Any]:
    """A checkpoint's checkpoint.json: its step, the run's task, base model and resolved config (a resume is
    refused when its config differs), the held-out pass@1 of its step (None when not measured), and the
    number of processes that wrote it."""
    import dataclasses

    return {"format_version": FORMAT_VERSION, "step": step, "task": cfg.task, "base_model": base_model,
            "config": dataclasses.asdict(cfg), "eval/pass@1": pass_at_1, "world_size": world_size}


def trainer_state(optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler, pool: PromptPool,
                  best_pass: float, schedule_steps: int) -> dict[str, Any]:
    """Everything besides the weights and AdamW's moments (OPTIMIZER_DIR) that an exact resume needs:
    AdamW's groups (lr, betas, ...), the lr schedule and the training steps it spans, prompt order and
    position and the prompt pool's record, the best held-out pass@1 so far, and the RNG states (tensors and plain types)."""
    import random

    import torch

    return {"optimizer_param_groups": optimizer.state_dict()["param_groups"], "scheduler": scheduler.state_dict(),
            "schedule_steps": schedule_steps,
            **pool.state_dict(), "best_pass": best_pass, "python_rng": random.getstate(),
            "torch_rng": torch.get_rng_state()}


def restore_trainer_state(state: dict[str, Any], optimizer: torch.optim.Optimizer,
                          scheduler: torch.optim.lr_scheduler.LRScheduler, pool: PromptPool,
                          path: Path | None = None, model: torch.nn.Module | None = None) -> float:
    """Put a `trainer_state` (and the checkpoint's OPTIMIZER_DIR) back in place; returns the best
    held-out pass@1 it had."""
    import random

    import torch

    if path is not None and (Path(path) / OPTIMIZER_DIR).is_dir():
        load_optimizer(optimizer, model, Path(path) / OPTIMIZER_DIR, state["optimizer_param_groups"])
    else:  # fresh moments would make the resumed run a different one

        raise UsageError(f"resume: {path} has no optimizer state ({OPTIMIZER_DIR}/ is missing); copy the whole "
                         "checkpoint directory")
    scheduler.load_state_dict(state["scheduler"])
    pool.load_state_dict(state)
    random.setstate(state["python_rng"])
    torch.set_rng_state(state["torch_rng"])
    return state["best_pass"]


def load_trainer_state(path: Path) -> dict[str, Any]:
    """The trainer state of a checkpoint; weights_only=True: tensors and plain types, never arbitrary pickle."""
    import torch

    return torch.load(Path(path) / TRAINER_STATE, weights_only=True)


def read_info(path: Path) -> dict[str, Any] | None:
    """A checkpoint's checkpoint.json, or None when it is missing or not a JSON object."""
    try:
        info = json.loads((Path(path) / COMPLETE_MARKER).read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None
