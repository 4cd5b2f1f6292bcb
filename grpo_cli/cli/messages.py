"""A mistake as one line: unknown keys with a did-you-mean (peers' names for ours too), list items, Hydra's and
OmegaConf's errors, and the composed config validated into the schema's dataclasses."""

from __future__ import annotations

import dataclasses
import difflib
import sys
import types
import typing
from pathlib import Path
from typing import Any, NoReturn

from grpo_cli.cli.commands import COMMANDS
from grpo_cli.config import COMMAND_SCHEMAS, ConfigError
from grpo_cli.errors import UsageError


def fail(command: str, message: str, code: int = 2) -> NoReturn:
    print(f"grpo {command}: error: {message}", file=sys.stderr)
    sys.exit(code)

def item_schemas(schema: type) -> list[type]:
    """The dataclasses of list items anywhere in a config schema (RewardSpec, ToolSpec, ...)."""
    found: list[type] = []
    for f in dataclasses.fields(schema):
        kind = typing.get_type_hints(schema)[f.name]
        args = typing.get_args(kind) if typing.get_origin(kind) is list else ()
        if args and dataclasses.is_dataclass(args[0]):
            found.append(args[0])
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            found += item_schemas(type(default))
    return found

def schema_keys(schema: type, prefix: str = "") -> list[str]:
    """Every dotted key of a config dataclass, for did-you-mean hints."""
    keys = []
    for f in dataclasses.fields(schema):
        key = f"{prefix}{f.name}"
        keys.append(key)
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            keys.extend(schema_keys(type(default), key + "."))
    return keys

