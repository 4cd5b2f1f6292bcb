"""A tool run replays exactly however long its calls take (issue 54, tier 3: minutes): recipe=bike_pricing_tools
on vLLM with a calculator whose every call takes a random 0-300 ms (the OS's randomness, not the run's seed),
run straight, and SIGKILLed after its step-1 checkpoint then resumed with `resume=auto`: the same trajectories,
engine logprobs, rewards, logged values and final weights, bit for bit. Before the rejoin rule of tools/pool.py
a reply joined decoding whenever it returned, so the batches, and the engine's logprobs with them, followed
the clock.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import sigkill_when

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow
WALL_CLOCK = ("time/", "elapsed_s", "tokens_per_s", "memory/")

JITTERY = '''
import random
import time

from grpo_cli.tools.builtin import calculator


def jittery_calculator(expression):
    time.sleep(random.SystemRandom().uniform(0.0, 0.3))
    return calculator(expression)
'''
RUN = ["recipe=bike_pricing_tools", "trainer.steps=2", "rollout.prompts_per_step=4", "rollout.group_size=4",
       "eval.num_problems=4", "eval.greedy=false", "eval.every=2", "checkpoint.every=1", "rollout.enforce_eager=true",
       "logging.samples_every=1", "rollout.push_check_every=1",  # a resume checks its first push: every step does
       "rollout.mismatch_groups=-1",  # every group's logprobs: the metric is a number whichever groups stay
       "rollout.tools=[{function:'jittery_mod:jittery_calculator',open:'<calc>',close:'</calc>',timeout_s:null}]"]


def command(workdir: Path, out: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "grpo_cli", "train", *RUN, f"output_dir={workdir / out}", *extra]


def logged(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if not any(w in k for w in WALL_CLOCK)}
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_tool_of_random_latency_replays_bit_for_bit_after_sigkill_and_resume(tmp_path):
    from safetensors.torch import load_file

    (tmp_path / "jittery_mod.py").write_text(JITTERY)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    straight = subprocess.run(command(tmp_path, "straight"), cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=600)
    assert straight.returncode == 0, straight.stderr[-3000:]
    (straight_dir,) = (tmp_path / "straight" / "bike_pricing_tools").iterdir()

    proc = subprocess.Popen(command(tmp_path, "killed"), cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    killed_dir = sigkill_when(proc, tmp_path / "killed", "*/*/checkpoints/step_000001/checkpoint.json").parents[2]
    assert not (killed_dir / "checkpoints" / "final").exists()
    resumed = subprocess.run(command(tmp_path, "killed", "resume=auto"), cwd=REPO, env=env, capture_output=True,
                             text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout

    steps = logged(straight_dir)
    assert [m["step"] for m in steps] == [0, 1, 2]
    calls = [s for s in (json.loads(line) for line in (straight_dir / "completions.jsonl").read_text().splitlines())
             for t in s["turns"] if t["role"] == "tool"]
    assert sum(m["tools/calls_per_sample"] for m in steps[1:]) > 0.5 and len(calls) > 0
    # the engine's logprobs, in the logged values (only the key was checked: a settled first group left it None)
    assert all(isinstance(m["mismatch/mean_abs_logprob"], float) and m["mismatch/tokens"] > 0 for m in steps[1:])
    assert logged(killed_dir) == steps
    a = load_file(straight_dir / "checkpoints" / "final" / "model.safetensors")
    b = load_file(killed_dir / "checkpoints" / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
