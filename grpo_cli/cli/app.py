"""A command's `@hydra.main` app: its runner called with the validated config, and what a failure leaves
(one stderr line, the traceback in the run's log, no run directory for a refusal)."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from grpo_cli.cli.commands import COMMANDS
from grpo_cli.cli.messages import fail, validate
from grpo_cli.config import COMMAND_SCHEMAS
from grpo_cli.dist.launch import log_name, rank
from grpo_cli.errors import RunFailure, UsageError
from grpo_cli.runtime import quiet_third_party

log = logging.getLogger("grpo_cli")


def peer_failed(exc: BaseException) -> bool:
    """Whether a collective failed because another rank's process went away (gloo: "Connection closed by
    peer"): then this rank's error is a consequence, left to its log file."""
    text = str(exc)
    return "closed by peer" in text or "reset by peer" in text

def holds_only_setup_files(run_dir: Path) -> bool:
    """Whether a run directory holds only what Hydra and the start wrote (its config, .hydra, logs): nothing of a
    run (metrics, checkpoints, samples) that a refusal must not delete; a resumed run's holds its metrics."""
    return run_dir.is_dir() and all(p.name in ("config.yaml", ".hydra") or p.suffix == ".log" for p in run_dir.iterdir())

def remove_empty_task_dir(run_dir: Path) -> None:
    """runs/TASK/ when the refused run's folder was all it held (output_dir itself stays: it may be the user's)."""
    try:
        run_dir.parent.rmdir()
    except OSError:
        pass

def log_to_file_only(message: str) -> None:
    """A line for the run's log file, not the terminal (the terminal gets the one stderr line)."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.emit(logging.LogRecord("grpo_cli", logging.ERROR, __file__, 0, message, None, None))

def make_app(command: str) -> Callable[[], Any]:
    import hydra

    spec = COMMANDS[command]

    def task(cfg: Any) -> None:
        from hydra.core.hydra_config import HydraConfig
        from omegaconf import OmegaConf


        try:
            config = validate(cfg, COMMAND_SCHEMAS[command])
        except UsageError as e:
            fail(command, str(e))

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
            if run_dir is not None and rank() == 0 and holds_only_setup_files(run_dir):
                import shutil

                for handler in [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]:
                    handler.close()  # the run's log file is closed before its folder goes
                    logging.getLogger().removeHandler(handler)
                shutil.rmtree(run_dir, ignore_errors=True)
                remove_empty_task_dir(run_dir)
            elif run_dir is not None:
                log_to_file_only(f"grpo {command}: error: {who}{e}")
            fail(command, who + str(e))
        except RunFailure as e:  # explained in one line; the traceback goes to the run's log
            log.exception("grpo %s stopped", command)
            fail(command, who + str(e), code=1)
        except KeyboardInterrupt:
            raise
        except Exception as e:
            # Full traceback to the run's log file; one line on the terminal.
            log.exception("grpo %s crashed", command)
            if who and peer_failed(e):  # another rank died first: its line and the launcher's say why
                if os.environ.get("LOCAL_WORLD_SIZE") == os.environ.get("WORLD_SIZE"):
                    sys.exit(1)  # one node: the failed rank's own line is on this terminal
                fail(command, f"{who}stopped: another rank's process went away (its node's output says why)",
                      code=1)
            where = f" (traceback in {run_dir / log_name(command, rank())})" if run_dir else ""
            fail(command, f"{who}{type(e).__name__}: {e}{where}", code=1)
        if code:
            sys.exit(code)

    # Every config comes from the ConfigStore. A task function defined in a module makes Hydra add that
    # module's package (pkg://grpo_cli) to the config search path, where a subpackage such as
    # grpo_cli/rewards would be a config group shadowing the `rewards` key ("Could not override
    # 'rewards'"); one in __main__ with config_path=None gets no search path directory at all
    # (hydra._internal.utils.detect_calling_file_or_module_from_task_function).
    task.__module__ = "__main__"
    return hydra.main(version_base=None, config_path=None, config_name=command)(task)
