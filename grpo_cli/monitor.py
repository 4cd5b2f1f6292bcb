"""Watching a run: metric loggers (JSONL, wandb), the console view, warnings, the closing summary.

The training loop talks to two objects and never branches on what is behind them:

    logger = make_logger(cfg.logging, run_dir, resolved_config)  # metrics.jsonl (+ wandb when on)
    console = make_console(steps, cfg.logging.every)  # a rich live view on a terminal, plain lines otherwise
    console.start()
    ... each step: logger.log(metrics, step); console.update(metrics)
    ... every N steps: logger.log_samples(samples, step); console.samples(samples, step)
    console.close(); logger.close()

Nothing heavy is imported at module level: rich and wandb load when first used.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import math
import netrc
import os
import sys
import time
from pathlib import Path
from typing import Any, Protocol, TextIO
from urllib.parse import urlsplit

REWARD_PREFIX = "reward/"
REWARD_STATS = ("reward/mean", "reward/std", "reward/failures", "reward/dropped")  # reward/* keys that are not a reward function
# the step-time split, in loop order; sleep: vLLM's sleep and wake-ups (and the optimizer-state offload)
TIME_PARTS = ("generate", "reward", "logprobs", "update", "push", "sleep")
TIME_SHORT = {"generate": "gen", "reward": "rew", "logprobs": "lp", "update": "upd", "push": "push", "sleep": "slp"}


class StepTimer(dict):
    """Seconds per phase of a step, `{"generate": 1.0, ...}`: `with timings("update"): ...` times one
    (a phase timed twice in a step, e.g. several sampling rounds, adds up)."""

    def __call__(self, phase: str) -> Any:
        import contextlib

        @contextlib.contextmanager
        def timed() -> Any:
            tick = time.time()
            try:
                yield
            finally:
                self[phase] = self.get(phase, 0.0) + (time.time() - tick)

        return timed()


# ---------------------------------------------------------------------------
# loggers: log(metrics, step), log_samples(samples, step), close()


class Logger(Protocol):
    def log(self, metrics: dict[str, Any], step: int) -> None: ...

    def log_samples(self, samples: list[dict[str, Any]], step: int) -> None: ...

    def close(self) -> None: ...


def _jsonable(value: Any) -> Any:
    """json.dumps fallback: tensors / numpy scalars to Python numbers, anything else to str."""
    if hasattr(value, "item"):
        try:
            return value.item()
        except (ValueError, RuntimeError):  # a tensor of more than one element
            pass
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


class NullLogger:
    """Logs nothing: stands in for wandb when it is off."""

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
        self._metrics.write(json.dumps({"step": step, **metrics}, default=_jsonable) + "\n")
        self._metrics.flush()

    def log_samples(self, samples: list[dict[str, Any]], step: int) -> None:
        if self._samples is None:
            self._samples = open(self.samples_path, "a", encoding="utf-8")
        for sample in samples:
            self._samples.write(json.dumps({"step": step, **sample}, default=_jsonable, ensure_ascii=False) + "\n")
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
        from grpo_cli.errors import UsageError

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
        rows = [[step, str(s.get("prompt", "")), str(s.get("completion", "")), _number(s.get("advantage")),
                 *(_number(s.get("rewards", {}).get(n)) for n in names)] for s in samples]
        self.run.log({"samples": self._wandb.Table(columns=columns, data=rows), "step": step})

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.run.finish()


def _number(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


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


# ---------------------------------------------------------------------------
# formatting helpers


def _fmt_duration(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "--"
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


def _f(value: Any, spec: str = ".3f") -> str:
    if value is None:
        return "--"
    try:
        return format(float(value), spec)
    except (TypeError, ValueError):
        return str(value)


def reward_functions(metrics: dict[str, Any]) -> dict[str, float]:
    """Each reward function's mean, from the `reward/<fn>` keys."""
    return {k[len(REWARD_PREFIX):]: v for k, v in metrics.items()
            if k.startswith(REWARD_PREFIX) and k not in REWARD_STATS}


