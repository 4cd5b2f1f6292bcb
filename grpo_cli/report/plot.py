"""`grpo plot`: one PNG of a run's metrics.jsonl, or of several runs overlaid.

Panels: reward and held-out pass@1 (sampled, and greedy when measured; a distillation teacher's as a line);
KL to the reference (and to a teacher); completion length and truncation; zero-variance group fractions; the
step-time split; rollout throughput; and for a run with tools, the share of samples that call one (train,
held-out, greedy) and the calls and turns per sample. Keys missing from a metrics file (an older run) leave a
panel, or a line in it, empty instead of failing. matplotlib is imported only here, through its object API
(Figure + Agg canvas), so no GUI backend or global pyplot state is involved.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from grpo_cli.errors import UsageError
from grpo_cli.step.metrics import REWARD_STATS, TIME_PARTS

TIME_COLORS = ("#66c2a5", "#fc8d62", "#8da0cb", "#e78ac3", "#a6d854", "#ffd92f", "#b3b3b3")  # a palette apart from the runs' C0, C1, ...
PLOT_SUFFIXES = (".png", ".pdf", ".svg")
SMOOTHING = 0.9  # weight of the past in the smoothed line drawn over a noisy per-step series (as trackers do)


# (metrics key, legend name, line style, markers): the reward panel's fixed lines
REWARD_SERIES = [("reward/mean", "train reward (mean)", "-", False), ("eval/pass@1", "held-out pass@1", "--", True),
                 ("eval/greedy_accuracy", "held-out greedy pass@1", "-.", True)]
# A tool run's fourth column, top and bottom: (title, series, y label, y on 0..1)
TOOL_PANELS = [
    ("tool use: samples that call a tool", [("tools/call_share", "train samples", "-", False),
                                            ("eval/tools/call_share", "held-out samples", "--", True),
                                            ("eval/greedy_call_share", "held-out greedy", "-.", True)],
     "share of samples", True),
    ("tool calls and turns per sample", [("tools/calls_per_sample", "calls", "-", False),
                                         ("tools/failed_per_sample", "failed calls", "--", False),
                                         ("tools/turns_per_sample", "model turns", ":", False)], "per sample", False),
]


def smooth(values: list[float], weight: float = SMOOTHING) -> list[float]:
    """Exponential moving average with the start-up bias removed (TensorBoard's smoothing):
    s_t = (weight * m_{t-1} + (1 - weight) * x_t) / (1 - weight^(t+1)), m the raw average.
    The first value is x_0; a constant series stays constant."""
    out, average = [], 0.0
    for t, x in enumerate(values):
        average = weight * average + (1 - weight) * x
        out.append(average / (1 - weight ** (t + 1)))
    return out


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The rows of RUN_DIR/metrics.jsonl; unreadable lines (e.g. one being written) are skipped."""
    path = Path(run_dir) / "metrics.jsonl"
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict):
                rows.append(row)
    return rows


