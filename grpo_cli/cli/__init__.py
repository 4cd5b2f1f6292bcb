"""The `grpo` command: a dispatcher over sub-commands, each a real `@hydra.main` app.

Only this package and `grpo_cli/config/` touch Hydra/OmegaConf. Nothing heavy (torch,
vLLM, datasets) is imported at module level, so `--help`, `--cfg job` and tab
completion stay instant; each sub-command imports its engine when it runs.

Flow of `grpo train recipe=X a.b=c`:
  1. register the schema and every recipe found in Hydra's ConfigStore;
  2. preflight: compose the config with Hydra's compose API and validate it into
     dataclasses, turning any error into one line that names the full key;
  3. hand the remaining argv to the sub-command's `@hydra.main` app, which keeps
     Hydra's override grammar, --cfg/--resolve, -m sweeps, --config-dir and
     shell completion.

The pieces: commands.py (the table of sub-commands), recipes.py (finding and reading recipes), messages.py
(a mistake as one line), help.py (the help pages), app.py (a command's Hydra app and its failures); this
module registers the configs, runs the pre-flight and dispatches.
"""

from __future__ import annotations

import logging
import os
import secrets
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NoReturn

from grpo_cli import __version__
from grpo_cli.cli.app import make_app
from grpo_cli.cli.commands import COMMANDS
from grpo_cli.cli.help import help_template, print_help
from grpo_cli.cli.messages import config_error_line, did_you_mean, fail, list_item_error, recipe_item_error, validate
from grpo_cli.cli.recipes import (
    BROKEN_RECIPES,
    RECIPE_FILES,
    RECIPE_PATH_ENV,
    available_recipes,
    recipe_node,
    recipe_paths_to_names,
)
from grpo_cli.config import COMMAND_SCHEMAS
from grpo_cli.dist import channel, launch
from grpo_cli.dist.launch import log_name, rank
from grpo_cli.errors import UsageError  # also reachable as grpo_cli.cli.UsageError
from grpo_cli.weights.runs import resume_dir

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
            cs.store(group="recipe", name=name, node=recipe_node(path, schema), package="_global_")
        except UsageError as e:
            BROKEN_RECIPES[name] = str(e)
    run_config = _recipe_from(command, rest or [], strict=False)
    if run_config is not None:
        node = recipe_node(run_config, schema)
        node.pop("resume", None)  # how that run was started, not part of its recipe
        cs.store(group="recipe", name=RUN_RECIPE, node=node, package="_global_")
    cs.store(name=f"{command}_schema", node=schema)

    hydra_settings: dict[str, Any] = {
        "job": {"name": log_name(command, rank())[: -len(".log")], "chdir": False},  # train.log, train-rank1.log
        "help": {"app_name": f"grpo {command}", "template": help_template(schema)},
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
        if not o.is_sweep_override() and (bad := list_item_error(o.key_or_group, o.value(), schema)):
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
        if r in BROKEN_RECIPES:
            raise UsageError(f"recipe '{r}': {BROKEN_RECIPES[r]}")
        if r not in recipes:
            where = f"; a recipe file is named by its path (recipe=./{r}.yaml) or found in ${RECIPE_PATH_ENV}"
            raise UsageError(f"unknown recipe '{r}'{did_you_mean(r, list(recipes))}; available: {names}{where}")
        if (bad := recipe_item_error(recipes[r], COMMAND_SCHEMAS[command])) is not None:
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
        raise UsageError(config_error_line(e, schema)) from None
    finally:
        GlobalHydra.instance().clear()
    deciding = launch.rank() == 0 and getattr(getattr(config, "dist", None), "node_rank", 0) == 0
    if getattr(config, "resume", None) and deciding:  # other ranks take rank 0's decision (main)
        try:
            resume_dir(config.output_dir, config.task, config.resume)
        except FileNotFoundError as e:
            raise UsageError(str(e)) from None
    return config

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
        make_app(command)()
    except Exception as e:  # Hydra's own usage errors, outside the task function
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        fail(command, " ".join(str(e).split()))
    finally:
        import shutil

        shutil.rmtree(_SWEEP_SCRATCH, ignore_errors=True)  # `grpo check -m`: nothing left behind
    return 0

def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print_help()
        return 0
    if argv[0] in ("-V", "--version", "version"):
        print(f"grpo {__version__}")
        return 0
    if argv[0] in ("-sc", "--shell-completion"):
        return _completion(argv)
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        fail(command, f"unknown command{did_you_mean(command, list(COMMANDS))}; choose one of: {', '.join(COMMANDS)}")
    started = time.time()
    launched_rest = rest  # a multi-process job's workers get the command line as typed, recipe paths included
    RECIPE_FILES.clear()  # this command line's (main runs more than once in one process: tests, notebooks)
    BROKEN_RECIPES.clear()
    try:
        rest = recipe_paths_to_names(rest)
        _register(command, rest=rest)
        config = _preflight(command, rest)
    except UsageError as e:
        fail(command, str(e))
    log.debug("preflight took %.3fs", time.time() - started)

    world = getattr(getattr(config, "dist", None), "world_size", 1)
    if command == "train" and world > 1 and not launch.under_launcher():
        args = _hydra_args(rest)
        if args.multirun:
            fail(command, "a sweep (-m) runs its jobs in this process one by one; run each multi-process "
                  "job on its own, without -m")
        if not args.cfg:  # --cfg job prints the config, as for one process
            return launch.launch(config.dist, launched_rest)  # the workers come back here, under the launcher
    if launch.under_launcher() and int(os.environ["WORLD_SIZE"]) > 1:
        if command != "train":
            fail(command, f"WORLD_SIZE={os.environ['WORLD_SIZE']}: 'grpo {command}' runs in one process; "
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