def _shorten(text: str, width: int, keep: str, newline: str, ellipsis: str) -> str:
    """One line of at most `width` characters; keep the "end", the "start", or "both" ends of the text."""
    text = str(text).replace("\r", "").replace("\n", newline)
    if len(text) <= width:
        return text
    room = width - len(ellipsis)
    if keep == "end":
        return ellipsis + text[-room:]
    if keep == "start":
        return text[:room] + ellipsis
    head = room * 2 // 3
    return text[:head] + ellipsis + text[len(text) - (room - head):]


def _rewards_text(rewards: dict[str, Any]) -> str:
    return " ".join(f"{name}={_f(v, '.2f')}" for name, v in rewards.items())


class _Clock:
    """Elapsed time and ETA from wall-clock time per step since the baseline (model loading excluded)."""

    def __init__(self, total_steps: int) -> None:
        self.total_steps = total_steps
        self.ref_time = time.time()
        self.ref_step = 0

    def mark(self, step: int) -> None:
        if step == 0:  # the baseline evaluation just finished: step 1 starts now
            self.ref_time, self.ref_step = time.time(), 0

    def eta(self, step: int) -> float | None:
        done = step - self.ref_step
        if done <= 0:
            return None
        return (time.time() - self.ref_time) / done * max(self.total_steps - step, 0)


# ---------------------------------------------------------------------------
# console: start(), update(metrics), samples(samples, step), warn(msg), info(msg), close()


class PlainConsole:
    """For pipes, files and CI: one plain line every `log_every` steps (and on eval steps and the last step)."""

    def __init__(self, total_steps: int, log_every: int, file: TextIO | None = None) -> None:
        self.total_steps = total_steps
        self.log_every = max(1, log_every)
        self._file = file
        self._clock = _Clock(total_steps)

    @property
    def file(self) -> TextIO:
        return self._file or sys.stdout

    def _print(self, text: str) -> None:
        print(text, file=self.file, flush=True)

    def start(self) -> None:
        self._clock = _Clock(self.total_steps)

    def update(self, metrics: dict[str, Any]) -> None:
        step = int(metrics.get("step", 0))
        self._clock.mark(step)
        measured = "eval/pass@1" in metrics
        if step % self.log_every == 0 or step == self.total_steps or measured:
            self._print(self.format_line(metrics))

    def format_line(self, m: dict[str, Any]) -> str:
        step = int(m.get("step", 0))
        width = len(str(self.total_steps))
        parts = [f"step {step:>{width}}/{self.total_steps}"]
        if "reward/mean" in m:
            fns = reward_functions(m)
            detail = f" ({', '.join(f'{k} {_f(v)}' for k, v in fns.items())})" if fns else ""
            parts.append(f"reward {_f(m['reward/mean'])}{detail}")
        if "eval/pass@1" in m:
            parts.append(f"held-out pass@1 {_f(m['eval/pass@1'])}" + (" (baseline)" if step == 0 else ""))
        if "kl" in m:
            parts.append(f"kl {_f(m['kl'], '.4f')} clip {_f(m.get('clip_frac'), '.3f')}")
        if "completion_len/mean" in m:
            parts.append(f"len {_f(m['completion_len/mean'], '.1f')}/{_f(m.get('completion_len/max'), '.0f')} "
                         f"trunc {_f(m.get('truncation_rate'), '.2f')}")
        if "groups/all_correct_frac" in m:
            parts.append(f"all-right {_f(m['groups/all_correct_frac'], '.2f')} "
                         f"all-wrong {_f(m.get('groups/all_wrong_frac'), '.2f')}")
        if "grad_norm" in m:
            parts.append(f"gnorm {_f(m['grad_norm'], '.3g')} lr {_f(m.get('lr'), '.1e')}")
        if "tokens_per_s" in m:
            parts.append(f"{_f(m['tokens_per_s'], '.0f')} tok/s")
        if "time/step" in m:
            split = " ".join(f"{TIME_SHORT[k]} {_f(m[f'time/{k}'], '.1f')}" for k in TIME_PARTS if f"time/{k}" in m)
            parts.append(f"{_f(m['time/step'], '.1f')}s ({split})")
        if step > 0:
            parts.append(f"eta {_fmt_duration(self._clock.eta(step))}")
        return " | ".join(parts)

    def samples(self, samples: list[dict[str, Any]], step: int) -> None:
        if not samples:
            return
        self._print(f"samples at step {step}:")
        for s in samples:
            prompt = _shorten(s.get("prompt", ""), 60, "end", "\\n", "...")
            completion = _shorten(s.get("completion", ""), 120, "both", "\\n", "...")
            self._print(f"  adv {_f(s.get('advantage'), '+.2f')} | {_rewards_text(s.get('rewards', {}))} | "
                        f"prompt: {prompt} | completion: {completion}")

    def warn(self, message: str) -> None:
        self._print(f"warning: {message}")

    def info(self, message: str) -> None:
        self._print(message)

    def close(self) -> None:
        self.file.flush()


