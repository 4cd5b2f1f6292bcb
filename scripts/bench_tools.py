"""Benchmark: a multi-turn tool step against a single-turn step on the default workload.

    python scripts/bench_tools.py                  # 20 steps each (about 4 minutes on 2 cores)
    python scripts/bench_tools.py --steps 10 --out tools.json

Runs `grpo train recipe=bike_pricing` twice in subprocesses, one after the other (nothing else
shares the CPU): as shipped, and with the calculator as a tool the shipped model already "calls"
(it writes `subtotal: 60.00 + 8.00 = `; the tool answers `68.00` and the model writes on, so a
solution takes 1-3 turns; docs/tools.md). No held-out evaluation after step 0, no checkpoint
before the end. From each metrics.jsonl, over steps 2..STEPS (step 1 pays for first-call set-up):
seconds per step and per phase (medians), the model's tokens per step, seconds of generation per
1,000 model tokens, and for the tool run its turns, calls and tool tokens per sample.

The figure the tools design aims at (docs/tools.md): the tool step's generation time per model
token at most 1.25x the single-turn step's. No assertion on timings: a measuring tool, not a test.
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

PHASES = ("generate", "reward", "logprobs", "update", "push")
SUBTOTAL_TOOL = ["rollout.tools=[{function:calculator,open:'subtotal: ',close:' = ',timeout_s:null}]",
                 "rollout.tool_result_tags=['','']", "rollout.max_turns=3", "rollout.max_trajectory_tokens=200"]


def timed_rows(name: str, steps: int, out_dir: Path, extra: list[str]) -> list[dict]:
    """`grpo train recipe=bike_pricing` for `steps` steps (no evaluation after step 0, no checkpoint, no push
    check) with `extra`, in a subprocess; its logged rows of steps 2.. (step 1 pays for first-call set-up).
    bench_lora.py uses it too."""
    cmd = [sys.executable, "-m", "grpo_cli", "train", "recipe=bike_pricing", f"trainer.steps={steps}", "eval.every=0",
           "eval.num_problems=8", "checkpoint.every=0", "rollout.push_check_every=0", f"output_dir={out_dir}", *extra]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{name} failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in next(out_dir.glob("bike_pricing/*/metrics.jsonl")).read_text().splitlines()]
    return [r for r in rows if r["step"] >= 2 and "time/step" in r]


def run(name: str, steps: int, out_dir: Path, extra: list[str]) -> dict:
    started = time.time()
    timed = timed_rows(name, steps, out_dir, extra)
    model_tokens = statistics.median(r["completion_len/mean"] * r["samples"] for r in timed)
    generate = statistics.median(r["time/generate"] for r in timed)
    out = {
        "run": name, "steps": steps, "wall_s": time.time() - started,
        "s_per_step": statistics.median(r["time/step"] for r in timed),
        "phases_s": {k: statistics.median(r.get(f"time/{k}", 0.0) for r in timed) for k in PHASES},
        "model_tokens_per_step": model_tokens,
        "generate_s_per_1k_model_tokens": 1000 * generate / model_tokens,
        "reward_mean": statistics.mean(r["reward/mean"] for r in timed),
    }
    if "tools/turns_per_sample" in timed[0]:
        out["tools"] = {k.removeprefix("tools/"): statistics.mean(r[k] for r in timed)
                        for k in ("tools/turns_per_sample", "tools/calls_per_sample", "tools/env_tokens",
                                  "tools/model_tokens")}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None, help="also write the results as JSON here")
    args = parser.parse_args()
    results = []
    for name, extra in (("single-turn", []), ("tools", SUBTOTAL_TOOL)):
        with tempfile.TemporaryDirectory() as tmp:
            results.append(run(name, args.steps, Path(tmp), extra))
        r = results[-1]
        print(f"{name:12s} {r['s_per_step']:.2f} s/step | " +
              " ".join(f"{k} {v:.2f}" for k, v in r["phases_s"].items()) +
              f" | {r['model_tokens_per_step']:.0f} model tokens/step, {r['generate_s_per_1k_model_tokens']:.2f} s "
              "generate per 1k" + (f" | {json.dumps(r['tools'])}" if "tools" in r else ""), flush=True)
    single, tools = results
    ratio = tools["generate_s_per_1k_model_tokens"] / single["generate_s_per_1k_model_tokens"]
    print(f"tool step / single-turn step: {tools['s_per_step'] / single['s_per_step']:.2f}x per step, "
          f"{ratio:.2f}x generation time per model token")
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
