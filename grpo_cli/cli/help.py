"""`grpo --help` and `grpo COMMAND --help`: the commands, the recipes, every key with its default and comment."""

from __future__ import annotations

import dataclasses
import os
import typing
from typing import Any

from grpo_cli import __version__
from grpo_cli.cli.commands import COMMANDS
from grpo_cli.cli.recipes import RECIPE_PATH_ENV, available_recipes


def field_comments(cls: type) -> dict[str, str]:
    """{field: its comment} read off a config dataclass's source: the schema documents itself, a comment a field."""
    import inspect
    import re

    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}
    found = {}
    for line in source.splitlines():
        if (m := re.match(r"^    (\w+): [^#]*?(?:#\s*(.*))?$", line)) and m.group(2):
            found[m.group(1)] = m.group(2).strip()
    return found

def schema_help(schema: type, prefix: str = "") -> list[str]:
    """Every key of a config schema as `key=default  # its comment`, a list's items (rewards, rollout.tools) by
    their own fields as `key[i].field`: what `grpo COMMAND --help` shows under the composed config."""
    import json

    def shown(value: Any) -> str:
        return "???" if value is dataclasses.MISSING else value if isinstance(value, str) else json.dumps(value)

    lines, comments, hints = [], field_comments(schema), typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        key, note = f"{prefix}{f.name}", f"  # {comments[f.name]}" if f.name in comments else ""
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        item = (typing.get_args(hints[f.name]) or [None])[0] if typing.get_origin(hints[f.name]) is list else None
        if dataclasses.is_dataclass(default):
            lines += schema_help(type(default), key + ".")
        elif dataclasses.is_dataclass(item):
            lines += [f"{key}: a list, each item with the keys below{note}", *schema_help(item, f"{key}[i].")]
        else:
            lines.append(f"{key}={shown(default)}{note}")
    return lines

def help_template(schema: type) -> str:
    """Hydra's help page: the composed config (a recipe's values), then every key with its default and comment.
    (Hydra reads the template through OmegaConf and string.Template: `$` and `${` are escaped.)"""
    keys = "\n".join(schema_help(schema)).replace("$", "$$").replace("${", "\\${")
    return ("${hydra.help.header}\n== Configuration groups ==\n$APP_CONFIG_GROUPS\n\n== Config ==\n"
            "The config this command line composes (override any key with key=value):\n\n$CONFIG\n"
            "== Every key ==\nIts default and what it does; a list's items take the keys shown under it:\n\n"
            f"{keys}\n\n${{hydra.help.footer}}")

def print_help() -> None:
    lines = [
        f"grpo {__version__}: train language models to reason with GRPO.",
        "",
        "usage: grpo COMMAND recipe=NAME [key=value ...] [hydra flags]",
        "",
        "commands:",
    ]
    for name, cmd in COMMANDS.items():
        lines.append(f"  {name:<8} {cmd.summary}")
    recipes = available_recipes()
    lines += ["", "recipes:"] + [f"  {name:<20} {path}" for name, path in recipes.items()]
    lines += [
        "",
        "examples:",
        "  grpo train recipe=bike_pricing",
        "  grpo train recipe=bike_pricing rollout.group_size=16 trainer.lr=1e-4",
        "  grpo train recipe=bike_pricing --cfg job          # print the resolved config, run nothing",
        "  grpo train -m recipe=bike_pricing trainer.kl_coef=0,0.02   # a sweep",
        "  grpo eval checkpoints=[base,RUN_DIR/checkpoints/final]     # compare a run's start and end",
        "  grpo COMMAND --help                              # Hydra's help for one command",
        '  eval "$(grpo -sc install=bash)"                  # tab completion',
        "",
        f"recipes are looked up in ${RECIPE_PATH_ENV} (dirs separated by '{os.pathsep}'), then the package.",
    ]
    print("\n".join(lines))