class LiveConsole:
    """For a terminal: a rich Live view with a step progress bar and a panel of the latest metrics."""

    def __init__(self, total_steps: int, log_every: int, file: TextIO | None = None) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.total_steps = total_steps
        self.console = Console(file=file, force_terminal=True if file is not None else None, highlight=False)
        self.progress = Progress(
            TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(), TextColumn("elapsed"),
            TimeElapsedColumn(), TextColumn("eta {task.fields[eta]}"), console=self.console)
        self._task = self.progress.add_task("train", total=total_steps, eta="--", start=False)
        self._clock = _Clock(total_steps)
        self.latest: dict[str, Any] = {}
        self.last_eval: tuple[int, float] | None = None  # (step, held-out pass@1) of the last measurement
        self._live: Any = None
        self._handlers: list[tuple[logging.StreamHandler, Any]] = []

    def start(self) -> None:
        from rich.live import Live

        self._clock = _Clock(self.total_steps)
        self.progress.start_task(self._task)
        self._live = Live(self._render(), console=self.console, refresh_per_second=2, transient=False,
                          redirect_stdout=True, redirect_stderr=True)
        self._live.start()
        # Log handlers made before the live view hold the real stdout/stderr and would write through it:
        # point them at the live view's proxies (lines appear above the view) until close().
        for handler in {h for lg in (logging.getLogger(), logging.getLogger("grpo_cli")) for h in lg.handlers}:
            if type(handler) is logging.StreamHandler and handler.stream in (sys.__stdout__, sys.__stderr__):
                proxy = sys.stdout if handler.stream is sys.__stdout__ else sys.stderr
                self._handlers.append((handler, handler.setStream(proxy)))

    def update(self, metrics: dict[str, Any]) -> None:
        step = int(metrics.get("step", 0))
        self._clock.mark(step)
        if "eval/pass@1" in metrics:
            self.last_eval = (step, float(metrics["eval/pass@1"]))
        if step > 0 or not self.latest:
            self.latest = dict(metrics)
        self.progress.update(self._task, completed=step, eta=_fmt_duration(self._clock.eta(step)))
        if self._live is not None:
            self._live.update(self._render(), refresh=True)

    def _render(self) -> Any:
        from rich.console import Group
        from rich.panel import Panel
        from rich.table import Table
        from rich.text import Text

        m = self.latest
        step = int(m.get("step", 0))

        def val(key: str, spec: str = ".3f", pct: bool = False) -> str:
            if key not in m:
                return "--"
            return f"{float(m[key]):.0%}" if pct else _f(m[key], spec)

        evaluated = (f"{self.last_eval[1]:.3f} (step {self.last_eval[0]})" if self.last_eval else "not yet")
        sections: list[list[tuple[str, str]]] = [
            [("reward", val("reward/mean")), ("held-out pass@1", evaluated)],
            [(f"  {name}", _f(v)) for name, v in reward_functions(m).items()],
            [("KL", val("kl", ".4f")), ("clip frac", val("clip_frac"))],
            [("length mean / max", f"{val('completion_len/mean', '.1f')} / {val('completion_len/max', '.0f')}"),
             ("truncated", val("truncation_rate", ".1%"))],
            [("all-correct groups", val("groups/all_correct_frac", pct=True)),
             ("all-wrong groups", val("groups/all_wrong_frac", pct=True))],
            [("grad norm", val("grad_norm", ".3g")), ("lr", val("lr", ".2e"))],
            [("tokens/s", val("tokens_per_s", ".0f")), ("step time", f"{val('time/step', '.2f')}s")],
        ]
        grid = Table.grid(padding=(0, 2))
        for style in ("dim", "bold", "dim", "bold"):
            grid.add_column(style=style)
        for items in sections:
            items = items + [("", "")] * (len(items) % 2)
            for i in range(0, len(items), 2):
                grid.add_row(items[i][0], items[i][1], items[i + 1][0], items[i + 1][1])
        split = Text("time: ", style="dim")
        total = float(m.get("time/step") or 0.0)
        for i, part in enumerate(TIME_PARTS):
            if f"time/{part}" in m:
                sec = float(m[f"time/{part}"])
                share = f" {sec / total:.0%}" if total > 0 else ""
                split.append(("  " if i else "") + f"{part} ", style="dim")
                split.append(f"{sec:.2f}s{share}")
        panel = Panel(Group(grid, split), title=f"latest metrics (step {step})", title_align="left",
                      border_style="blue", expand=False)
        return Group(self.progress, panel)

    def samples(self, samples: list[dict[str, Any]], step: int) -> None:
        from rich.table import Table
        from rich.text import Text

        if not samples:
            return
        table = Table(title=f"samples at step {step}", title_justify="left", show_lines=False, expand=False)
        table.add_column("prompt", max_width=40, overflow="fold")
        table.add_column("completion", max_width=70, overflow="fold")
        table.add_column("rewards")
        table.add_column("adv", justify="right")
        for s in samples:
            adv = _number(s.get("advantage"))
            style = "green" if adv is not None and adv > 0 else ("red" if adv is not None and adv < 0 else "")
            # Text(...) and not a str: completions may contain [brackets] that rich would read as markup.
            table.add_row(Text(_shorten(s.get("prompt", ""), 80, "end", " ⏎ ", "…")),
                          Text(_shorten(s.get("completion", ""), 200, "both", " ⏎ ", "…")),
                          Text(_rewards_text(s.get("rewards", {}))), Text(_f(adv, "+.2f"), style=style))
        self.console.print(table)

    def warn(self, message: str) -> None:
        from rich.text import Text

        self.console.print(Text("warning: ", style="bold yellow") + Text(message))

    def info(self, message: str) -> None:
        from rich.text import Text

        self.console.print(Text(message))

    def close(self) -> None:
        for handler, stream in self._handlers:
            handler.setStream(stream)
        self._handlers = []
        if self._live is not None:
            self._live.update(self._render(), refresh=True)
            self._live.stop()
            self._live = None


