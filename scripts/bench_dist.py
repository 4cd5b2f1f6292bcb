"""Benchmark: the default workload at 1 process and at N processes (FSDP2, a vLLM engine per rank), on-policy
or with rollouts sampled ahead (rollout.max_staleness, docs/async.md).

    python scripts/bench_dist.py                    # 1 vs 2 processes, 30 steps each (about 6 minutes on 2 cores)
    python scripts/bench_dist.py --steps 10 --configs sync1,sync2 --out dist.json
    python scripts/bench_dist.py --configs sync1,k1_thread,k1_off     # K=1 at one process: beside vs after the update
    python scripts/bench_dist.py --configs sync1,sync2,split_k0,split_k1   # issue 26's table (about 10 minutes)
    python scripts/bench_dist.py --configs split_k1,split_1t2g,split_2t1g   # 1+1, 1+2, 2+1 trainers+generators
    python scripts/bench_dist.py --configs sync2 --extra rollout.tensor_parallel_size=2   # one engine over both ranks

Each configuration runs `grpo train recipe=bike_pricing trainer.steps=STEPS` in its own
subprocess, one after another (nothing else shares the CPU), with no held-out evaluation
after step 0 and no checkpoint before the end. From its metrics.jsonl, over steps 2..STEPS
(step 1 pays for first-call set-up):

- seconds per step (median) and the phase split: generate (the ranks' engines, and gathering
  their rollouts), reward, logprobs (reference pass), update (forward/backward/AdamW, with
  FSDP2's gathers and gradient reductions inside it at N > 1), push (gathering each tensor
  from the shards into the engine, and the engine's reload); with rollout.max_staleness > 0,
  wait_rollouts (the loop waiting for the batch sampled beside the update) and gen.ahead (the
  seconds the engine spent on a batch, beside or after an earlier step: not in s/step when
  beside it); with rollout.placement=split, generate and push include the lines to the generator ranks (push:
  one broadcast of each tensor to every generator, and every engine's reload);
- `dist/collective_s`: the seconds a step spends in the loop's own collectives (gathering
  rollouts, scores and metrics, summing statistics, the Ctrl-C vote), which sit inside the
  phases above; FSDP2's own communication is inside `update`, `logprobs` and `push`;
- the peak resident memory of the largest rank (GiB); in a split job trainer rank 0's, and the
  largest generator rank's as gen. GiB.

No assertion on timings: this is a measuring tool, not a test. On a 2-core machine two
processes share the same two cores (one thread each), so N = 2 measures the cost of the
distribution itself, not a speed-up.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PHASES = ("generate", "reward", "logprobs", "update", "wait_rollouts", "push")
# name -> (processes, overrides)
CONFIGS = {
    "sync1": (1, []),  # one process, on-policy: generate, then train, then push
    "sync2": (2, []),  # two processes, an engine each, on-policy
    "k1_thread": (1, ["rollout.max_staleness=1", "rollout.overlap=thread"]),  # the next batch sampled beside the update
    "k1_off": (1, ["rollout.max_staleness=1", "rollout.overlap=off"]),  # the same batches, sampled after the update
    "split_k0": (2, ["rollout.placement=split"]),  # rank 0 trains, rank 1 generates, on-policy: each waits on the other
    "split_k1": (2, ["rollout.placement=split", "rollout.max_staleness=1"]),  # rank 1 samples step t+1 while t trains
    # 1 trainer + 2 generators (each samples half of the step's prompts; the weights reach both in one broadcast)
    "split_1t2g": (3, ["rollout.placement=split", "rollout.max_staleness=1", "rollout.generator_ranks=2"]),
    # 2 trainers (FSDP2 between them) + 1 generator
    "split_2t1g": (3, ["rollout.placement=split", "rollout.max_staleness=1"]),
}


def run(name: str, steps: int, out_dir: Path, extra: list[str]) -> dict:
    ranks, overrides = CONFIGS[name]
    cmd = [sys.executable, "-m", "grpo_cli", "train", "recipe=bike_pricing", f"trainer.steps={steps}", "eval.every=0",
           "eval.num_problems=8", "checkpoint.every=0", "rollout.push_check_every=0", f"output_dir={out_dir}",
           *overrides, *extra]
    if ranks > 1:
        cmd.append(f"dist.nproc_per_node={ranks}")
    started = time.time()
    done = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.time() - started
    if done.returncode != 0:
        sys.exit(f"{name} failed:\n{done.stderr[-3000:]}")
    metrics_file = next(out_dir.glob("bike_pricing/*/metrics.jsonl"))
    rows = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    steps_rows = [r for r in rows if r["step"] >= 2 and "time/step" in r]
    median = {k: statistics.median(r.get(f"time/{k}", 0.0) for r in steps_rows) for k in PHASES}
    return {
        "config": name,
        "ranks": ranks,
        "overrides": overrides + extra,
        "steps": steps,
        "wall_s": wall,
        "s_per_step": statistics.median(r["time/step"] for r in steps_rows),
        "phases_s": median,
        # rollout.max_staleness > 0: the seconds the engine sampled the step's batch, beside or after an earlier step
        "generate_ahead_s": statistics.median(r.get("time/generate_ahead", 0.0) for r in steps_rows),
        "collective_s": statistics.median(r.get("dist/collective_s", 0.0) for r in steps_rows),
        "peak_rss_gib": max(r.get("memory/peak_rss_gib", 0.0) for r in steps_rows),
        "generator_peak_rss_gib": max(r.get("memory/generator_peak_rss_gib", 0.0) for r in steps_rows),  # split
        "reward_mean_steps_1_3": [r["reward/mean"] for r in rows if 1 <= r["step"] <= 3],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--configs", default="sync1,sync2", help=f"comma-separated, of {', '.join(CONFIGS)}")
    parser.add_argument("--out", help="write every number to this JSON file")
    parser.add_argument("--extra", nargs="*", default=[],
                        help="overrides for every run, e.g. rollout.tensor_parallel_size=2")
    args = parser.parse_args()
    names = args.configs.split(",")
    if unknown := [n for n in names if n not in CONFIGS]:
        parser.error(f"unknown configs {unknown}; choose from {', '.join(CONFIGS)}")
    results = []
    for name in names:
        with tempfile.TemporaryDirectory() as tmp:
            results.append(run(name, args.steps, Path(tmp), args.extra))
    print(f"{'config':>10} {'procs':>5} {'s/step':>7} " + " ".join(f"{p[:9]:>9}" for p in PHASES)
          + f" {'gen.ahead':>9} {'collect.':>9} {'peak GiB':>8} {'gen. GiB':>8}")
    for r in results:
        print(f"{r['config']:>10} {r['ranks']:>5} {r['s_per_step']:>7.2f} "
              + " ".join(f"{r['phases_s'][p]:>9.3f}" for p in PHASES)
              + f" {r['generate_ahead_s']:>9.3f} {r['collective_s']:>9.3f} {r['peak_rss_gib']:>8.2f}"
              + f" {r['generator_peak_rss_gib']:>8.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
