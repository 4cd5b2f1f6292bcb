"""A run directory on disk: its complete checkpoints (one rule), resuming and pruning, and what the names
`grpo eval` takes (latest, best, base, a path) point to.

    RUN_DIR/config.yaml                 the resolved config (the recipe `grpo eval` reuses)
    RUN_DIR/checkpoints/step_NNNNNN/    periodic, resumable (model + optimizer/ + trainer_state.pt)
    RUN_DIR/checkpoints/final/, best/   the end of the run; the best held-out pass@1 so far
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo_cli.errors import UsageError
from grpo_cli.weights.checkpoint import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    COMPLETE_MARKER,
    STEP_PREFIX,
    TRAINER_STATE,
    damaged_weights,
    is_adapter_dir,
    read_info,
    resolve_model_path,
)

RUN_CONFIG = "config.yaml"  # a run's resolved config, written by `grpo train`
CHECKPOINTS = "checkpoints"  # a run's checkpoint folder
KEYWORDS = ("latest", "best", "base")
BEST_KEY = "eval/pass@1"  # where checkpoint.json records the held-out pass@1 of its step
EXPECTED = ("a checkpoint directory (config.json + *.safetensors, or a LoRA run's adapter_config.json + "
            "adapter_model.safetensors; + checkpoint.json for a run's checkpoint)")
NO_CHECKPOINT = ("no checkpoint given; set checkpoint=PATH (or latest|best|base with run=DIR) "
                 "or checkpoints=[A,B]")
PARTIAL_TAGS = (".tmp-", ".old-")  # in the names of the directories an interrupted save leaves behind


def is_partial(path: Path) -> bool:
    """A directory an interrupted save left (NAME.tmp-PID, NAME.old-PID): never a checkpoint."""
    return any(tag in Path(path).name for tag in PARTIAL_TAGS)


def list_checkpoints(run_dir: Path) -> list[tuple[Path, dict[str, Any]]]:
    """A run's complete checkpoints with their checkpoint.json, oldest first (by step, then name). The one
    rule for complete: not a partial save's directory, and checkpoint.json (written last), config.json (or a LoRA
    run's adapter_config.json) and *.safetensors present. Resuming, pruning and `grpo eval` all list checkpoints
    through here."""
    root = Path(run_dir) / CHECKPOINTS
    found = []
    for path in sorted(root.iterdir()) if root.is_dir() else []:
        info = read_info(path) if path.is_dir() and not is_partial(path) else None
        described = (path / "config.json").is_file() or (path / ADAPTER_CONFIG).is_file()
        if info is not None and described and any(path.glob("*.safetensors")):
            found.append((path, info))
    return sorted(found, key=lambda item: (item[1].get("step") if isinstance(item[1].get("step"), int) else -1,
                                           item[0].name))



def step_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run that can be resumed from (they hold a trainer state), oldest first."""
    return [path for path, _ in list_checkpoints(run_dir) if (path / TRAINER_STATE).is_file()]


def prune_checkpoints(run_dir: Path, keep_last: int) -> None:
    """Delete periodic checkpoints beyond the newest `keep_last` complete ones (best and final are not
    periodic; a partial save's directory is not a checkpoint and is left alone)."""
    periodic = [path for path, _ in list_checkpoints(run_dir) if path.name.startswith(STEP_PREFIX)]
    for old in periodic[:-keep_last]:
        shutil.rmtree(old)


def newest_run(output_dir: str, task: str) -> Path | None:
    """The most recently modified run directory of a task that holds a resumable checkpoint."""
    root = Path(output_dir) / task
    runs = [d for d in root.iterdir() if d.is_dir() and step_checkpoints(d)] if root.is_dir() else []
    return max(runs, key=lambda d: step_checkpoints(d)[-1].stat().st_mtime, default=None)


def resume_dir(output_dir: str, task: str, resume: str) -> Path | None:
    """`resume=auto` -> the newest resumable run of the task, or None where there is none: the run starts new,
    so a requeued job can carry resume=auto from its first attempt (issue 54); `resume=DIR` -> DIR, checked."""
    if resume == "auto":
        found = newest_run(output_dir, task)
        return None if found is None else found.resolve()
    path = Path(resume)
    if not path.is_dir():
        raise FileNotFoundError(f"resume={resume}: not a directory")
    if not step_checkpoints(path):
        root = path / "checkpoints"
        have = sorted(p.name for p in root.iterdir()) if root.is_dir() else []
        raise FileNotFoundError(f"resume={resume}: no complete checkpoint with trainer state in {root} "
                                f"(found: {', '.join(have) or 'nothing'}); is this a run directory?")
    return path.resolve()


# ---------------------------------------------------------------------------
# what `grpo eval` names: latest | best | base | a path -> checked model directories


