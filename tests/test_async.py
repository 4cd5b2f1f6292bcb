"""rollout.max_staleness=K: batches sampled ahead of the trainer, from weights exactly K steps older (tier 3).

One real K=1 run on the session's vLLM engine (the shipped model) with a checkpoint every step: its batch of
step 3 is re-scored with transformers on the step-1 and step-2 checkpoints to show which weights sampled it;
the same run with the batch sampled after the update instead of beside it gives the same numbers; a K=1 run
SIGKILLed after its step-2 checkpoint resumes to the same weights. The prompt pool (signal_by_column) runs in all
of them: its draws ahead see only the steps already scored, and the checkpoint carries them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import sigkill_when

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

OVERRIDES = ["recipe=bike_pricing", "trainer.steps=4", "rollout.prompts_per_step=4", "rollout.group_size=4",
             "eval.num_problems=8", "eval.every=2", "checkpoint.every=1", "checkpoint.keep_last=10",
             "rollout.push_check_every=1", "trainer.lr=1e-3", "rollout.max_staleness=1",
             # the prompt pool too: the draw of step t+1 sees steps up to t-1, and a resume replays its choices
             "data.sampler.name=signal_by_column", "data.sampler.decay=0.5"]
WALL_CLOCK = ("time/", "elapsed_s", "tokens_per_s", "memory/")


def k1_run(out: Path, vllm_engine, shipped_weights, *extra: str) -> Path:
    """A 4-step K=1 run of OVERRIDES (+ `extra`) in this process on the session's engine; its run directory."""
    from grpo_cli import train
    from grpo_cli.cli import load_config

    cfg = load_config("train", OVERRIDES + [f"output_dir={out}", *extra])
    try:
        assert train.run(cfg, out / "run", engine=vllm_engine) == 0
    finally:
        vllm_engine.push_weights(shipped_weights.items())
    return out / "run"


def logged(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if not any(w in k for w in WALL_CLOCK)}
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def final(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(run_dir / "checkpoints" / "final" / "model.safetensors")


@pytest.fixture(scope="module")
def threaded(tmp_path_factory, vllm_engine, shipped_weights):
    """The K=1 run with its batches sampled in a thread beside each update."""
    return k1_run(tmp_path_factory.mktemp("k1_thread"), vllm_engine, shipped_weights, "rollout.overlap=thread")


def test_the_batch_of_step_3_came_from_the_weights_after_step_1(threaded):
    """The step-2 checkpoint holds the batch step 3 trains on, sampled while step 2 trained. Re-scored with
    transformers (teacher-forced, T=1), its sampling logprobs match the step-1 weights (the push check's
    tolerance) and miss the step-2 weights and the start's by far more: it came from step t-2's weights."""
    from grpo_cli.weights.checkpoint import load_policy, load_trainer_state

    checkpoints = threaded / "checkpoints"
    (batch,) = load_trainer_state(checkpoints / "step_000002")["rollouts_ahead"]
    assert (batch["step"], batch["policy_version"]) == (3, 1)
    rollouts = batch["rollouts"]

    def mean_gap(weights: Path) -> float:
        model = load_policy(str(weights), "float32").eval()
        gaps = []
        with torch.no_grad():
            for prompt, completions, sampled in zip(batch["prompt_ids"], rollouts["completion_ids"],
                                                    rollouts["sampling_logprobs"]):
                for completion, logps in zip(completions, sampled):
                    ids = torch.tensor([prompt + completion])  # [1, T]
                    logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()  # [Tc, V]
                    mine = torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]  # [Tc]
                    gaps.append((mine - torch.tensor(logps)).abs())  # [Tc]
        return float(torch.cat(gaps).mean())

    from_step_1 = mean_gap(checkpoints / "step_000001")
    assert from_step_1 < 1e-3
    for other in (checkpoints / "step_000002", REPO / "grpo_cli" / "models" / "bike_base"):
        assert mean_gap(other) > 10 * from_step_1 + 1e-3, other
    steps = logged(threaded)[1:]
    assert [(m["rollout/policy_version"], m["rollout/staleness"]) for m in steps] == [(0, 0), (0, 1), (1, 1), (2, 1)]
    assert all(m["push_check/max_abs_diff"] < 1e-3 for m in steps)
    assert load_trainer_state(checkpoints / "final")["rollouts_ahead"] == []  # the last step samples nothing ahead


def test_sampling_after_the_update_gives_the_same_run_as_beside_it(threaded, tmp_path, vllm_engine, shipped_weights):
    """rollout.overlap=off samples the same batches after each update, in the loop's thread: every logged
    value and the final weights are those of the threaded run, bit for bit."""
    inline = k1_run(tmp_path, vllm_engine, shipped_weights, "rollout.overlap=off")
    assert logged(inline) == logged(threaded)
    assert sum(m.get("pool/passed_over", 0) for m in logged(threaded)) > 0  # the pool chose
    a, b = final(inline), final(threaded)
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)


def test_a_k1_run_killed_after_its_step_2_checkpoint_resumes_bit_exactly(threaded, tmp_path, vllm_engine,
                                                                         shipped_weights):
    """`python -m grpo_cli train ... rollout.max_staleness=1` SIGKILLed once its step-2 checkpoint is complete
    (the batch of step 3 saved in it), then resumed in this process: the uninterrupted run's weights and logged
    values."""
    from grpo_cli import train
    from grpo_cli.cli import load_config

    out = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "grpo_cli", "train", *OVERRIDES, f"output_dir={out}",
                             "rollout.overlap=thread"], cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": os.environ.get(
                                "OMP_NUM_THREADS", str(torch.get_num_threads()))})
    run_dir = sigkill_when(proc, out, "bike_pricing/*/checkpoints/step_000002/checkpoint.json").parents[2]
    assert not (run_dir / "checkpoints" / "final").exists()
    cfg = dataclasses.replace(load_config("train", OVERRIDES + [f"output_dir={out}", "rollout.overlap=thread"]),
                              resume=str(run_dir))
    try:
        assert train.run(cfg, run_dir, engine=vllm_engine) == 0
    finally:
        vllm_engine.push_weights(shipped_weights.items())
    a, b = final(run_dir), final(threaded)
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    assert logged(run_dir) == logged(threaded)
