"""`grpo plot`: a PNG from a run's metrics.jsonl, several runs overlaid, one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_cli.report.plot import plot_runs, read_metrics

REPO = Path(__file__).resolve().parents[1]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def write_run(run_dir: Path, steps: int = 12, slope: float = 1.0, old: bool = False) -> Path:
    """A synthetic metrics.jsonl; `old` writes only a few keys, like a run from an earlier version."""
    run_dir.mkdir(parents=True)
    rows = [{"step": 0, "eval/pass@1": 0.1}]
    for s in range(1, steps + 1):
        row = {"step": s, "reward/mean": min(1.0, 0.1 + slope * s / steps), "kl": 0.001 * s}
        if not old:
            row.update({
                "reward/correct": 0.1 + s / (2 * steps), "reward/format": 0.9, "clip_frac": 0.01,
                "completion_len/mean": 20 + s, "completion_len/max": 40 + 2 * s, "truncation_rate": 0.02,
                "groups/all_correct_frac": s / (2 * steps), "groups/all_wrong_frac": 0.5 - s / (2 * steps),
                "tokens_per_s": 1000.0, "time/generate": 1.0, "time/reward": 0.05, "time/logprobs": 0.3,
                "time/update": 1.2, "time/push": 0.2, "time/step": 2.75,
            })
        if s % 4 == 0:
            row["eval/pass@1"] = 0.1 + slope * s / (2 * steps)
        rows.append(row)
    text = "".join(json.dumps(r) + "\n" for r in rows)
    (run_dir / "metrics.jsonl").write_text(text + '{"step": 13, "reward/me')  # a line still being written
    return run_dir


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE)
    assert len(data) > 20_000  # six panels of lines, not an empty canvas


def test_grpo_plot_run_writes_png_into_the_run_dir(cli, tmp_path):
    run = write_run(tmp_path / "bike_pricing" / "2026-01-01_00-00-00_1-abcd")
    out = cli("plot", f"run={run}")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"wrote {run / 'metrics.png'}"
    assert_png(run / "metrics.png")
    assert not (REPO / "outputs").exists()


def test_grpo_plot_runs_overlay_into_out(cli, tmp_path):
    a = write_run(tmp_path / "a")
    b = write_run(tmp_path / "b", slope=0.5, old=True)  # an older metrics file: most keys missing
    out_png = tmp_path / "figs" / "cmp.png"
    out = cli("plot", f"runs=[{a},{b}]", f"out={out_png}")
    assert out.returncode == 0, out.stderr
    assert_png(out_png)


def test_grpo_plot_runs_default_out_is_in_the_working_dir(cli, tmp_path):
    a, b = write_run(tmp_path / "a"), write_run(tmp_path / "b", slope=0.3)
    out = cli("plot", "runs=[a,b]", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert_png(tmp_path / "runs_comparison.png")
    assert not (a / "metrics.png").exists() and not (b / "metrics.png").exists()


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ([], "no run given"),
        (["run=NODIR"], "run directory 'NODIR' not found"),
        (["run=EMPTYDIR"], "has no metrics.jsonl"),
        (["run=RUN", "runs=[RUN]"], "not both"),
        (["run=RUN", "out=plot.jpg"], "must end in .png"),
        (["recipe=bike_pricing", "run=RUN"], "takes no recipe"),
        (["run=RUN", "bogus=1"], "unknown key 'bogus'"),
    ],
)
def test_grpo_plot_errors_are_one_line(cli, tmp_path, args, expected):
    run = write_run(tmp_path / "run")
    (tmp_path / "empty").mkdir()
    subs = {"NODIR": str(tmp_path / "missing"), "EMPTYDIR": str(tmp_path / "empty"), "RUN": str(run)}
    for key, value in subs.items():
        args = [a.replace(key, value) for a in args]
        expected = expected.replace(key, value)
    out = cli("plot", *args)
    assert out.returncode == 2, out.stdout + out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert lines[0].startswith("grpo plot: error: ") and expected in lines[0], lines[0]


def test_plot_runs_handles_an_old_metrics_file_in_process(tmp_path):
    run = write_run(tmp_path / "old", old=True)
    assert len(read_metrics(run)) == 13  # the half-written last line is skipped
    path = plot_runs([run], tmp_path / "old.png", labels=["old run"])
    assert path == tmp_path / "old.png"
    assert path.read_bytes().startswith(PNG_SIGNATURE)


def test_grpo_plot_appears_in_help(cli):
    out = cli("--help")
    assert out.returncode == 0
    plot_line = next(line for line in out.stdout.splitlines() if line.startswith("  plot "))
    assert plot_line.split(maxsplit=1)[1] == "plot a run's metrics to a PNG"


def test_smoothing_keeps_the_level_and_damps_the_noise():
    from grpo_cli.report.plot import smooth

    assert smooth([0.4] * 5) == pytest.approx([0.4] * 5)  # a constant stays constant, from the first step
    noisy = [0.0, 1.0] * 50
    out = smooth(noisy)
    assert len(out) == len(noisy) and out[0] == 0.0
    assert max(out[20:]) - min(out[20:]) < 0.2  # the raw series swings by 1.0
    assert sum(out[20:]) / len(out[20:]) == pytest.approx(0.5, abs=0.03)


def test_a_first_plot_on_a_machine_logs_no_font_cache_line(tmp_path):
    """A fresh matplotlib config dir makes matplotlib build its font cache, which it logs at INFO;
    a training run logs at INFO too (Hydra), so the line would land in its output."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "reward/mean": s / 10}) + "\n"
                                               for s in range(5)))
    code = ("import logging, sys\nlogging.basicConfig(level=logging.INFO, stream=sys.stdout)\n"
            "from grpo_cli.report.plot import plot_runs\n"
            f"plot_runs([{str(run)!r}], {str(run / 'm.png')!r})\nprint('plotted')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "MPLCONFIGDIR": str(tmp_path / "mpl")})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "plotted" in out.stdout and (run / "m.png").is_file()
    assert "fontManager" not in out.stdout + out.stderr