def checkpoint_names(checkpoint: Any, checkpoints: Any) -> list[str]:
    """eval's checkpoint= / checkpoints= as a list of names."""
    if checkpoint not in (None, ""):
        return [str(checkpoint)]
    if isinstance(checkpoints, (list, tuple)):
        return [str(c) for c in checkpoints]
    return [str(checkpoints)] if checkpoints not in (None, "") else []


def run_dir_of(names: list[str], run: str | None) -> Path | None:
    """The run an eval refers to: run=DIR, else the run of the first checkpoint path inside one."""
    if run:
        return Path(run)
    for name in names:
        if name in KEYWORDS:
            continue
        path = Path(os.path.abspath(name))  # so that "." inside a checkpoint still knows its run
        if (path / RUN_CONFIG).is_file():  # a run directory given as the checkpoint; resolve() says what to pick
            return path
        if path.parent.name == CHECKPOINTS and (path.parent.parent / RUN_CONFIG).is_file():
            return path.parent.parent
    return None


def run_config_path(overrides: dict[str, Any], strict: bool) -> Path | None:
    """For cli/: the saved config of the run being evaluated, which stands in for recipe=NAME.

    strict=True (no recipe given) raises a one-line UsageError instead of returning None.
    """
    names = checkpoint_names(overrides.get("checkpoint"), overrides.get("checkpoints"))
    run = overrides.get("run")
    run = str(run) if run not in (None, "") else None
    run_dir = run_dir_of(names, run)
    if run_dir is not None and (run_dir / RUN_CONFIG).is_file():
        return run_dir / RUN_CONFIG
    if not strict:
        return None
    if run is not None:
        check_run_dir(Path(run), run)
        raise UsageError(f"run={run}: no {RUN_CONFIG} there (a run directory written by grpo train has one); "
                         "add recipe=NAME to evaluate with a recipe")
    if not names:
        raise UsageError(NO_CHECKPOINT)
    paths = [n for n in names if n not in KEYWORDS]
    if not paths:
        raise UsageError(f"checkpoint={names[0]} needs run=DIR, the run directory it refers to"
                         + (" (or recipe=NAME: base is the recipe's model)" if names[0] == "base" else ""))
    check_checkpoint(Path(paths[0]), paths[0])
    raise UsageError(f"'{paths[0]}' is not a checkpoint of a run (RUN_DIR/{CHECKPOINTS}/NAME beside "
                     f"RUN_DIR/{RUN_CONFIG}), so no recipe says how to evaluate it; add recipe=NAME")


def check_run_dir(run_dir: Path, name: str) -> None:
    if not run_dir.exists():
        raise UsageError(f"run={name}: no such directory; expected a run directory of grpo train "
                         f"({RUN_CONFIG}, {CHECKPOINTS}/)")
    if not run_dir.is_dir():
        raise UsageError(f"run={name}: is a file; expected a run directory of grpo train ({RUN_CONFIG}, {CHECKPOINTS}/)")


def _run_listing(run_dir: Path) -> str:
    """What a run's checkpoints folder holds, for error messages."""
    root = run_dir / CHECKPOINTS
    complete = [p.name for p, _ in list_checkpoints(run_dir)]
    if complete:
        return f"checkpoints in {root}: {', '.join(complete)}"
    entries = sorted(p.name for p in root.iterdir()) if root.is_dir() else []
    if entries:
        return f"{root} holds no complete checkpoint, only: {', '.join(e + ' (partial)' for e in entries)}"
    return f"it has no checkpoints ({root} is {'empty' if root.is_dir() else 'missing'})"


def _holds(path: Path) -> str:
    names = sorted(p.name for p in path.iterdir())
    return ", ".join(names[:12]) + (f", ... ({len(names)} entries)" if len(names) > 12 else "") if names else "nothing"