def _series(rows: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of the rows that have `key` with a number."""
    xs, ys = [], []
    for i, row in enumerate(rows):
        value = row.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            xs.append(float(row.get("step", i)))
            ys.append(float(value))
    return xs, ys


def _draw(ax: Any, xs: list[float], ys: list[float], style: str, color: str, markers: bool) -> None:
    """Sparse points (held-out evaluations) as they are; a noisy per-step series faint, its trend on top."""
    if markers or len(ys) < 3:
        ax.plot(xs, ys, linestyle=style, color=color, marker="o" if markers else None, markersize=4, linewidth=1.5)
    else:
        ax.plot(xs, ys, linestyle=style, color=color, linewidth=0.8, alpha=0.25)
        ax.plot(xs, smooth(ys), linestyle=style, color=color, linewidth=1.8)


def _labels(run_dirs: list[Path]) -> list[str]:
    names = [d.resolve().name for d in run_dirs]
    if len(set(names)) == len(names):
        return names
    return [f"{d.resolve().parent.name}/{d.resolve().name}" for d in run_dirs]


def plot_runs(run_dirs: list[Path], out: Path, labels: list[str] | None = None) -> Path:
    """Write one figure of the runs' metrics to `out` (PNG, or PDF/SVG by suffix) and return its path.

    Per-step series are drawn faint with their smoothed line (`smooth`) on top; held-out pass@1
    (a point every eval.every steps) is drawn as it is, with markers.
    """
    # Its first use on a machine logs "generated new fontManager" at INFO, into a training run's output.
    logging.getLogger("matplotlib.font_manager").setLevel(logging.WARNING)
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    run_dirs = [Path(d) for d in run_dirs]
    labels = list(labels) if labels else _labels(run_dirs)
    runs = [read_metrics(d) for d in run_dirs]
    several = len(runs) > 1

    tools = any("tools/call_share" in row for rows in runs for row in rows)  # a tool run gets a fourth column
    fig = Figure(figsize=(21 if tools else 16, 9), dpi=100, layout="constrained")
    axes = fig.subplots(2, 4 if tools else 3)
    title = f"grpo run {labels[0]}" if not several else f"{len(runs)} runs compared"
    fig.suptitle(title, fontsize=13)

    reward_series = list(REWARD_SERIES)
    if not several:  # each reward function's mean too: a stuck format reward shows here first
        names = dict.fromkeys(k for row in runs[0] for k in row if k.startswith("reward/") and k not in REWARD_STATS)
        reward_series += [(k, k.removeprefix("reward/"), ":", False) for k in names]
    _line_panel(axes[0, 0], runs, "reward and held-out accuracy", reward_series, "reward / accuracy")
    _teacher_lines(axes[0, 0], runs)
    _line_panel(axes[0, 1], runs, "KL to the reference (trainer.kl_estimator) and to a teacher",
                [("kl", "KL to the reference", "-", False),
                 ("distill/reverse_kl", "reverse KL to the teacher (per token)", "--", False)], "KL")
    _line_panel(axes[0, 2], runs, "completion length and truncation",
               [("completion_len/mean", "length mean", "-", False), ("completion_len/max", "length max", ":", False)],
               "tokens", twin=[("truncation_rate", "truncation rate", "--", False)], twin_label="truncation rate")
    _line_panel(axes[1, 0], runs, "zero-variance groups (no signal)",
               [("groups/all_correct_frac", "all correct", "-", False),
                ("groups/all_wrong_frac", "all wrong", "--", False),
                ("groups/zero_variance_frac", "either (data.sampler's target)", ":", False)], "fraction of groups",
               fraction=True)
    _time_panel(axes[1, 1], runs, labels)
    _line_panel(axes[1, 2], runs, "rollout throughput", [("tokens_per_s", "tokens/s", "-", False)], "tokens / s")
    for ax, (panel_title, series, ylabel, fraction) in zip(axes[:, 3] if tools else [], TOOL_PANELS):
        _line_panel(ax, runs, panel_title, series, ylabel, fraction=fraction)

    if several:
        fig.legend(handles=[Line2D([], [], color=f"C{r}", linewidth=3, label=label) for r, label in enumerate(labels)],
                   loc="outside lower center", ncols=min(len(labels), 4), fontsize=9)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    return out


def _line_panel(ax: Any, runs: list[list[dict[str, Any]]], panel_title: str, series: list[tuple[str, str, str, bool]],
                ylabel: str, twin: list[tuple[str, str, str, bool]] | None = None, twin_label: str = "",
                fraction: bool = False) -> None:
    """One panel of `runs`' metrics. series: (metrics key, legend name, linestyle, markers). One colour per run
    when several, one colour per series for a single run."""
    from matplotlib.lines import Line2D  # here, not at the top: matplotlib loads only when a plot is drawn

    several = len(runs) > 1
    ax.set_title(panel_title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    handles, drawn = [], False
    groups = [(ax, series, 0)]
    if twin:
        tax = ax.twinx()
        tax.set_ylabel(twin_label)
        groups.append((tax, twin, len(series)))
    if fraction:
        ax.set_ylim(0, 1.02)
    if twin:
        tax.set_ylim(0, 1.02)  # the twin axis holds a rate: draw it on its full 0..1 scale
    for target, group, offset in groups:
        for j, (key, name, style, markers) in enumerate(group):
            present = False
            for r, rows in enumerate(runs):
                xs, ys = _series(rows, key)
                if not xs:
                    continue
                present = drawn = True
                _draw(target, xs, ys, style, f"C{r}" if several else f"C{offset + j}", markers)
            if present:
                color = "0.3" if several else f"C{offset + j}"
                handles.append(Line2D([], [], color=color, linestyle=style, marker="o" if markers else None,
                                      markersize=4, label=name))
    if drawn:
        ax.legend(handles=handles, fontsize=8, loc="best")
        ax.grid(alpha=0.3)
    else:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="0.5")


def _teacher_lines(ax: Any, runs: list[list[dict[str, Any]]]) -> None:
    """A distillation teacher's held-out pass@1 (measured once, at the start) across the panel, per run."""
    for r, rows in enumerate(runs):
        value = next((row["eval/teacher_pass@1"] for row in rows if "eval/teacher_pass@1" in row), None)
        if value is not None:
            ax.axhline(value, color=f"C{r}" if len(runs) > 1 else "0.4", linestyle=(0, (1, 3)), linewidth=1.2)
            ax.annotate(f"teacher {value:.2f}", (0.01, value), xycoords=("axes fraction", "data"), fontsize=8,
                        color="0.3", va="bottom")


def _time_panel(ax: Any, runs: list[list[dict[str, Any]]], labels: list[str]) -> None:
    """One run: the step time stacked by phase over steps. Several: one stacked bar per run (mean seconds)."""
    ax.set_title("step time split")
    rows_per_run = [[row for row in rows if any(f"time/{p}" in row for p in TIME_PARTS)] for rows in runs]
    if not any(rows_per_run):
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="0.5")
        return
    colors = list(TIME_COLORS)
    if len(runs) == 1:
        rows = rows_per_run[0]
        steps = [float(row.get("step", i)) for i, row in enumerate(rows)]
        stacks = [[float(row.get(f"time/{p}") or 0.0) for row in rows] for p in TIME_PARTS]
        ax.stackplot(steps, *stacks, labels=list(TIME_PARTS), colors=colors, alpha=0.85)
        ax.set_xlabel("step")
    else:
        bottoms = [0.0] * len(runs)
        for p, color in zip(TIME_PARTS, colors):
            means = [sum(float(r.get(f"time/{p}") or 0.0) for r in rows) / len(rows) if rows else 0.0
                     for rows in rows_per_run]
            ax.bar(range(len(runs)), means, bottom=bottoms, color=color, label=p, alpha=0.85)
            bottoms = [b + m for b, m in zip(bottoms, means)]
        ax.set_xticks(range(len(runs)), [label[-24:] for label in labels], rotation=15, fontsize=8)
    ax.set_ylabel("seconds per step")
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(alpha=0.3)


