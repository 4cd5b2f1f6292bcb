"""The `grpo` command: a dispatcher over sub-commands, each a real `@hydra.main` app.

Only this module and `config.py` touch Hydra/OmegaConf. Nothing heavy (torch,
vLLM, datasets) is imported at module level, so `--help`, `--cfg job` and tab
completion stay instant; each sub-command imports its engine when it runs.

Flow of `grpo train recipe=X a.b=c`:
  1. register the schema and every recipe found in Hydra's ConfigStore;
  2. preflight: compose the config with Hydra's compose API and validate it into
     dataclasses, turning any error into one line that names the full key;
  3. hand the remaining argv to the sub-command's `@hydra.main` app, which keeps
     Hydra's override grammar, --cfg/--resolve, -m sweeps, --config-dir and
     shell completion.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import os
import secrets
import sys
import tempfile
import time
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from grpo_cli import __version__
from grpo_cli.config import COMMAND_SCHEMAS, ConfigError, TrainConfig
from grpo_cli.dist import channel, launch
from grpo_cli.dist.launch import log_name, rank
from grpo_cli.errors import RunFailure, UsageError  # also reachable as grpo_cli.cli.UsageError
from grpo_cli.runs import resume_dir
from grpo_cli.runtime import quiet_third_party

RECIPE_PATH_ENV = "GRPO_RECIPE_PATH"  # extra recipe directories, separated like PATH


@dataclasses.dataclass(frozen=True)
class Command:
    summary: str  # one line for `grpo --help`
    runner: str  # "module:function" taking (config dataclass, run_dir or None)
    makes_run_dir: bool  # whether the command writes a run directory with a log file
    needs_recipe: bool = True  # whether the command composes a recipe (recipe=NAME); False keeps the group out
    # "module:function" (overrides: dict, strict: bool) -> a run's saved config.yaml that stands in for the
    # recipe (recipe=NAME stays optional and wins); strict=True raises a UsageError instead of returning None
    recipe_from: str | None = None


COMMANDS: dict[str, Command] = {
    "train": Command("train a policy with GRPO on a recipe", "grpo_cli.train:run", True),
    "eval": Command("evaluate checkpoints on the held-out set", "grpo_cli.evaluate:run", False, needs_recipe=False,
                    recipe_from="grpo_cli.runs:run_config_path"),
    "check": Command("print a recipe's batch arithmetic and settings that do nothing (loads no model)",
                     "grpo_cli.check:run_check", False),
    "reward": Command("score hand-written completions with a recipe's rewards", "grpo_cli.rewards.cases:run_cases", False),
    "export": Command("write a recipe's generated problems to JSONL", "grpo_cli.data:run_export", False),
    "plot": Command("plot a run's metrics to a PNG", "grpo_cli.plot:run_plot", False, needs_recipe=False),
    "merge": Command("merge a LoRA checkpoint's adapters into its base model (one model directory)",
                     "grpo_cli.lora:run_merge", False, needs_recipe=False),
}

# A run directory's name: timestamp + pid + random bits, fixed once per process, so
# two runs started in the same second never collide and a sweep's jobs share it.
_RUN_NAME = f"{time.strftime('%Y-%m-%d_%H-%M-%S')}_{os.getpid()}-{secrets.token_hex(2)}"


# A job's resume decision, shared by rank 0 with the other ranks: (the directory it continues, or None for a new
# run,). Unset in one process and on rank 0, which look on their own disk.
_SHARED_RESUME: tuple[str | None] | None = None
# where a sweep (-m) of a command that makes no run directory puts Hydra's files, removed when it ends
_SWEEP_SCRATCH = Path(tempfile.gettempdir()) / f"grpo-sweep-{_RUN_NAME}"


def _resumed_dir(output_dir: str, task: str, resume: str | None) -> Path | None:
    """The run directory this process continues, or None for a new run. Rank 0 (or the one process) decides on
    its disk; another rank takes rank 0's answer: that directory where its node has it, else the same name under
    its own output_dir (a split job's generator node, which holds its log there and no checkpoint; issue 54)."""
    if not resume:
        return None
    if _SHARED_RESUME is None:
        return resume_dir(output_dir, task, resume)
    (shared,) = _SHARED_RESUME
    if shared is None:
        return None
    return Path(shared) if Path(shared).is_dir() else Path(output_dir) / task / Path(shared).name


def _run_dir(output_dir: str, task: str, resume: str | None) -> str:
    found = _resumed_dir(output_dir, task, resume)
    return f"{output_dir}/{task}/{_RUN_NAME}" if found is None else str(found)


def _hydra_subdir(output_dir: str, task: str, resume: str | None) -> str:
    return ".hydra" if _resumed_dir(output_dir, task, resume) is None else f".hydra/resumed_{_RUN_NAME}"


def _decide_resume(config: Any) -> tuple[str | None]:
    """Rank 0's resume decision, to share with the other ranks."""
    found = _resumed_dir(config.output_dir, config.task, config.resume) if config is not None else None
    return (None if found is None else str(found),)


log = logging.getLogger("grpo_cli")


# ---------------------------------------------------------------------------
# recipes


def recipe_dirs() -> list[Path]:
    """Where recipes are looked up, first match wins: $GRPO_RECIPE_PATH, the checkout, the wheel."""
    dirs = [Path(p) for p in os.environ.get(RECIPE_PATH_ENV, "").split(os.pathsep) if p]
    package_dir = Path(__file__).resolve().parent
    dirs.append(package_dir.parent / "recipes")  # a source checkout (editable install)
    dirs.append(package_dir / "recipes")  # an installed wheel ships them inside the package
    return [d for d in dirs if d.is_dir()]


_RECIPE_FILES: dict[str, Path] = {}  # recipes named by path on this command line (recipe=./mine.yaml), by stem
_BROKEN_RECIPES: dict[str, str] = {}  # recipe name -> why it cannot be read: only a command naming it fails


def available_recipes() -> dict[str, Path]:
    found: dict[str, Path] = dict(_RECIPE_FILES)
    for d in recipe_dirs():
        for path in sorted(d.glob("*.yaml")):
            found.setdefault(path.stem, path)
    return found


def _is_recipe_path(value: str) -> bool:
    return "/" in value or value.endswith((".yaml", ".yml"))


def _recipe_paths_to_names(rest: list[str]) -> list[str]:
    """`recipe=PATH.yaml` (relative to the working directory, or absolute) -> `recipe=STEM`, the file registered
    under its stem ahead of every recipe folder; other arguments as they are. A file that does not exist: one
    line. (Hydra's grammar has no paths in a config group's value.)"""
    out = []
    for arg in rest:
        key, _, value = arg.partition("=")
        if key.lstrip("+~") == "recipe" and value and "," not in value and _is_recipe_path(value):
            path = Path(value).expanduser().resolve()
            if not path.is_file():
                raise UsageError(f"recipe file '{value}' not found (from {Path.cwd()})")
            _RECIPE_FILES[path.name.rsplit(".", 1)[0]] = path
            arg = f"{key}={path.name.rsplit('.', 1)[0]}"
        out.append(arg)
    return out


# ---------------------------------------------------------------------------
# errors


def _fail(command: str, message: str, code: int = 2) -> NoReturn:
    print(f"grpo {command}: error: {message}", file=sys.stderr)
    sys.exit(code)


def _item_schemas(schema: type) -> list[type]:
    """The dataclasses of list items anywhere in a config schema (RewardSpec, ToolSpec, ...)."""
    found: list[type] = []
    for f in dataclasses.fields(schema):
        kind = typing.get_type_hints(schema)[f.name]
        args = typing.get_args(kind) if typing.get_origin(kind) is list else ()
        if args and dataclasses.is_dataclass(args[0]):
            found.append(args[0])
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            found += _item_schemas(type(default))
    return found


def _schema_keys(schema: type, prefix: str = "") -> list[str]:
    """Every dotted key of a config dataclass, for did-you-mean hints."""
    keys = []
    for f in dataclasses.fields(schema):
        key = f"{prefix}{f.name}"
        keys.append(key)
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            keys.extend(_schema_keys(type(default), key + "."))
    return keys


def _did_you_mean(word: str, choices: list[str]) -> str:
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


def _suggest(key: str, keys: list[str]) -> str:
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
    return _did_you_mean(key, keys)


def _field_type(schema: type, dotted: str) -> Any:
    """The declared type of a dotted key in a config dataclass (None when there is no such key)."""
    kind: Any = schema
    for part in dotted.split("."):
        if not dataclasses.is_dataclass(kind) or part not in (hints := typing.get_type_hints(kind)):
            return None
        kind = hints[part]
        if typing.get_origin(kind) in (typing.Union, types.UnionType):
            kind = next((a for a in typing.get_args(kind) if a is not type(None)), kind)
    return kind


def _recipe_item_error(path: Path, schema: type) -> str | None:
    """The first unknown key in a list item of a recipe file (its rewards, its tools), with its index."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    node = OmegaConf.load(path)  # read once already by _register: it parses
    if not isinstance(node, DictConfig):
        return None
    for key in _schema_keys(schema):
        value = OmegaConf.select(node, key, default=None, throw_on_missing=False)
        if isinstance(value, (DictConfig, ListConfig)) and \
                (bad := _list_item_error(key, OmegaConf.to_container(value), schema)):
            return bad
    return None


def _list_item_error(key: str, value: Any, schema: type) -> str | None:
    """A command line's `key=[{...}, ...]` for a list of dataclass items (rewards, rollout.tools): the first item
    key its dataclass does not declare, as one line with its full path and a did-you-mean from that item's own
    fields; None when every item's keys are known."""
    kind = _field_type(schema, key)
    item = (typing.get_args(kind) or [None])[0] if typing.get_origin(kind) is list else None
    if not (dataclasses.is_dataclass(item) and isinstance(value, list)):
        return None
    fields = [f.name for f in dataclasses.fields(item)]
    for i, entry in enumerate(value):
        for name in entry if isinstance(entry, dict) else ():
            if name not in fields:
                return (f"unknown key '{key}[{i}].{name}'{_did_you_mean(name, fields)}; "
                        f"an item of {key} takes: {', '.join(fields)}")
    return None


def _config_error_line(exc: BaseException, schema: type) -> str:
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
            kinds = {t.__name__: t for t in _item_schemas(schema)}
            if item in kinds and full == name:
                fields = [f.name for f in dataclasses.fields(kinds[item])]
                return (f"unknown key '{name}' in a {item} item{_did_you_mean(name, fields)}; it takes: "
                        f"{', '.join(fields)}")
            return f"unknown key '{full}'{_suggest(full, _schema_keys(schema))}; see `grpo train --cfg job` for valid keys"
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


# ---------------------------------------------------------------------------
# Hydra wiring


RUN_RECIPE = "_run"  # recipe-group name of a run's saved config standing in for recipe=NAME (grpo eval)


def _register(command: str, recipe_required: bool = True, rest: list[str] | None = None) -> None:
    """Put the command's schema and every recipe into Hydra's ConfigStore.

    Completion registers the recipe group as optional, so nested keys complete
    before a recipe is typed (the schema's keys do not depend on the recipe).
    For a command with `recipe_from` (grpo eval), the run named on the command
    line (`rest`) has its saved config.yaml registered as the default recipe,
    so command-line overrides apply on top of the run's resolved config.
    """
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf


    OmegaConf.register_new_resolver("grpo_run_dir", _run_dir, replace=True)
    OmegaConf.register_new_resolver("grpo_hydra_subdir", _hydra_subdir, replace=True)
    cs = ConfigStore.instance()
    spec, schema = COMMANDS[command], COMMAND_SCHEMAS[command]
    for name, path in (available_recipes() if spec.needs_recipe or spec.recipe_from else {}).items():
        try:  # a malformed recipe fails only the command that names it
            cs.store(group="recipe", name=name, node=_recipe_node(path, schema), package="_global_")
        except UsageError as e:
            _BROKEN_RECIPES[name] = str(e)
    run_config = _recipe_from(command, rest or [], strict=False)
    if run_config is not None:
        node = _recipe_node(run_config, schema)
        node.pop("resume", None)  # how that run was started, not part of its recipe
        cs.store(group="recipe", name=RUN_RECIPE, node=node, package="_global_")
    cs.store(name=f"{command}_schema", node=schema)

    hydra_settings: dict[str, Any] = {
        "job": {"name": log_name(command, rank())[: -len(".log")], "chdir": False},  # train.log, train-rank1.log
        "help": {"app_name": f"grpo {command}", "template": _help_template(schema)},
    }
    recipe_required = recipe_required and COMMANDS[command].needs_recipe
    default_recipe = RUN_RECIPE if run_config is not None else "???" if recipe_required else None
    defaults: list[Any] = [f"{command}_schema", {"recipe": default_recipe}, "_self_"]
    if COMMANDS[command].makes_run_dir:
        # A resumed run continues in its own directory; its Hydra files go to a subfolder.
        hydra_settings["run"] = {"dir": "${grpo_run_dir:${output_dir},${task},${resume}}"}
        hydra_settings["output_subdir"] = "${grpo_hydra_subdir:${output_dir},${task},${resume}}" if rank() == 0 else None
        hydra_settings["sweep"] = {"dir": f"${{output_dir}}/${{task}}/sweep_{_RUN_NAME}", "subdir": "${hydra.job.num}"}
    else:
        # Commands that write no run directory: no log file, no .hydra folder, output in place; a sweep's
        # folders (Hydra writes multirun.yaml and one folder per job) go to a scratch folder removed at the end.
        hydra_settings["run"] = {"dir": "."}
        hydra_settings["output_subdir"] = None
        hydra_settings["sweep"] = {"dir": str(_SWEEP_SCRATCH), "subdir": "${hydra.job.num}"}
        defaults += [{"override hydra/job_logging": "none"}, {"override hydra/hydra_logging": "none"}]
    cs.store(name=command, node={"defaults": defaults, "hydra": hydra_settings})


def _field_comments(cls: type) -> dict[str, str]:
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

    lines, comments, hints = [], _field_comments(schema), typing.get_type_hints(schema)
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


def _help_template(schema: type) -> str:
    """Hydra's help page: the composed config (a recipe's values), then every key with its default and comment.
    (Hydra reads the template through OmegaConf and string.Template: `$` and `${` are escaped.)"""
    keys = "\n".join(schema_help(schema)).replace("$", "$$").replace("${", "\\${")
    return ("${hydra.help.header}\n== Configuration groups ==\n$APP_CONFIG_GROUPS\n\n== Config ==\n"
            "The config this command line composes (override any key with key=value):\n\n$CONFIG\n"
            "== Every key ==\nIts default and what it does; a list's items take the keys shown under it:\n\n"
            f"{keys}\n\n${{hydra.help.footer}}")


def _recipe_node(path: Path, schema: type) -> Any:
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


def _override_values(rest: list[str]) -> dict[str, Any]:
    """key -> value of the command line's overrides (a sweep's first value as text); lists stay lists."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    args = _hydra_args(rest)
    try:
        parsed = OverridesParser.create().parse_overrides(args.overrides)
    except Exception as e:  # Hydra's grammar errors are multi-line
        raise UsageError(" ".join(str(e).split())) from None
    return {o.key_or_group: next(iter(o.sweep_string_iterator())) if o.is_sweep_override() else o.value()
            for o in parsed}


def _recipe_from(command: str, rest: list[str], strict: bool) -> Path | None:
    """The run config that stands in for recipe=NAME, for a command with `recipe_from`; else None.

    strict=True (no recipe given): a one-line UsageError says why there is none.
    """
    spec = COMMANDS[command]
    if spec.recipe_from is None:
        return None
    try:
        values = _override_values(rest)
    except UsageError:
        if strict:
            raise
        return None  # completion, or a command line the preflight will reject in one line
    import importlib

    module_name, func_name = spec.recipe_from.split(":")
    return getattr(importlib.import_module(module_name), func_name)(values, strict)


def _hydra_args(rest: list[str]) -> Any:
    from hydra._internal.utils import get_args_parser

    parser = get_args_parser()

    def refuse(message: str) -> NoReturn:  # argparse would print its usage block and exit
        raise UsageError(" ".join(message.split()))

    parser.error = refuse  # type: ignore[method-assign]
    return parser.parse_args(rest)


def _preflight(command: str, rest: list[str]) -> Any:
    """Compose and validate before Hydra's app runs, so every mistake is one line, no traceback.
    Returns the validated config (None for help and the like)."""
    args = _hydra_args(rest)
    if args.help or args.hydra_help or args.shell_completion or args.info or args.experimental_rerun:
        return None
    from hydra.core.override_parser.overrides_parser import OverridesParser

    recipes = available_recipes()
    try:
        parsed = OverridesParser.create().parse_overrides(args.overrides)
    except Exception as e:  # Hydra's grammar errors are multi-line
        raise UsageError(" ".join(str(e).split())) from None
    overrides = []
    chosen_recipes = []
    schema = COMMAND_SCHEMAS[command]
    for o in parsed:
        key = o.get_key_element()
        if o.is_sweep_override() and not args.multirun:
            raise UsageError(f"'{o.input_line}': a comma-separated value is a sweep: add -m to run one job per value, "
                             f"or write {o.key_or_group}=[a,b] for a list, or quote it for text")
        if not o.is_sweep_override() and (bad := _list_item_error(o.key_or_group, o.value(), schema)):
            raise UsageError(bad)
        if o.is_sweep_override():
            values = list(o.sweep_string_iterator())
            value = values[0]
        else:
            values = [o.get_value_element_as_str()]
            value = values[0]
        if o.key_or_group == "recipe":
            chosen_recipes += values
        overrides.append(f"{key}={value}")
    names = ", ".join(sorted(recipes)) or f"none found (set ${RECIPE_PATH_ENV})"
    if chosen_recipes and not (COMMANDS[command].needs_recipe or COMMANDS[command].recipe_from):
        raise UsageError(f"'grpo {command}' takes no recipe; drop recipe={chosen_recipes[0]}")
    if not chosen_recipes and COMMANDS[command].recipe_from:
        _recipe_from(command, rest, strict=True)  # the run's config stands in for the recipe, or one line says why
    if not chosen_recipes and COMMANDS[command].needs_recipe:
        raise UsageError(f"no recipe given; pick one with recipe=NAME, available: {names}")
    for r in chosen_recipes:
        if r in _BROKEN_RECIPES:
            raise UsageError(f"recipe '{r}': {_BROKEN_RECIPES[r]}")
        if r not in recipes:
            where = f"; a recipe file is named by its path (recipe=./{r}.yaml) or found in ${RECIPE_PATH_ENV}"
            raise UsageError(f"unknown recipe '{r}'{_did_you_mean(r, list(recipes))}; available: {names}{where}")
        if (bad := _recipe_item_error(recipes[r], COMMAND_SCHEMAS[command])) is not None:
            raise UsageError(f"recipe '{r}': {bad}")
    return _compose_and_validate(command, overrides, args.config_dir)


def load_config(command: str, overrides: list[str]) -> Any:
    """The typed config `grpo COMMAND OVERRIDES...` runs with, for scripts and notebooks.

    `load_config("train", ["recipe=bike_pricing", "rollout.group_size=16"])` -> TrainConfig.
    Composed and validated exactly as on the command line; a mistake raises UsageError.
    """
    _register(command, rest=overrides)
    return _compose_and_validate(command, overrides, None)


def _compose_and_validate(command: str, overrides: list[str], config_dir: str | None) -> Any:
    from hydra import compose, initialize
    from hydra.core.global_hydra import GlobalHydra


    schema = COMMAND_SCHEMAS[command]
    if config_dir:
        overrides = overrides + [f"hydra.searchpath=[file://{Path(config_dir).resolve()}]"]
    GlobalHydra.instance().clear()
    try:
        with initialize(config_path=None, version_base=None):
            cfg = compose(config_name=command, overrides=overrides)
            config = validate(cfg, schema)
    except UsageError:
        raise
    except Exception as e:
        raise UsageError(_config_error_line(e, schema)) from None
    finally:
        GlobalHydra.instance().clear()
    deciding = launch.rank() == 0 and getattr(getattr(config, "dist", None), "node_rank", 0) == 0
    if getattr(config, "resume", None) and deciding:  # other ranks take rank 0's decision (main)
        try:
            resume_dir(config.output_dir, config.task, config.resume)
        except FileNotFoundError as e:
            raise UsageError(str(e)) from None
    return config


def validate(cfg: Any, schema: type) -> Any:
    """The composed DictConfig -> the schema's dataclasses (runs every __post_init__ check)."""
    from omegaconf import OmegaConf

    # Hydra's `+key=value` opens the struct flag, so a typed node can still gain a key.
    extra = _unknown_key(cfg, schema, "")
    if extra:
        raise UsageError(f"unknown key '{extra}'{_suggest(extra, _schema_keys(schema))}; "
                         "see `grpo train --cfg job` for valid keys")
    try:
        config = OmegaConf.to_object(cfg)
    except Exception as e:
        raise UsageError(_config_error_line(e, schema)) from None
    if not isinstance(config, schema):  # e.g. a recipe that replaced the root
        raise UsageError(f"the composed config is not a {schema.__name__}")
    return config


def _unknown_key(node: Any, schema: type, prefix: str) -> str | None:
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
            found = _unknown_key(value, field_type, full + ".")
        elif isinstance(value, ListConfig) and dataclasses.is_dataclass(item_type):
            found = next((k for i, item in enumerate(value)
                          if isinstance(item, DictConfig) and (k := _unknown_key(item, item_type, f"{full}[{i}]."))),
                         None)
        else:
            found = None
        if found:
            return found
    return None


def _peer_failed(exc: BaseException) -> bool:
    """Whether a collective failed because another rank's process went away (gloo: "Connection closed by
    peer"): then this rank's error is a consequence, left to its log file."""
    text = str(exc)
    return "closed by peer" in text or "reset by peer" in text


def _holds_only_setup_files(run_dir: Path) -> bool:
    """Whether a run directory holds only what Hydra and the start wrote (its config, .hydra, logs): nothing of a
    run (metrics, checkpoints, samples) that a refusal must not delete; a resumed run's holds its metrics."""
    return run_dir.is_dir() and all(p.name in ("config.yaml", ".hydra") or p.suffix == ".log" for p in run_dir.iterdir())


def _remove_empty_task_dir(run_dir: Path) -> None:
    """runs/TASK/ when the refused run's folder was all it held (output_dir itself stays: it may be the user's)."""
    try:
        run_dir.parent.rmdir()
    except OSError:
        pass


def _log_to_file_only(message: str) -> None:
    """A line for the run's log file, not the terminal (the terminal gets the one stderr line)."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.emit(logging.LogRecord("grpo_cli", logging.ERROR, __file__, 0, message, None, None))


def _make_app(command: str) -> Callable[[], Any]:
    import hydra

    spec = COMMANDS[command]

    def task(cfg: Any) -> None:
        from hydra.core.hydra_config import HydraConfig
        from omegaconf import OmegaConf


        try:
            config = validate(cfg, COMMAND_SCHEMAS[command])
        except UsageError as e:
            _fail(command, str(e))

        run_dir = None
        if spec.makes_run_dir:
            run_dir = Path(HydraConfig.get().runtime.output_dir)
            if rank() == 0:  # one process of a job writes the run's files
                OmegaConf.save(cfg, run_dir / "config.yaml", resolve=True)
        who = f"rank {rank()}: " if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
        if who and getattr(getattr(config, "rollout", None), "placement", "") == "split":
            who = f"{'generator' if rank() >= config.trainer_ranks else 'trainer'} {who}"
        module_name, func_name = spec.runner.split(":")
        # every command, before its runner imports vLLM/datasets/transformers (their env variables are read then)
        quiet_third_party(getattr(getattr(config, "logging", None), "verbose_libraries", False))
        try:
            import importlib

            runner = getattr(importlib.import_module(module_name), func_name)
            code = runner(config, run_dir)
        except UsageError as e:  # the pre-run check's refusal: one line, and no run directory left behind
            if run_dir is not None and rank() == 0 and _holds_only_setup_files(run_dir):
                import shutil

                for handler in [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]:
                    handler.close()  # the run's log file is closed before its folder goes
                    logging.getLogger().removeHandler(handler)
                shutil.rmtree(run_dir, ignore_errors=True)
                _remove_empty_task_dir(run_dir)
            elif run_dir is not None:
                _log_to_file_only(f"grpo {command}: error: {who}{e}")
            _fail(command, who + str(e))
        except RunFailure as e:  # explained in one line; the traceback goes to the run's log
            log.exception("grpo %s stopped", command)
            _fail(command, who + str(e), code=1)
        except KeyboardInterrupt:
            raise
        except Exception as e:
            # Full traceback to the run's log file; one line on the terminal.
            log.exception("grpo %s crashed", command)
            if who and _peer_failed(e):  # another rank died first: its line and the launcher's say why
                if os.environ.get("LOCAL_WORLD_SIZE") == os.environ.get("WORLD_SIZE"):
                    sys.exit(1)  # one node: the failed rank's own line is on this terminal
                _fail(command, f"{who}stopped: another rank's process went away (its node's output says why)",
                      code=1)
            where = f" (traceback in {run_dir / log_name(command, rank())})" if run_dir else ""
            _fail(command, f"{who}{type(e).__name__}: {e}{where}", code=1)
        if code:
            sys.exit(code)

    # Every config comes from the ConfigStore. A task function defined in a module makes Hydra add that
    # module's package (pkg://grpo_cli) to the config search path, where a subpackage such as
    # grpo_cli/rewards would be a config group shadowing the `rewards` key ("Could not override
    # 'rewards'"); one in __main__ with config_path=None gets no search path directory at all
    # (hydra._internal.utils.detect_calling_file_or_module_from_task_function).
    task.__module__ = "__main__"
    return hydra.main(version_base=None, config_path=None, config_name=command)(task)


# ---------------------------------------------------------------------------
# entry point


def _print_help() -> None:
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


def _completion(argv: list[str]) -> int:
    """`grpo -sc install=bash` / `query=bash`: Hydra's completion, aware of sub-commands."""
    if any(a.startswith("query=") for a in argv[1:]):
        line = os.environ.get("COMP_LINE", "")
        words = line.split()
        typed_command = len(words) >= 3 or (len(words) == 2 and line.endswith(" "))
        if typed_command and words[1] in COMMANDS:
            # Drop the sub-command so Hydra sees "grpo <overrides>".
            os.environ["COMP_LINE"] = line.replace(f" {words[1]}", "", 1)
            return _run_hydra(words[1], argv, recipe_required=False)
        if not typed_command:
            print(" ".join(COMMANDS))
        return 0
    return _run_hydra("train", argv)


HELP_FLAGS = ("-h", "--help", "--hydra-help", "-i", "--info")


def _run_hydra(command: str, rest: list[str], recipe_required: bool = True) -> int:
    # Help and --info describe the config without running it: no recipe needed.
    _register(command, recipe_required and not any(a in HELP_FLAGS for a in rest), rest)
    sys.argv = [sys.argv[0]] + rest
    try:
        _make_app(command)()
    except Exception as e:  # Hydra's own usage errors, outside the task function
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        _fail(command, " ".join(str(e).split()))
    finally:
        import shutil

        shutil.rmtree(_SWEEP_SCRATCH, ignore_errors=True)  # `grpo check -m`: nothing left behind
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        _print_help()
        return 0
    if argv[0] in ("-V", "--version", "version"):
        print(f"grpo {__version__}")
        return 0
    if argv[0] in ("-sc", "--shell-completion"):
        return _completion(argv)
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        _fail(command, f"unknown command{_did_you_mean(command, list(COMMANDS))}; choose one of: {', '.join(COMMANDS)}")
    started = time.time()
    launched_rest = rest  # a multi-process job's workers get the command line as typed, recipe paths included
    _RECIPE_FILES.clear()  # this command line's (main runs more than once in one process: tests, notebooks)
    _BROKEN_RECIPES.clear()
    try:
        rest = _recipe_paths_to_names(rest)
        _register(command, rest=rest)
        config = _preflight(command, rest)
    except UsageError as e:
        _fail(command, str(e))
    log.debug("preflight took %.3fs", time.time() - started)

    world = getattr(getattr(config, "dist", None), "world_size", 1)
    if command == "train" and world > 1 and not launch.under_launcher():
        args = _hydra_args(rest)
        if args.multirun:
            _fail(command, "a sweep (-m) runs its jobs in this process one by one; run each multi-process "
                  "job on its own, without -m")
        if not args.cfg:  # --cfg job prints the config, as for one process
            return launch.launch(config.dist, launched_rest)  # the workers come back here, under the launcher
    if launch.under_launcher() and int(os.environ["WORLD_SIZE"]) > 1:
        if command != "train":
            _fail(command, f"WORLD_SIZE={os.environ['WORLD_SIZE']}: 'grpo {command}' runs in one process; "
                  "only 'grpo train' runs over several")
        global _RUN_NAME, _SHARED_RESUME
        timeout_s = config.dist.timeout_s if config is not None else 600
        if config is not None and config.rollout.placement == "split":  # generators join no default group
            generator = launch.rank() >= config.trainer_ranks
            if generator:  # its own GPU, chosen before CUDA starts in this process
                launch.bind_generator_gpu()
            launch.die_with_parent()
            links = channel.connect(launch.rank(), config.trainer_ranks, int(os.environ["WORLD_SIZE"]), timeout_s)
            if generator:
                _RUN_NAME, _SHARED_RESUME = links.channels[0].recv()  # one run directory for the whole job
            else:
                decided = launch.share_from_rank0((_RUN_NAME, _decide_resume(config))) \
                    if config.trainer_ranks > 1 else (_RUN_NAME, _decide_resume(config))
                for line in links.channels:  # trainer rank 0's, one to each generator
                    line.send(decided)
                if launch.rank() != 0:
                    _RUN_NAME, _SHARED_RESUME = decided
        else:
            launch.join_job(timeout_s)
            # one run directory for the whole job
            _RUN_NAME, shared = launch.share_from_rank0((_RUN_NAME, _decide_resume(config)))
            if launch.rank() != 0:
                _SHARED_RESUME = shared
    return _run_hydra(command, rest)