def check_checkpoint(path: Path, name: str) -> None:
    """A usable model directory, or a one-line UsageError naming what was expected (reads headers only)."""
    if not path.exists():
        raise UsageError(f"checkpoint '{name}' does not exist; expected {EXPECTED}, or latest|best|base with run=DIR")
    if not path.is_dir():
        raise UsageError(f"checkpoint '{name}' is a file; expected {EXPECTED}")
    parent = Path(os.path.abspath(path)).parent
    in_run = parent.name == CHECKPOINTS  # RUN_DIR/checkpoints/NAME
    if not (path / "config.json").is_file() and ((path / CHECKPOINTS).is_dir() or (path / RUN_CONFIG).is_file()):
        raise UsageError(f"'{name}' is a run directory, not a checkpoint; {_run_listing(path)} "
                         f"(pass checkpoint=RUN_DIR/{CHECKPOINTS}/NAME, or checkpoint=latest run={name})")
    if is_partial(path) or (in_run and not (path / COMPLETE_MARKER).is_file()):
        where = f"; {_run_listing(parent.parent)}" if in_run else ""
        raise UsageError(f"'{name}' is a partial checkpoint (an interrupted save: no {COMPLETE_MARKER}, which a "
                         f"complete save writes last){where}")

    if is_adapter_dir(path):  # a LoRA checkpoint: peft's adapter files, served on the run's base model
        if not (path / ADAPTER_WEIGHTS).is_file():
            raise UsageError(f"'{name}' has {ADAPTER_CONFIG} but no {ADAPTER_WEIGHTS}; it holds: {_holds(path)}")
        if damage := damaged_weights(str(path)):
            raise UsageError(damage)
        return
    shards = sorted(path.glob("*.safetensors"))
    missing = [what for what, ok in (("config.json", (path / "config.json").is_file()), ("*.safetensors", shards))
               if not ok]
    if missing:
        raise UsageError(f"'{name}' is not a checkpoint: no {' and no '.join(missing)}; expected {EXPECTED}; "
                         f"it holds: {_holds(path)}")
    try:
        json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"'{name}/config.json' is not valid JSON ({e}); the checkpoint is corrupted") from None
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            wanted = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, AttributeError) as e:
            raise UsageError(f"'{index}' is unreadable ({e}); the checkpoint is corrupted") from None
        if lost := sorted(w for w in wanted if not (path / w).is_file()):
            raise UsageError(f"'{name}' is a partial checkpoint: shard {lost[0]} listed in {index.name} is missing")
    if damage := damaged_weights(str(path)):
        raise UsageError(damage)


@dataclass(frozen=True)
class Target:
    name: str  # as written on the command line: latest | best | base | a path
    path: Path  # the model directory holding config.json and *.safetensors (a LoRA checkpoint: its adapter files)
    beside: bool  # whether a lone eval's eval.json goes into `path` (not for base: it is not the run's)
    base: Path | None = None  # a LoRA checkpoint's base model directory (the run's model.name_or_path); None: a whole model

    @property
    def model_dir(self) -> Path:
        """The directory with the whole model's config.json and weights: the base under an adapter."""
        return self.base or self.path

    @property
    def label(self) -> str:
        return self.name if self.name in KEYWORDS else self.path.name


def _base_path(name_or_path: str) -> Path:
    """The run's (or recipe's) starting model as a local directory; a hub id must already be in the local cache."""
    try:
        resolved = resolve_model_path(name_or_path)
    except FileNotFoundError as e:
        raise UsageError(f"base: {e}") from None
    if Path(resolved).is_dir():
        return Path(resolved)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(resolved, local_files_only=True))
    except Exception:
        raise UsageError(f"base: model.name_or_path='{name_or_path}' is neither a local directory nor in the local "
                         "hub cache; download it and pass checkpoint=DIR") from None


def resolve(name: str, run_dir: Path | None, model_name_or_path: str) -> Target:
    """One command-line name -> a checked Target."""
    if name in ("latest", "best"):
        if run_dir is None:
            raise UsageError(f"checkpoint={name} needs run=DIR, the run directory whose checkpoints it picks from")
        found = list_checkpoints(run_dir)
        if not found:
            raise UsageError(f"run directory '{run_dir}' has no complete checkpoint for checkpoint={name}; "
                             f"{_run_listing(run_dir)}")
        if name == "latest":
            path = found[-1][0]
        else:
            scored = [(float(info[BEST_KEY]), position, path)  # a tie goes to the later checkpoint
                      for position, (path, info) in enumerate(found) if isinstance(info.get(BEST_KEY), (int, float))]
            if not scored:
                raise UsageError(f"no best checkpoint is recorded in '{run_dir}': no {COMPLETE_MARKER} there holds a "
                                 f"held-out pass@1 ({BEST_KEY}); use checkpoint=latest or a path "
                                 f"({_run_listing(run_dir)})")
            path = max(scored)[2]
        check_checkpoint(path, str(path))
        return Target(name, path, beside=True, base=adapter_base_dir(path, model_name_or_path))
    if name == "base":
        path = _base_path(model_name_or_path)
        check_checkpoint(path, str(path))
        return Target(name, path, beside=False)
    path = Path(name)
    check_checkpoint(path, name)
    return Target(name, path, beside=True, base=adapter_base_dir(path, model_name_or_path))


def adapter_base_dir(path: Path, model_name_or_path: str) -> Path | None:
    """The base model a LoRA checkpoint is served on: the run's (or recipe's) model.name_or_path; None for a
    whole model."""
    return _base_path(model_name_or_path) if is_adapter_dir(path) else None