def make_console(total_steps: int, log_every: int, force_plain: bool | None = None,
                 file: TextIO | None = None) -> PlainConsole | LiveConsole:
    """A live rich view on a terminal, plain lines elsewhere; `force_plain` overrides the detection.

    `file` (default: sys.stdout) is where the output goes; with force_plain=False it is treated as a terminal.
    """
    if force_plain is None:
        stream = file or sys.stdout
        is_tty = hasattr(stream, "isatty") and stream.isatty()
        force_plain = not is_tty or os.environ.get("TERM") == "dumb"
    if force_plain:
        return PlainConsole(total_steps, log_every, file)
    return LiveConsole(total_steps, log_every, file)


# ---------------------------------------------------------------------------
# zero-variance watch


class ZeroVarianceWatch:
    """Warns once per case when groups stop carrying signal: "too hard" (all wrong) or "too easy" (all right).

    A group whose rewards are all equal has zero advantages. Fed every step; `update` returns a message the
    first time a case holds for `patience` consecutive steps, then None for that case for the rest of the run.
    """

    def __init__(self, threshold: float = 0.9, patience: int = 10) -> None:
        if not 0 < threshold <= 1:
            raise ValueError(f"zero-variance threshold must be in (0, 1], got {threshold}")
        if patience < 1:
            raise ValueError(f"zero-variance patience must be >= 1, got {patience}")
        self.threshold = threshold
        self.patience = patience
        self.fired: set[str] = set()  # "too hard" / "too easy"
        self._window: collections.deque[tuple[float, float]] = collections.deque(maxlen=patience)
        self._zero_steps = 0  # consecutive steps where every sample's reward was 0

    def check(self, metrics: dict[str, Any]) -> str | None:
        """`update` from a step's metrics dict; rows without group statistics (e.g. step 0) are skipped."""
        if "groups/all_correct_frac" not in metrics or "reward/mean" not in metrics:
            return None
        return self.update(metrics["groups/all_correct_frac"], metrics["groups/all_wrong_frac"],
                           metrics["reward/mean"], metrics.get("reward/std"))

    def update(self, all_correct_frac: float, all_wrong_frac: float, reward_mean: float,
               reward_std: float | None = None) -> str | None:
        correct, wrong = float(all_correct_frac), float(all_wrong_frac)
        if reward_std is not None:
            all_zero = abs(float(reward_mean)) < 1e-12 and float(reward_std) < 1e-12
        else:
            all_zero = abs(float(reward_mean)) < 1e-12 and wrong >= 1.0 - 1e-9
        self._zero_steps = self._zero_steps + 1 if all_zero else 0
        if correct + wrong >= self.threshold:
            self._window.append((correct, wrong))
        else:
            self._window.clear()

        if "too hard" not in self.fired and self._zero_steps >= self.patience:
            self.fired.add("too hard")
            return (f"too hard: every sample scored reward 0 for the last {self._zero_steps} steps, so no group "
                    "carries a learning signal. The reward may be rejecting the answer format: check it on "
                    "hand-written completions with `grpo reward recipe=NAME cases=FILE.jsonl`; also try easier "
                    "data or a larger rollout.max_new_tokens if answers are cut off (see truncation_rate).")
        if len(self._window) < self.patience:
            return None
        mean_correct = sum(c for c, _ in self._window) / len(self._window)
        mean_wrong = sum(w for _, w in self._window) / len(self._window)
        case = "too hard" if mean_wrong >= mean_correct else "too easy"
        if case in self.fired:
            return None
        self.fired.add(case)
        n = len(self._window)
        if case == "too hard":
            return (f"too hard: on average {mean_wrong:.0%} of groups scored all wrong over the last {n} steps "
                    f"({mean_correct:.0%} all right), so most groups carry no learning signal. Use easier data "
                    "(e.g. lower data.tiers), a larger rollout.max_new_tokens if answers are cut off (see "
                    "truncation_rate), or check the reward format with `grpo reward recipe=NAME cases=FILE.jsonl`.")
        return (f"too easy: on average {mean_correct:.0%} of groups scored all right over the last {n} steps "
                f"({mean_wrong:.0%} all wrong), so most groups carry no learning signal. Use harder data "
                "(e.g. higher data.tiers) or fewer trainer.steps: the model already solves this task.")


