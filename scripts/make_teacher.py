"""Build the distillation teacher shipped in grpo_cli/models: bike_teacher, the shipped base model trained by this
project's own default GRPO recipe (docs/distillation.md).

    .venv/bin/python scripts/make_teacher.py                      # ~9 minutes on 2 CPU cores: the run, then grpo eval
    .venv/bin/python scripts/make_teacher.py --from-run RUN_DIR   # package a finished `grpo train recipe=bike_pricing` run

What it does, top to bottom:
1. runs `grpo train recipe=bike_pricing` (its defaults: 260 steps from builtin:bike_base) into a temporary
   output directory, or takes --from-run;
2. copies the run's best checkpoint (the highest held-out pass@1 of its evaluations) into --out: its weights,
   config and tokenizer, which is the student's own (a distillation teacher must share it);
3. measures it from disk with `grpo eval` (the recipe's held-out problems, eval.samples_per_problem=4 at T=1,
   greedy too) and writes the run's evaluations (step, seconds since the start, held-out pass@1) and the
   measurement to --out/teacher.json.

The run is deterministic on one machine and package set, not across machines: a rebuild elsewhere gives a
teacher of about the same accuracy, not the same bits.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FILES = ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


def grpo(*args: str) -> subprocess.CompletedProcess:
    """`python -m grpo_cli ARGS` in the repository, its output shown as it comes and kept."""
    proc = subprocess.Popen([sys.executable, "-m", "grpo_cli", *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if not line.startswith(("WARNING", "INFO", "(")):  # vLLM's own logging stays out of the way
            print(line, end="", flush=True)
    if proc.wait():
        raise SystemExit(f"grpo {' '.join(args)} failed (exit {proc.returncode}):\n{''.join(lines[-30:])}")
    return subprocess.CompletedProcess(proc.args, 0, "".join(lines), "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--from-run", type=Path, help="a finished grpo train recipe=bike_pricing run to package")
    parser.add_argument("--out", type=Path, default=REPO / "grpo_cli" / "models" / "bike_teacher")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="grpo-teacher-") as tmp:
        run_dir = args.from_run
        if run_dir is None:
            grpo("train", "recipe=bike_pricing", f"output_dir={tmp}")
            (run_dir,) = (Path(tmp) / "bike_pricing").iterdir()
        best = run_dir / "checkpoints" / "best"
        info = json.loads((best / "checkpoint.json").read_text())
        if info["task"] != "bike_pricing" or info["config"]["model"]["name_or_path"] != "builtin:bike_base":
            raise SystemExit(f"{run_dir} is not a bike_pricing run from builtin:bike_base")
        args.out.mkdir(parents=True, exist_ok=True)
        for name in FILES:
            shutil.copy2(best / name, args.out / name)
        history = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        evals = [(m["step"], round(m.get("elapsed_s", 0.0), 1), m["eval/pass@1"]) for m in history
                 if "eval/pass@1" in m]

    report = Path(tempfile.mkdtemp(prefix="grpo-teacher-eval-")) / "eval.json"
    grpo("eval", f"checkpoint={args.out}", "recipe=bike_pricing", "eval.samples_per_problem=4", "eval.greedy=true",
         f"out={report}")
    measured = json.loads(report.read_text())
    kept = {key: measured[key] for key in ("num_problems", "k", "pass@1", "pass@k", "maj@k", "greedy_accuracy")
            if key in measured}
    (args.out / "teacher.json").write_text(json.dumps({
        "made_by": "scripts/make_teacher.py: grpo train recipe=bike_pricing from builtin:bike_base, its best checkpoint",
        "step": info["step"],
        "run_evaluations": [dict(zip(("step", "elapsed_s", "pass@1"), e)) for e in evals],  # the run's held-out
        "grpo_eval": kept,  # grpo eval of the copied weights, eval.samples_per_problem=4 at T=1, and greedy
    }, indent=1) + "\n")
    print(f"teacher: step {info['step']} of the run -> {args.out}; grpo eval: {json.dumps(kept)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
