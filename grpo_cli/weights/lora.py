"""LoRA (docs/lora.md): the policy as frozen base weights plus trainable low-rank adapters (peft), the
reference as the same module with its adapters off, and the adapters' tensors in peft's format for the
engine and the checkpoints.

    policy = with_adapters(load_policy(base, dtype), cfg.model.lora, base)  # a peft model; only adapters train
    with adapters_off(policy):                                              # the base model: the KL's reference
        ref = batch_logprobs(policy, ...)
    engine.push_adapter(adapter_tensors(policy), adapter_config(policy))    # vLLM serves base + adapter

Every function takes the policy as the loop holds it: a peft model, or one inside its FSDP2 root.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpo_cli.config import LoraConfig
from grpo_cli.dist.shard import full_parameters, full_tensors, unwrap
from grpo_cli.errors import UsageError
from grpo_cli.weights.checkpoint import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    adapter_base,
    checkpoint_weights,
    is_adapter_dir,
    load_tokenizer,
    read_info,
    resolve_model_path,
)

if TYPE_CHECKING:
    import torch


def is_adapter_model(model: torch.nn.Module) -> bool:
    """Whether the loop's policy carries LoRA adapters: a peft model (it holds its peft_config), maybe inside its
    FSDP2 root. Asked at every push, so a run without LoRA never imports peft."""
    return hasattr(unwrap(model), "peft_config")


def check_targets(lora: LoraConfig, model_config: Any) -> None:
    """Every name in model.lora.target_modules matches a module of a model of this transformers config (built on
    the meta device: shapes only, no weights; peft matches a name against the last part of a module's path).
    Raises UsageError naming the key, the names that match nothing and the decoder layers' linear layers."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config)
    leaves = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = [t for t in lora.target_modules if t not in leaves]
    if missing:
        linear = sorted({name.rsplit(".", 1)[-1] for name, m in model.get_decoder().layers.named_modules()
                         if isinstance(m, torch.nn.Linear)})
        raise UsageError(f"model.lora.target_modules: {', '.join(missing)} match no module of "
                         f"{type(model).__name__}; its layers' linear modules are {', '.join(linear)}")


def peft_config(lora: LoraConfig, base_model: str) -> Any:
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                          target_modules=list(lora.target_modules), bias="none", task_type="CAUSAL_LM",
                          base_model_name_or_path=base_model)


def with_adapters(model: torch.nn.Module, lora: LoraConfig, base_model: str,
                  adapter_dir: str | Path | None = None) -> torch.nn.Module:
    """`model` (the base, loaded) with LoRA adapters, trainable, every other weight frozen: fresh ones (peft's
    init: B = 0, so the policy starts as the base model exactly) or those saved in `adapter_dir` (a resume)."""
    from peft import PeftModel, get_peft_model

    if adapter_dir is not None:
        return PeftModel.from_pretrained(model, str(adapter_dir), is_trainable=True)
    return get_peft_model(model, peft_config(lora, base_model))


@contextlib.contextmanager
def adapters_off(model: torch.nn.Module) -> Iterator[None]:
    """The base model for the block: every adapter of the policy off (the KL's frozen reference, with no
    second copy of the weights)."""
    with unwrap(model).disable_adapter():
        yield


def adapter_names(model: torch.nn.Module) -> list[str]:
    """The adapters' parameter names (the trainable ones) as the loop's state_dict names them."""
    return [name for name, p in unwrap(model).named_parameters() if p.requires_grad]


def adapter_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' full tensors by peft's file names (`...q_proj.lora_A.weight`: the adapter's name dropped, as
    peft saves them): gathered from the ranks when sharded (every rank calls this)."""
    return {name.replace(".default.", "."): t.detach().contiguous()
            for name, t in full_parameters(model, adapter_names(model))}


def adapter_config(model: torch.nn.Module) -> dict[str, Any]:
    """The adapter's adapter_config.json, as a dict."""
    return unwrap(model).peft_config["default"].to_dict()


def write_adapter(tensors: dict[str, torch.Tensor], config: dict[str, Any], directory: str | Path) -> Path:
    """peft's two files in `directory`: what vLLM's LoRA loader and PeftModel.from_pretrained read."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.to("cpu") for k, v in tensors.items()}, str(directory / ADAPTER_WEIGHTS))
    serializable = {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}
    (directory / ADAPTER_CONFIG).write_text(json.dumps(serializable, indent=2, default=str))
    return directory


def merged_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every checkpoint-format tensor of the base model with the adapters merged in (W + alpha/r * B @ A on each
    adapted linear layer), one at a time: the push for an engine that cannot take adapters. Every rank must
    iterate (the tensors are gathered when sharded), in the same order."""
    from peft.tuners.lora import LoraLayer

    peft_model = unwrap(model)
    adapters = dict(full_parameters(model, adapter_names(model)))  # small: gathered up front
    scale = {name: module.scaling["default"] for name, module in peft_model.named_modules() if isinstance(module, LoraLayer)}
    prefix = "base_model.model."
    for name, tensor in full_tensors(model):
        if ".lora_" in name:
            continue
        if ".base_layer." in name and name.endswith(".weight"):
            module = name[: -len(".base_layer.weight")]
            a, b = adapters[f"{module}.lora_A.default.weight"], adapters[f"{module}.lora_B.default.weight"]
            tensor = tensor + (b.float() @ a.float() * scale[module]).to(tensor.dtype)  # [out, in]
        yield name.removeprefix(prefix).replace(".base_layer.", "."), tensor


