"""docs/figures.md from real runs: each shipped CPU recipe's wall time, seconds per step and held-out pass@1 from
step 0 to the end, with the machine and package set they ran on. Every other page links to that page instead of
restating its numbers.

  python scripts/figures.py --train bike_pricing countdown bike_pricing_tools   # run each recipe, then the page
  python scripts/figures.py runs/bike_pricing/2026-...  [RUN_DIR ...]           # the page from runs made here

--train runs `grpo train recipe=NAME` for each name, one at a time (a default run takes 8-15 minutes on a 2-core
CPU), then writes the page from those runs. Given run directories, it reads them; they must come from this machine
(the page names the machine the script runs on). `--out -` prints the page instead of writing it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PAGE = REPO / "docs" / "figures.md"
PASS_KEY = "eval/pass@1"


def machine() -> str:
    """The CPU (or GPU), its usable cores and memory, and the package set, as one line."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    import torch
    import transformers

    try:
        import vllm

        engine = f"vllm {vllm.__version__}"
    except ImportError:
        engine = "no vllm"
    gpu = f", GPU {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ", no GPU"
    return (f"{cpu}, {cores} usable cores, {memory_gib:.0f} GiB{gpu}; torch {torch.__version__}, "
            f"transformers {transformers.__version__}, {engine}")


def commit() -> str:
    out = subprocess.run(["git", "-C", str(REPO), "log", "-1", "--format=%h (%cs)"], capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def run_start(run_dir: Path) -> float:
    """When the run directory was made: its name is YYYY-MM-DD_HH-MM-SS_PID-XXXX, in local time."""
    return datetime.strptime(run_dir.name[:19], "%Y-%m-%d_%H-%M-%S").timestamp()


def wall_s(run_dir: Path) -> float:
    """From the run directory's making to its last written file (the final checkpoint, the plot): the whole run
    but the few seconds of imports before the directory exists."""
    last = max(p.stat().st_mtime for p in run_dir.rglob("*") if p.is_file())
    return last - run_start(run_dir)


def minutes(seconds: float) -> str:
    return f"{int(seconds // 60)} min {round(seconds % 60):02d} s"


def summarise(run_dir: Path) -> dict:
    """One run's figures from its config.yaml and metrics.jsonl."""
    import yaml

    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "time/step" in r]
    evals = [(r["step"], r[PASS_KEY]) for r in rows if PASS_KEY in r]
    if not steps or not evals:
        raise SystemExit(f"{run_dir}: no training steps or no held-out evaluation in metrics.jsonl")
    best_step, best = max(evals, key=lambda e: (e[1], -e[0]))  # the highest, earliest at a tie
    overrides_file = run_dir / ".hydra" / "overrides.yaml"
    overrides = yaml.safe_load(overrides_file.read_text()) if overrides_file.is_file() else []
    rollout = config["rollout"]
    return {
        "run": run_dir.name, "task": config["task"], "overrides": [o for o in overrides or [] if
                                                                   not o.startswith("recipe=")],
        "steps": steps[-1]["step"], "prompts": rollout["prompts_per_step"], "group": rollout["group_size"],
        "wall_s": wall_s(run_dir), "training_s": steps[-1]["elapsed_s"],
        "median_step_s": statistics.median(r["time/step"] for r in steps),
        "start": evals[0], "end": evals[-1], "best": (best_step, best), "curve": evals,
    }


def page(runs: list[dict], command: str) -> str:
    lines = [
        "# Measured figures",
        "",
        "The current figures of the shipped CPU recipes, from real runs of `grpo train recipe=NAME` with its defaults.",
        "Other pages link here rather than restate them; their own tables are measurements of one comparison each,",
        "with the conditions they name.",
        "",
        f"- Produced by: `{command}` (written at commit {commit()}; each run's date and time begin its name).",
        f"- Machine: {machine()}.",
        "- Wall time: from the run directory's making to its last file (the final checkpoint and plot); training:",
        "  the loop's own clock (`elapsed_s`); s/step: the median of `time/step`. Held-out pass@1 is sampled at the",
        "  training temperature, one sample a problem, on the recipe's held-out set.",
        "- A run is deterministic for one machine and package set; machines of the same size differ in time (the",
        "  default run has taken 7 to 18 minutes on 2-core machines) and, after the first steps, in float summation",
        "  order, so the curve moves by a few points from one machine to another.",
        "",
        "| recipe | steps (prompts x samples) | wall time | training | s/step | held-out pass@1, step 0 -> end (best) |",
        "|---|---|---|---|---|---|",
    ]
    for r in runs:
        name = f"`{r['task']}`" + (f" ({' '.join(r['overrides'])})" if r["overrides"] else "")
        lines.append(f"| {name} | {r['steps']} ({r['prompts']} x {r['group']}) | {minutes(r['wall_s'])} | "
                     f"{minutes(r['training_s'])} | {r['median_step_s']:.2f} | {r['start'][1]:.3f} -> "
                     f"{r['end'][1]:.3f} ({r['best'][1]:.3f} at step {r['best'][0]}) |")
    lines.append("")
    for r in runs:
        every = r["curve"][1][0] - r["curve"][0][0] if len(r["curve"]) > 1 else 0
        lines.append(f"`{r['task']}`, held-out pass@1 every {every} steps: "
                     + ", ".join(f"{p:.3f}" for _, p in r["curve"]) + f" (run {r['run']}).")
        lines.append("")
    return "\n".join(lines)


def train(recipe: str) -> Path:
    """`grpo train recipe=NAME` in a child process; its run directory."""
    before = set((REPO / "runs" / recipe).glob("*")) if (REPO / "runs" / recipe).is_dir() else set()
    started = time.monotonic()
    grpo = Path(sys.executable).with_name("grpo")
    subprocess.run([str(grpo) if grpo.exists() else "grpo", "train", f"recipe={recipe}"], cwd=REPO, check=True)
    made = sorted(set((REPO / "runs" / recipe).glob("*")) - before)
    if len(made) != 1:
        raise SystemExit(f"grpo train recipe={recipe} made {len(made)} run directories under runs/{recipe}")
    print(f"{recipe}: {minutes(time.monotonic() - started)} from the command's start", flush=True)
    return made[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="*", type=Path, help="run directories to read")
    parser.add_argument("--train", nargs="+", default=[], metavar="RECIPE", help="recipes to run first")
    parser.add_argument("--out", default=str(PAGE), help="the page to write ('-': print it)")
    args = parser.parse_args()
    if not args.runs and not args.train:
        parser.error("give run directories or --train RECIPE ...")
    run_dirs = [*args.runs, *(train(recipe) for recipe in args.train)]
    command = "python scripts/figures.py " + " ".join(
        [*(f"--train {' '.join(args.train)}".split() if args.train else []),
         *(str(p.resolve().relative_to(REPO)) if p.resolve().is_relative_to(REPO) else str(p) for p in args.runs)])
    text = page([summarise(p.resolve()) for p in run_dirs], command.strip())
    if args.out == "-":
        print(text)
    else:
        Path(args.out).write_text(text)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
