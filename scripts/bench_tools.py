"""Benchmark: a multi-turn tool step against a single-turn step on the default workload; and, with
--concurrency, the tool task's step with slow and hanging tools (tools off the decoding loop, issue 36).

    python scripts/bench_tools.py                  # 20 steps each (about 4 minutes on 2 cores)
    python scripts/bench_tools.py --steps 10 --out tools.json
    python scripts/bench_tools.py --concurrency --steps 12  # about 12 minutes on 2 cores

Runs `grpo train recipe=bike_pricing` twice in subprocesses, one after the other (nothing else
shares the CPU): as shipped, and with the calculator as a tool the shipped model already "calls"
(it writes `subtotal: 60.00 + 8.00 = `; the tool answers `68.00` and the model writes on, so a
solution takes 1-3 turns; docs/tools.md). No held-out evaluation after step 0, no checkpoint
before the end. From each metrics.jsonl, over steps 2..STEPS (step 1 pays for first-call set-up):
seconds per step and per phase (medians), the model's tokens per step, seconds of generation per
1,000 model tokens, and for the tool run its turns, calls and tool tokens per sample.

The figure the tools design aims at (docs/tools.md): the tool step's generation time per model
token at most 1.25x the single-turn step's. No assertion on timings: a measuring tool, not a test.

--concurrency runs `grpo train recipe=bike_pricing_tools` six times: with its calculator as shipped
(in process), in worker processes, and in worker processes that live in the sandbox (`sandbox: bwrap`,
docs/sandbox.md); with `drowsy_calculator` and `sleepy_calculator` below, which sleep 0.5 s on one call in
five and 2 s on one call in ten (the argument's CRC-32 decides, so the same calls sleep in every run) in
their workers; and with `always_late`, which sleeps past its 1 s limit on every call, under a 5 s tool budget
per step. It prints seconds per step (median over steps 2..STEPS) and the logged tool time, the engine's
stops for late replies, timeouts, budget cuts and cut trajectories. The targets (docs/tools.md): the
sandboxed calculator's step at most 1.3x the in-process one; the drowsy run's generate at most the plain
run's + 1.1 s; the sleepy step at most 2 s + 1.3x the plain step; the hanging tool's step within the
budget plus the plain step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

PHASES = ("generate", "reward", "logprobs", "update", "push")
SUBTOTAL_TOOL = ["rollout.tools=[{function:calculator,open:'subtotal: ',close:' = ',timeout_s:null}]",
                 "rollout.tool_result_tags=['','']", "rollout.max_turns=3", "rollout.max_trajectory_tokens=200"]


# The concurrency runs' tools (imported by name from this file: scripts/ is put on the trainer's path)
CALC = "rollout.tools=[{{function:'{}',open:'<calc>',close:'</calc>',timeout_s:{}{}}}]"
CONCURRENCY = {
    "calculator": [CALC.format("calculator", "null", "")],
    "calc in workers": [CALC.format("calculator", 10, "")],
    "calc sandboxed": [CALC.format("calculator", 10, ",sandbox:bwrap")],
    "drowsy 1 in 5": [CALC.format("bench_tools:drowsy_calculator", 10, "")],
    "sleepy 1 in 10": [CALC.format("bench_tools:sleepy_calculator", 10, "")],
    "always late": [CALC.format("bench_tools:always_late", 1, ""), "rollout.tool_budget_s=5"],
}


def sleepy_calculator(expression: str) -> str:
    """The calculator, 2 s late on the tenth of its arguments whose CRC-32 is 0 mod 10."""
    from grpo_cli.tools.builtin import calculator

    if zlib.crc32(expression.encode()) % 10 == 0:
        time.sleep(2.0)
    return calculator(expression)


def drowsy_calculator(expression: str) -> str:
    """The calculator, 0.5 s late on the fifth of its arguments whose CRC-32 is 0 mod 5."""
    from grpo_cli.tools.builtin import calculator

    if zlib.crc32(expression.encode()) % 5 == 0:
        time.sleep(0.5)
    return calculator(expression)


def always_late(expression: str) -> str:
    time.sleep(60)
    return "late"


def timed_rows(name: str, steps: int, out_dir: Path, extra: list[str], recipe: str = "bike_pricing") -> list[dict]:
    """`grpo train recipe=RECIPE` for `steps` steps (no evaluation after step 0, no checkpoint, no push
    check) with `extra`, in a subprocess; its logged rows of steps 2.. (step 1 pays for first-call set-up).
    bench_lora.py uses it too."""
    cmd = [sys.executable, "-m", "grpo_cli", "train", f"recipe={recipe}", f"trainer.steps={steps}", "eval.every=0",
           "eval.num_problems=8", "checkpoint.every=0", "rollout.push_check_every=0", f"output_dir={out_dir}", *extra]
    scripts = str(Path(__file__).resolve().parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [scripts, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        sys.exit(f"{name} failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in next(out_dir.glob(f"{recipe}/*/metrics.jsonl")).read_text().splitlines()]
    return [r for r in rows if r["step"] >= 2 and "time/step" in r]


def concurrency(steps: int, only: str | None = None, overrides: list[str] = ()) -> list[dict]:
    results = []
    for name, extra in CONCURRENCY.items():
        if only and not name.startswith(only):
            continue
        with tempfile.TemporaryDirectory() as tmp:
            rows = timed_rows(name, steps, Path(tmp), [*extra, *overrides], recipe="bike_pricing_tools")
        mean = {k: statistics.mean(r.get(k, 0.0) for r in rows) for k in
                ("time/tools", "time/tool_late", "time/tool_wait_max", "tools/calls_per_sample", "tools/timeouts_per_sample", "tools/budget_cuts_per_sample",
                 "tools/capped/tool_timeouts", "reward/mean")}
        results.append({"run": name, "s_per_step": statistics.median(r["time/step"] for r in rows),
                        # the step less the longest any one trajectory waited on its own calls: what overlap can save
                        "s_per_step_less_wait": statistics.median(r["time/step"] - r.get("time/tool_wait_max", 0.0)
                                                                  for r in rows),
                        "generate_s": statistics.median(r["time/generate"] for r in rows),
                        "max_s_per_step": max(r["time/step"] for r in rows), **mean})
        r = results[-1]
        print(f"{name:15s} {r['s_per_step']:.2f} s/step (max {r['max_s_per_step']:.2f}, generate {r['generate_s']:.2f})"
              f" | tool time {r['time/tools']:.2f} s, engine stopped for late replies {r['time/tool_late']:.2f} s, "
              f"longest wait of one trajectory {r['time/tool_wait_max']:.2f} s, "
              f"step less it {r['s_per_step_less_wait']:.2f} s | calls {r['tools/calls_per_sample']:.2f}/sample, timeouts "
              f"{r['tools/timeouts_per_sample']:.2f}, budget cuts {r['tools/budget_cuts_per_sample']:.2f}, cut "
              f"trajectories {r['tools/capped/tool_timeouts']:.2f} | reward {r['reward/mean']:.3f}", flush=True)
    if len(results) < len(CONCURRENCY):
        return results
    plain = results[0]["s_per_step"]
    print(f"calculator in sandboxed workers: {results[2]['s_per_step'] / plain:.2f}x the in-process step (target "
          f"1.3x); in plain workers {results[1]['s_per_step'] / plain:.2f}x")
    drowsy, sleepy, late = results[3], results[4], results[5]
    print(f"drowsy: generate {drowsy['generate_s']:.2f} s against the target {results[0]['generate_s']:.2f} + 1.1 = "
          f"{results[0]['generate_s'] + 1.1:.2f} s (the in-process calculator's generate + 1.1 s)")
    print(f"sleepy: {sleepy['s_per_step']:.2f} s/step against the target 2 + 1.3 x {plain:.2f} = "
          f"{2 + 1.3 * plain:.2f} s (a trajectory whose calls sleep twice waits 4 s itself: less its own wait, "
          f"{sleepy['s_per_step_less_wait']:.2f} s against 1.3 x {plain:.2f} = {1.3 * plain:.2f}); always late: "
          f"{late['max_s_per_step']:.2f} s at most, budget 5 s + {plain:.2f} s")
    return results


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
    parser.add_argument("--concurrency", action="store_true", help="the tool task with slow and hanging tools")
    parser.add_argument("--only", default=None, help="--concurrency: only this run (calculator, sleepy, late)")
    parser.add_argument("--set", nargs="*", default=[], help="--concurrency: overrides for every run, e.g. "
                        "rollout.tool_workers=8")
    args = parser.parse_args()
    if args.concurrency:
        results = concurrency(args.steps, args.only, args.set)
        if args.out:
            args.out.write_text(json.dumps(results, indent=2))
        return
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
