"""Where a run's metrics go: RUN_DIR/metrics.jsonl and completions.jsonl always, Weights & Biases when on.

The loop talks to one logger and never branches on what is behind it:

    logger = make_logger(cfg.logging, run_dir, resolved_config)  # metrics.jsonl (+ wandb when on)
    logger.log(metrics, step); logger.log_samples(samples, step); logger.close()

wandb is imported only when logging.wandb is on.
"""

from __future__ import annotations

import dataclasses
import json
import netrc
import os
from pathlib import Path
from typing import Any, Protocol, TextIO
from urllib.parse import urlsplit

from grpo_cli.errors import UsageError
from grpo_cli.prompts.images import image_name, is_image
from grpo_cli.step.metrics import as_number


class Logger(Protocol):
    def log(self, metrics: dict[str, Any], step: int) -> None: ...

    def log_samples(self, samples: list[dict[str, Any]], step: int) -> None: ...

    def close(self) -> None: ...


def jsonable(value: Any) -> Any:
    """json.dumps fallback: tensors / numpy scalars to Python numbers, an image to its name, anything else to str."""
    if is_image(value):
        return image_name(value)
    if hasattr(value, "item"):
        try:
            return value.item()
        except (ValueError, RuntimeError):  # a tensor of more than one element
            pass
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


class NullLogger:
    """Logs nothing: stands in for wandb when it is off, and for every logger on ranks other than 0."""
    notes: list[str] = []  # nothing to say at start

    def log(self, metrics: dict[str, Any], step: int) -> None:
        pass

    def log_samples(self, samples: list[dict[str, Any]], step: int) -> None:
        pass

    def close(self) -> None:
        pass


class JsonlLogger:
    """RUN_DIR/metrics.jsonl (one object per step) and RUN_DIR/completions.jsonl (one object per sample).

    Files are appended to and flushed after every line, so a crashed or running run can be plotted.
    """

    def __init__(self, run_dir: Path | str) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.samples_path = self.run_dir / "completions.jsonl"
        self._metrics = open(self.metrics_path, "a", encoding="utf-8")
        self._samples: TextIO | None = None  # opened on the first samples, so runs without any have no file

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self._metrics.write(json.dumps({"step": step, **metrics}, default=jsonable) + "\n")
        self._metrics.flush()

    def log_samples(self, samples: list[dict[str, Any]], step: int) -> None:
        if self._samples is None:
            self._samples = open(self.samples_path, "a", encoding="utf-8")
        for sample in samples:
            self._samples.write(json.dumps({"step": step, **sample}, default=jsonable, ensure_ascii=False) + "\n")
        self._samples.flush()

    def close(self) -> None:
        self._metrics.close()
        if self._samples is not None:
            self._samples.close()


def wandb_api_key_configured() -> bool:
    """True when wandb could log in without asking: WANDB_API_KEY, or a netrc entry for the wandb host."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlsplit(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).netloc
    path = os.environ.get("NETRC") or str(Path.home() / ".netrc")
    try:
        return bool(host) and netrc.netrc(path).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def wandb_mode() -> str:
    """The mode a run gets: WANDB_MODE when set, else online with a configured key and offline without one."""
    mode = os.environ.get("WANDB_MODE", "").strip().lower()
    if mode:
        return {"dryrun": "offline", "run": "online"}.get(mode, mode)
    return "online" if wandb_api_key_configured() else "offline"


class WandbLogger:
    """A Weights & Biases run inside the run directory (RUN_DIR/wandb/...), with the training step as x-axis.

    Never prompts: without an API key the run is offline (upload later with `wandb sync DIR`).
    """

    def __init__(self, cfg: Any, run_dir: Path | str, resolved_config: Any) -> None:
        run_dir = Path(run_dir)
        self.mode = wandb_mode()
        if self.mode == "online" and not wandb_api_key_configured():
            raise UsageError("WANDB_MODE=online but no wandb API key is configured; run `wandb login`, set "
                             "WANDB_API_KEY, or unset WANDB_MODE to log offline")
        os.environ.setdefault("WANDB_SILENT", "true")  # no banners, no login prompt
        try:
            import wandb
        except ImportError:
            raise UsageError("logging.wandb=true needs the wandb package: pip install wandb") from None
        if dataclasses.is_dataclass(resolved_config):
            resolved_config = dataclasses.asdict(resolved_config)
        self._wandb = wandb
        self.run = wandb.init(
            project=cfg.wandb_project,
            dir=str(run_dir),
            config=resolved_config,
            name=run_dir.name,
            mode=self.mode,  # type: ignore[arg-type]
            # console="off": wandb does not wrap stdout, which would fight the live view.
            settings=wandb.Settings(silent=True, console="off"),
        )
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")  # every chart's x-axis is the training step
        self.local_dir = Path(self.run.dir).parent  # RUN_DIR/wandb/offline-run-... (or run-...)
        self._closed = False

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self.run.log({**metrics, "step": step})

    def log_samples(self, samples: list[dict[str, Any]], step: int) -> None:
        if not samples:
            return
        names = sorted({name for s in samples for name in s.get("rewards", {})})
        columns = ["step", "prompt", "completion", "advantage", *(f"reward/{n}" for n in names)]
        rows = [[step, str(s.get("prompt", "")), str(s.get("completion", "")), as_number(s.get("advantage")),
                 *(as_number(s.get("rewards", {}).get(n)) for n in names)] for s in samples]
        self.run.log({"samples": self._wandb.Table(columns=columns, data=rows), "step": step})

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.run.finish()
            # finish() can return before wandb's service has written the records to the offline file (seen
            # once, under load: the file held its header only); teardown waits for the service to exit, so the
            # run on disk is whole when `grpo train` returns.
            self._wandb.teardown()


class FanoutLogger:
    """Sends every call to each logger: JSONL always, wandb or nothing."""

    def __init__(self, loggers: list[Any], notes: list[str] | None = None) -> None:
        self.loggers = loggers
        self.notes = notes or []  # lines worth printing once at start (e.g. where the offline wandb run is)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        for logger in self.loggers:
            logger.log(metrics, step)

    def log_samples(self, samples: list[dict[str, Any]], step: int) -> None:
        for logger in self.loggers:
            logger.log_samples(samples, step)

    def close(self) -> None:
        errors = []
        for logger in self.loggers:
            try:
                logger.close()
            except Exception as e:  # close the others anyway
                errors.append(e)
        if errors:
            raise errors[0]


def make_logger(cfg: Any, run_dir: Path | str, resolved_config: Any) -> FanoutLogger:
    """metrics.jsonl + completions.jsonl always; wandb when `cfg.wandb` (a LoggingConfig) is on."""
    loggers: list[Any] = [JsonlLogger(run_dir)]
    notes: list[str] = []
    if cfg.wandb:
        wb = WandbLogger(cfg, run_dir, resolved_config)
        loggers.append(wb)
        if wb.mode == "offline":
            notes.append(f"wandb: offline run in {wb.local_dir}; upload it with `wandb sync {wb.local_dir}`")
        elif wb.mode == "online":
            notes.append(f"wandb: {wb.run.url}")
    else:
        loggers.append(NullLogger())
    return FanoutLogger(loggers, notes)