def run_plot(config: Any, run_dir: Path | None = None) -> int:
    """`grpo plot run=DIR` / `grpo plot runs=[A,B] out=cmp.png`."""
    if config.run and config.runs:
        raise UsageError("give either run=DIR or runs=[A,B], not both")
    dirs = [Path(config.run)] if config.run else [Path(d) for d in config.runs]
    if not dirs:
        raise UsageError("no run given; plot one with run=RUN_DIR or overlay several with runs=[RUN_A,RUN_B]")
    for d in dirs:
        if not d.is_dir():
            raise UsageError(f"run directory '{d}' not found")
        metrics = d / "metrics.jsonl"
        if not metrics.is_file():
            raise UsageError(f"'{d}' has no metrics.jsonl; pass a `grpo train` run directory")
        if not read_metrics(d):
            raise UsageError(f"'{metrics}' holds no metrics yet")
    if config.out:
        out = Path(config.out)
    else:
        out = dirs[0] / "metrics.png" if len(dirs) == 1 else Path("runs_comparison.png")
    if out.suffix.lower() not in PLOT_SUFFIXES:
        raise UsageError(f"out={out}: the file name must end in {', '.join(PLOT_SUFFIXES)}")
    written = plot_runs(dirs, out)
    print(f"wrote {written}")
    return 0
