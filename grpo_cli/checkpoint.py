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
from typing import Any

BUILTIN_PREFIX = "builtin:"
MODELS_DIR = Path(__file__).resolve().parent / "models"  # models shipped inside the package
COMPLETE_MARKER = "checkpoint.json"  # written last; its presence marks a complete checkpoint


def resolve_model_path(name_or_path: str) -> str:
    """`builtin:NAME` -> the shipped model's directory; a local directory as is; else a hub id."""
    if name_or_path.startswith(BUILTIN_PREFIX):
        name = name_or_path[len(BUILTIN_PREFIX):]
        path = MODELS_DIR / name
        if not (path / "config.json").is_file():
            shipped = sorted(p.name for p in MODELS_DIR.glob("*") if (p / "config.json").is_file())
            raise FileNotFoundError(f"no built-in model '{name}'; shipped: {', '.join(shipped) or 'none'}")
        return str(path)
    return name_or_path


def torch_dtype(name: str) -> Any:
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_policy(path: str, dtype: str) -> Any:
    """A causal LM from safetensors only (use_safetensors refuses pickled .bin weights)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype(dtype), use_safetensors=True)


def save_checkpoint(model: Any, tokenizer: Any, path: Path, info: dict[str, Any]) -> Path:
    """Write model (safetensors) + tokenizer + config to `path` atomically; returns `path`.

    The files go to `path.tmp-PID` first; the marker file is written last, then the
    directory is renamed into place. A crash mid-save leaves at most a `.tmp-*`
    directory that loaders ignore, and any older checkpoint untouched.
    """
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    with open(tmp / COMPLETE_MARKER, "w") as f:
        json.dump(info, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    if path.exists():
        old = path.with_name(f"{path.name}.old-{os.getpid()}")
        path.rename(old)
        tmp.rename(path)
        shutil.rmtree(old)
    else:
        tmp.rename(path)
    return path


def is_complete_checkpoint(path: Path) -> bool:
    path = Path(path)
    return (path / COMPLETE_MARKER).is_file() and (path / "config.json").is_file() and any(path.glob("*.safetensors"))