def did_you_mean(word: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""

# The names TRL's GRPOTrainer and verl use for our keys (docs/from_trl_and_verl.md): a newcomer's key that is one
# of these is pointed at ours. Matched on the whole key, then on its last part.
PEER_NAMES: dict[str, tuple[str, str]] = {
    "num_generations": ("rollout.group_size", "TRL's num_generations"),
    "rollout.n": ("rollout.group_size", "verl's actor_rollout_ref.rollout.n"),
    "n": ("rollout.group_size", "verl's rollout.n"),
    "beta": ("trainer.kl_coef", "TRL's beta"),
    "kl_loss_coef": ("trainer.kl_coef", "verl's kl_loss_coef"),
    "epsilon": ("trainer.clip_eps", "TRL's epsilon"),
    "epsilon_high": ("trainer.clip_eps_high", "TRL's epsilon_high"),
    "clip_ratio": ("trainer.clip_eps", "verl's clip_ratio"),
    "clip_ratio_low": ("trainer.clip_eps", "verl's clip_ratio_low"),
    "clip_ratio_high": ("trainer.clip_eps_high", "verl's clip_ratio_high"),
    "max_completion_length": ("rollout.max_new_tokens", "TRL's max_completion_length"),
    "response_length": ("rollout.max_new_tokens", "verl's rollout.response_length"),
    "max_response_length": ("rollout.max_new_tokens", "verl's data.max_response_length"),
    "learning_rate": ("trainer.lr", "TRL's learning_rate"),
    "num_iterations": ("trainer.ppo_epochs", "TRL's num_iterations"),
    "max_steps": ("trainer.steps", "TRL's max_steps"),
    "total_training_steps": ("trainer.steps", "verl's trainer.total_training_steps"),
    "loss_type": ("trainer.loss", "TRL's loss_type"),
    "loss_agg_mode": ("trainer.loss", "verl's loss_agg_mode"),
    "scale_rewards": ("trainer.advantage", "TRL's scale_rewards: group_std or group_mean"),
    "train_batch_size": ("rollout.prompts_per_step", "verl's data.train_batch_size"),
    "reward_funcs": ("rewards", "TRL's reward_funcs"),
    "reward_weights": ("rewards", "TRL's reward_weights: rewards[i].weight"),
    "model_name_or_path": ("model.name_or_path", "TRL's model_name_or_path"),
}

def suggest(key: str, keys: list[str]) -> str:
    """' (did you mean ...?)' for an unknown dotted key: a peer trainer's name for one of ours, a key whose last
    part is the same, or a close spelling; '' when none."""
    leaf = key.rsplit(".", 1)[-1].split("]")[-1].lstrip(".")
    close = difflib.get_close_matches(key, keys, n=1, cutoff=0.6)
    peer = PEER_NAMES.get(key) or (PEER_NAMES.get(leaf) if not close else None)
    if peer is not None:
        return f" (did you mean '{peer[0]}'? it is {peer[1]})"
    same_leaf = [k for k in keys if k.rsplit(".", 1)[-1] == leaf]
    if len(same_leaf) == 1 and same_leaf[0] != key:
        return f" (did you mean '{same_leaf[0]}'?)"
    return did_you_mean(key, keys)

def field_type(schema: type, dotted: str) -> Any:
    """The declared type of a dotted key in a config dataclass (None when there is no such key)."""
    kind: Any = schema
    for part in dotted.split("."):
        if not dataclasses.is_dataclass(kind) or part not in (hints := typing.get_type_hints(kind)):
            return None
        kind = hints[part]
        if typing.get_origin(kind) in (typing.Union, types.UnionType):
            kind = next((a for a in typing.get_args(kind) if a is not type(None)), kind)
    return kind

def recipe_item_error(path: Path, schema: type) -> str | None:
    """The first unknown key in a list item of a recipe file (its rewards, its tools), with its index."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    node = OmegaConf.load(path)  # read once already by _register: it parses
    if not isinstance(node, DictConfig):
        return None
    for key in schema_keys(schema):
        value = OmegaConf.select(node, key, default=None, throw_on_missing=False)
        if isinstance(value, (DictConfig, ListConfig)) and \
                (bad := list_item_error(key, OmegaConf.to_container(value), schema)):
            return bad
    return None

def list_item_error(key: str, value: Any, schema: type) -> str | None:
    """A command line's `key=[{...}, ...]` for a list of dataclass items (rewards, rollout.tools): the first item
    key its dataclass does not declare, as one line with its full path and a did-you-mean from that item's own
    fields; None when every item's keys are known."""
    kind = field_type(schema, key)
    item = (typing.get_args(kind) or [None])[0] if typing.get_origin(kind) is list else None
    if not (dataclasses.is_dataclass(item) and isinstance(value, list)):
        return None
    fields = [f.name for f in dataclasses.fields(item)]
    for i, entry in enumerate(value):
        for name in entry if isinstance(entry, dict) else ():
            if name not in fields:
                return (f"unknown key '{key}[{i}].{name}'{did_you_mean(name, fields)}; "
                        f"an item of {key} takes: {', '.join(fields)}")
    return None

def config_error_line(exc: BaseException, schema: type) -> str:
    """Turn a Hydra/OmegaConf composition or validation error into one line naming the full key."""
    from omegaconf.errors import (
        ConfigAttributeError,
        ConfigKeyError,
        MissingMandatoryValue,
        OmegaConfBaseException,
        ValidationError,
    )


    chain = []
    while exc is not None:
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    for e in chain:
        if isinstance(e, ConfigError):
            return str(e)
    for e in chain:
        if not isinstance(e, OmegaConfBaseException):
            continue
        key = getattr(e, "full_key", None) or ""
        msg = (getattr(e, "msg", None) or str(e)).strip().splitlines()[0]
        if isinstance(e, (ConfigKeyError, ConfigAttributeError)):
            name = msg.split("'")[1] if msg.count("'") >= 2 else key
            full = key if key.endswith(name) else (f"{key}.{name}" if key else name)
            item = msg.split("'")[3] if msg.count("'") >= 4 else ""  # "Key 'x' not in 'RewardSpec'": a list item's
            kinds = {t.__name__: t for t in item_schemas(schema)}
            if item in kinds and full == name:
                fields = [f.name for f in dataclasses.fields(kinds[item])]
                return (f"unknown key '{name}' in a {item} item{did_you_mean(name, fields)}; it takes: "
                        f"{', '.join(fields)}")
            return f"unknown key '{full}'{suggest(full, schema_keys(schema))}; see `grpo train --cfg job` for valid keys"
        if isinstance(e, MissingMandatoryValue):
            takes_recipe = any(COMMANDS[c].needs_recipe or COMMANDS[c].recipe_from for c in COMMANDS
                               if COMMAND_SCHEMAS[c] is schema)
            where = "in the recipe or on the command line" if takes_recipe else "on the command line"
            return f"'{key}' has no value; set it {where} ({key}=...)"
        if isinstance(e, ValidationError):
            return f"{key}: {msg}" if key else msg
        return f"{key}: {msg}" if key else msg
    first = chain[0]
    return " ".join(str(first).split())

def validate(cfg: Any, schema: type) -> Any:
    """The composed DictConfig -> the schema's dataclasses (runs every __post_init__ check)."""
    from omegaconf import OmegaConf

    # Hydra's `+key=value` opens the struct flag, so a typed node can still gain a key.
    extra = unknown_key(cfg, schema, "")
    if extra:
        raise UsageError(f"unknown key '{extra}'{suggest(extra, schema_keys(schema))}; "
                         "see `grpo train --cfg job` for valid keys")
    try:
        config = OmegaConf.to_object(cfg)
    except Exception as e:
        raise UsageError(config_error_line(e, schema)) from None
    if not isinstance(config, schema):  # e.g. a recipe that replaced the root
        raise UsageError(f"the composed config is not a {schema.__name__}")
    return config

def unknown_key(node: Any, schema: type, prefix: str) -> str | None:
    """The first key in a composed config that its schema dataclass does not declare."""
    from omegaconf import DictConfig, ListConfig

    hints = typing.get_type_hints(schema)
    for key in node.keys():
        full = f"{prefix}{key}"
        if key not in hints:
            return full
        value = node._get_node(key)
        field_type = hints[key]
        item_type = (typing.get_args(field_type) or [None])[0]
        if isinstance(value, DictConfig) and dataclasses.is_dataclass(field_type):
            found = unknown_key(value, field_type, full + ".")
        elif isinstance(value, ListConfig) and dataclasses.is_dataclass(item_type):
            found = next((k for i, item in enumerate(value)
                          if isinstance(item, DictConfig) and (k := unknown_key(item, item_type, f"{full}[{i}]."))),
                         None)
        else:
            found = None
        if found:
            return found
    return None
