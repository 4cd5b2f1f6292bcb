"""Where recipes are found (a folder list, or a path on the command line), and reading one for a schema."""

from __future__ import annotations

import dataclasses
import os
import typing
from pathlib import Path
from typing import Any

from grpo_cli.config import TrainConfig
from grpo_cli.errors import UsageError

RECIPE_PATH_ENV = "GRPO_RECIPE_PATH"  # extra recipe directories, separated like PATH

def recipe_dirs() -> list[Path]:
    """Where recipes are looked up, first match wins: $GRPO_RECIPE_PATH, the checkout, the wheel."""
    dirs = [Path(p) for p in os.environ.get(RECIPE_PATH_ENV, "").split(os.pathsep) if p]
    package_dir = Path(__file__).resolve().parents[1]  # grpo_cli/
    dirs.append(package_dir.parent / "recipes")  # a source checkout (editable install)
    dirs.append(package_dir / "recipes")  # an installed wheel ships them inside the package
    return [d for d in dirs if d.is_dir()]

RECIPE_FILES: dict[str, Path] = {}  # recipes named by path on this command line (recipe=./mine.yaml), by stem

BROKEN_RECIPES: dict[str, str] = {}  # recipe name -> why it cannot be read: only a command naming it fails

def available_recipes() -> dict[str, Path]:
    found: dict[str, Path] = dict(RECIPE_FILES)
    for d in recipe_dirs():
        for path in sorted(d.glob("*.yaml")):
            found.setdefault(path.stem, path)
    return found

def is_recipe_path(value: str) -> bool:
    return "/" in value or value.endswith((".yaml", ".yml"))

def recipe_paths_to_names(rest: list[str]) -> list[str]:
    """`recipe=PATH.yaml` (relative to the working directory, or absolute) -> `recipe=STEM`, the file registered
    under its stem ahead of every recipe folder; other arguments as they are. A file that does not exist: one
    line. (Hydra's grammar has no paths in a config group's value.)"""
    out = []
    for arg in rest:
        key, _, value = arg.partition("=")
        if key.lstrip("+~") == "recipe" and value and "," not in value and is_recipe_path(value):
            path = Path(value).expanduser().resolve()
            if not path.is_file():
                raise UsageError(f"recipe file '{value}' not found (from {Path.cwd()})")
            RECIPE_FILES[path.name.rsplit(".", 1)[0]] = path
            arg = f"{key}={path.name.rsplit('.', 1)[0]}"
        out.append(arg)
    return out

def recipe_node(path: Path, schema: type) -> Any:
    """A recipe or a run's saved config, loaded for `schema`.

    A section of `grpo train`'s config that the command's schema redeclares as a
    plain value is dropped: eval's `checkpoint=PATH` is not train's `checkpoint:` section.
    """
    from omegaconf import DictConfig, OmegaConf


    try:
        node = OmegaConf.load(path)
    except Exception as e:
        raise UsageError(f"cannot read '{path}': {' '.join(str(e).split())}") from None
    if isinstance(node, DictConfig) and schema is not TrainConfig:
        hints, train_hints = typing.get_type_hints(schema), typing.get_type_hints(TrainConfig)
        for key in [k for k in node if dataclasses.is_dataclass(train_hints.get(k))
                    and not dataclasses.is_dataclass(hints.get(k))]:
            node.pop(key)
    return node