# ---------------------------------------------------------------------------
# end-of-run summary


def summary_lines(history: list[dict[str, Any]], run_dir: Path | str, wall_s: float) -> list[str]:
    """A few plain lines for the end of a run: steps, wall time, held-out pass@1, where the files are."""
    run_dir = Path(run_dir)
    steps = max((int(m.get("step", 0)) for m in history), default=0)
    lines = [f"done: {steps} steps in {_fmt_duration(wall_s)} | run dir {run_dir}"]
    evals = [(int(m.get("step", 0)), float(m["eval/pass@1"])) for m in history if "eval/pass@1" in m]
    if evals:
        best_step, best = max(evals, key=lambda e: (e[1], -e[0]))
        first_step, first = evals[0]
        final_step, final = evals[-1]
        lines.append(f"held-out pass@1: {first:.3f} at step {first_step} -> final {final:.3f} at step {final_step}"
                     f" | best {best:.3f} at step {best_step}")
    else:
        lines.append("held-out pass@1: not measured")
    checkpoints = run_dir / "checkpoints"
    if checkpoints.is_dir():
        names = sorted(p.name for p in checkpoints.iterdir() if p.is_dir())
        lines.append(f"checkpoints: {checkpoints}" + (f" ({', '.join(names)})" if names else ""))
    else:
        lines.append("checkpoints: none saved")
    files = [f"metrics {run_dir / 'metrics.jsonl'}"]
    if (run_dir / "completions.jsonl").is_file():
        files.append(f"samples {run_dir / 'completions.jsonl'}")
    lines.append(" | ".join(files))
    plot = run_dir / "metrics.png"
    lines.append(f"plot: {plot}" if plot.is_file() else f"plot: not written; make one with `grpo plot run={run_dir}`")
    for offline in sorted((run_dir / "wandb").glob("offline-run-*")):
        lines.append(f"wandb: offline run {offline}; upload with `wandb sync {offline}`")
    return lines


