"""Where a model lives and whether its weights are whole: `builtin:NAME` (shipped inside the package), a local
directory, or a hub id. Standard library only (and the project's errors), so that the rewards (a reward model, a judge) and `grpo check`
read it without the rest of the checkpoint code.
"""

from __future__ import annotations

import json
from pathlib import Path

from grpo_cli import hub
from grpo_cli.errors import UsageError

BUILTIN_PREFIX = "builtin:"
MODELS_DIR = Path(__file__).resolve().parents[1] / "models"  # models shipped inside the package (grpo_cli/models)


def resolve_model_path(name_or_path: str) -> str:
    """`builtin:NAME` -> the shipped model's directory; a local directory as is; else a hub id."""
    if name_or_path.startswith(BUILTIN_PREFIX):
        name = name_or_path[len(BUILTIN_PREFIX):]
        path = MODELS_DIR / name
        if not (path / "config.json").is_file():
            shipped = sorted(p.name for p in MODELS_DIR.glob("*") if (p / "config.json").is_file())
            raise FileNotFoundError(f"no built-in model '{name}'; shipped: {', '.join(shipped) or 'none'}")
        return str(path)
    path = Path(name_or_path).expanduser()
    looks_local = path.exists() or name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") != 1
    if looks_local and not (path / "config.json").is_file():
        what = "does not exist" if not path.exists() else "has no config.json"
        raise FileNotFoundError(f"model '{name_or_path}' {what}: expected a Hugging Face model directory "
                                "(config.json + *.safetensors + tokenizer), a hub id owner/name, or builtin:NAME")
    if looks_local and not any(path.glob("*.safetensors")):
        raise FileNotFoundError(f"model '{name_or_path}' has no *.safetensors weights (pickled .bin weights are "
                                "not loaded, for safety); convert it with save_pretrained(safe_serialization=True)")
    return name_or_path


def safetensors_damage(path: Path) -> str | None:
    """Why a .safetensors file is not a whole one (truncated, not safetensors at all), or None.
    Reads only the header: 8 bytes of length, a JSON table of tensors and their byte ranges."""
    size = path.stat().st_size
    if size < 8:
        return f"{size} bytes, shorter than a safetensors header"
    with path.open("rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        if not 2 <= header_len <= size - 8:
            return "its header runs past the end of the file, so it is cut short or not safetensors"
        try:
            header = json.loads(f.read(header_len))
        except (ValueError, UnicodeDecodeError):
            return "its header is not valid JSON, so it is not safetensors"
    ranges = [t.get("data_offsets") for k, t in header.items() if k != "__metadata__" and isinstance(t, dict)]
    needed = 8 + header_len + max((r[1] for r in ranges if isinstance(r, list) and len(r) == 2), default=0)
    if needed > size:
        return f"{size:,} bytes where its header describes {needed:,}: cut short (an interrupted copy or download?)"
    return None


def damaged_weights(model_dir: str) -> str | None:
    """"'FILE' is corrupted or truncated (why)" for the first bad *.safetensors in a local model directory,
    else None. (`grpo eval` tells the same from safetensors' own reader when it opens a checkpoint.)"""
    path = Path(model_dir)
    if not path.is_dir():
        return None  # a hub id: transformers and vLLM check what they download
    for file in sorted(path.glob("*.safetensors")):
        if reason := safetensors_damage(file):
            return f"'{file}' is corrupted or truncated ({reason}); copy or save the model again"
    return None


def checked_model_path(key: str, name_or_path: str) -> str:
    """A model's directory (or hub id) from the recipe's `key`, its files there and undamaged; else a UsageError
    naming the key."""
    try:
        path = resolve_model_path(name_or_path)
    except FileNotFoundError as e:
        raise UsageError(f"{key}: {e}") from None
    if damage := damaged_weights(path):
        raise UsageError(f"{key}: {damage}")
    if not Path(path).is_dir():
        hub.settle()  # a hub id: an unreachable hub means the cache only, before any library tries it
    return path


def is_vision_language(config: object) -> bool:
    """Whether a model (by its transformers config) takes images: a vision tower beside its text model (Idefics3,
    SmolVLM and their kin). Such a model loads as AutoModelForImageTextToText, with its processor."""
    return getattr(config, "vision_config", None) is not None


# The parts of a vision-language model that see the pixels, by parameter name (transformers' names): the vision
# tower and what carries its output into the text model. model.freeze_vision keeps them as loaded.
VISION_PARTS = ("vision_model.", "vision_tower.", "connector.", "multi_modal_projector.")


def is_vision_part(name: str) -> bool:
    """Whether a parameter (by name) belongs to a model's vision tower or connector."""
    return any(part in name for part in VISION_PARTS)
