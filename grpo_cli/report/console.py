"""What a run shows on the terminal: a rich live view on a terminal, plain lines in a pipe or CI, and
the closing summary.

    console = make_console(steps, cfg.logging.every)  # live on a terminal, plain lines elsewhere
    console.start(); console.update(metrics); console.samples(samples, step)
    console.warn(message); console.info(message); console.close()

rich is imported only by the live view.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from grpo_cli.step.metrics import TIME_PARTS, TIME_SHORT, as_number, reward_functions

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
            extra = [f"greedy {_f(m['eval/greedy_accuracy'])}"] if "eval/greedy_accuracy" in m else []
            if "eval/tools/call_share" in m:  # a tool run: how many held-out samples (greedy ones) call a tool
                extra.append(f"calling {_f(m['eval/tools/call_share'], '.2f')}"
                             + (f"/{_f(m['eval/greedy_call_share'], '.2f')}" if "eval/greedy_call_share" in m else ""))
            parts.append(f"held-out pass@1 {_f(m['eval/pass@1'])}" + (f" ({', '.join(extra)})" if extra else "")
                         + (" (baseline)" if step == 0 else ""))
        if "eval/teacher_pass@1" in m:  # distill.teacher's, once at the start: what the student climbs towards
            parts.append(f"teacher's held-out pass@1 {_f(m['eval/teacher_pass@1'])}")
        if "kl" in m:
            parts.append(f"kl {_f(m['kl'], '.4f')} clip {_f(m.get('clip_frac'), '.3f')}")
        if "distill/reverse_kl" in m:  # on-policy distillation: the student's reverse KL to the teacher, per token
            parts.append(f"teacher kl {_f(m['distill/reverse_kl'], '.4f')}/tok {_f(m.get('distill/reverse_kl_per_seq'), '.2f')}/seq")
        if "completion_len/mean" in m:
            parts.append(f"len {_f(m['completion_len/mean'], '.1f')}/{_f(m.get('completion_len/max'), '.0f')} "
                         f"trunc {_f(m.get('truncation_rate'), '.2f')}")
        if "tools/calls_per_sample" in m:  # a tool run
            parts.append(f"tools {_f(m['tools/calls_per_sample'], '.2f')}/sample (failed "
                         f"{_f(m.get('tools/failed_per_sample'), '.2f')}) turns {_f(m.get('tools/turns_per_sample'), '.2f')}")
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
            completion = _shorten(s.get("trajectory", s.get("completion", "")), 120, "both", "\\n", "...")
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
            [("teacher KL / token", val("distill/reverse_kl", ".4f")),
             ("teacher KL / sample", val("distill/reverse_kl_per_seq", ".2f"))] if "distill/reverse_kl" in m else [],
            [("length mean / max", f"{val('completion_len/mean', '.1f')} / {val('completion_len/max', '.0f')}"),
             ("truncated", val("truncation_rate", ".1%"))],
            [("tool calls / sample", val("tools/calls_per_sample", ".2f")),
             ("samples calling", val("tools/call_share", pct=True))] if "tools/calls_per_sample" in m else [],
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
            adv = as_number(s.get("advantage"))
            style = "green" if adv is not None and adv > 0 else ("red" if adv is not None and adv < 0 else "")
            # Text(...) and not a str: completions may contain [brackets] that rich would read as markup.
            table.add_row(Text(_shorten(s.get("prompt", ""), 80, "end", " ⏎ ", "…")),
                          Text(_shorten(s.get("trajectory", s.get("completion", "")), 200, "both", " ⏎ ", "…")),
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