# ---------------------------------------------------------------------------
# third-party chatter

QUIET_ENV = {
    "VLLM_LOGGING_LEVEL": "ERROR",  # vLLM reads it when first imported
    "TRANSFORMERS_VERBOSITY": "error",
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",  # also turns off transformers' "Loading weights" bars
    "TQDM_DISABLE": "1",  # any other tqdm bar that does not pass disable= itself
}
QUIET_LOGGERS = ("vllm", "transformers", "datasets", "huggingface_hub", "filelock", "urllib3")


def peak_rss_gib() -> float:
    """This process's peak resident memory so far, GiB (host memory: weights, engine, activations on the CPU)."""
    import resource

    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return kib / 2**20


def quiet_third_party(verbose: bool) -> None:
    """Silence vLLM's, datasets' and transformers' progress bars and log chatter, unless `verbose`.

    Call it before those libraries are imported (their env variables are read at import); modules already
    imported are quieted through their own APIs. Variables the user set explicitly are left alone.
    """
    if verbose:
        return
    import warnings

    # vLLM touches a deprecated torch.distributed name at import when a process group exists (a torchrun rank)
    warnings.filterwarnings("ignore", message=r".*torch\.distributed\.reduce_op.* is deprecated", category=FutureWarning)
    user_set = {key for key in QUIET_ENV if key in os.environ}
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    for name in QUIET_LOGGERS:
        if name == "vllm" and "VLLM_LOGGING_LEVEL" in user_set:
            continue
        logging.getLogger(name).setLevel(logging.ERROR)
    if "datasets" in sys.modules:
        try:
            import datasets

            datasets.disable_progress_bars()
            datasets.logging.set_verbosity_error()
        except Exception:  # an odd datasets version: the env variables still apply to new bars
            pass
    if "transformers" in sys.modules:
        try:
            from transformers.utils import logging as hf_logging

            hf_logging.set_verbosity_error()
            hf_logging.disable_progress_bar()
        except Exception:
            pass
    if "huggingface_hub" in sys.modules:
        try:
            from huggingface_hub.utils import disable_progress_bars

            disable_progress_bars()
        except Exception:
            pass