def summary(model: torch.nn.Module, lora: LoraConfig) -> str:
    """One line: the adapters, what trains, and the reference."""
    params = list(unwrap(model).parameters())
    trainable = sum(p.numel() for p in params if p.requires_grad)  # a sharded parameter's numel() is the whole one's
    total = sum(p.numel() for p in params)
    return (f"LoRA rank {lora.rank} (alpha {lora.alpha:g}) on {', '.join(lora.target_modules)}: {trainable:,} of "
            f"{total:,} parameters train ({100 * trainable / total:.1f}%); the reference is the base (adapters off)")


def merged_checkpoint_tensors(base_dir: str | Path, adapter_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """A base model's checkpoint-format tensors with a saved adapter merged in (W + alpha/r * B @ A), from the
    two directories' files alone (no model is built): for an engine that serves no LoRA, and `grpo merge`."""
    from safetensors.torch import load_file

    config = json.loads((Path(adapter_dir) / ADAPTER_CONFIG).read_text())
    r, alpha = config["r"], config["lora_alpha"]
    scale = alpha / (r ** 0.5) if config.get("use_rslora") else alpha / r
    adapter = load_file(str(Path(adapter_dir) / ADAPTER_WEIGHTS))
    prefix = "base_model.model."
    pairs = {}
    for name in adapter:
        if name.endswith(".lora_A.weight"):
            module = name[len(prefix):-len(".lora_A.weight")]
            pairs[f"{module}.weight"] = (adapter[name], adapter[name.replace(".lora_A.", ".lora_B.")])
    for name, tensor in checkpoint_weights(base_dir).items():
        if name in pairs:
            a, b = pairs[name]
            tensor = tensor + (b.float() @ a.float() * scale).to(tensor.dtype)  # [out, in]
        yield name, tensor


def run_merge(config: Any, run_dir: Path | None = None) -> int:
    """`grpo merge checkpoint=RUN_DIR/checkpoints/final out=DIR`: the base model's config, the merged weights
    and the checkpoint's tokenizer, written to a temporary sibling of `out` and renamed into place."""
    import shutil

    from safetensors.torch import save_file

    path, out = Path(config.checkpoint), Path(config.out)
    if not path.is_dir():
        raise UsageError(f"checkpoint '{path}' " + ("does not exist" if not path.exists() else "is not a directory"))
    if not is_adapter_dir(path):
        raise UsageError(f"checkpoint '{path}' holds no {ADAPTER_CONFIG}: not a LoRA checkpoint (a whole model "
                         "needs no merge)")
    if not (path / ADAPTER_WEIGHTS).is_file():
        raise UsageError(f"checkpoint '{path}' has {ADAPTER_CONFIG} but no {ADAPTER_WEIGHTS}")
    if out.exists():
        raise UsageError(f"out={out} exists; give a new directory")
    base = config.base or (read_info(path) or {}).get("base_model") or adapter_base(path)
    if not base:
        raise UsageError(f"checkpoint '{path}' names no base model (no checkpoint.json); pass base=MODEL_DIR")
    try:
        base = resolve_model_path(base)
    except FileNotFoundError as e:
        raise UsageError(f"base: {e}") from None
    if not Path(base).is_dir():
        raise UsageError(f"base: '{base}' is not a local model directory; pass base=MODEL_DIR")
    model_config = json.loads((Path(base) / "config.json").read_text())
    tied = model_config.get("tie_word_embeddings", False)
    tensors = {name: t.contiguous() for name, t in merged_checkpoint_tensors(base, path)
               if not (tied and name == "lm_head.weight")}  # tied: the embedding is the head, stored once
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    for name in ("config.json", "generation_config.json"):
        if (Path(base) / name).is_file():
            shutil.copy(Path(base) / name, tmp / name)
    load_tokenizer(str(path) if (path / "tokenizer_config.json").is_file() else base).save_pretrained(tmp)
    tmp.rename(out)
    print(f"wrote {out}: {path} merged into {base} ({sum(t.numel() for t in tensors.values()):,} parameters)")
    return 0
