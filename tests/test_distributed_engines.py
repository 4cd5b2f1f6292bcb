"""`grpo train` at 2 gloo ranks with vLLM engines (tier 3: minutes): countdown's shipped model in an engine
per rank, and the bike model in one tensor-parallel engine over both ranks. The jobs on the tiny model
(transformers engine: resume, nodes, Ctrl-C, a rank that raises) are in tests/test_distributed.py; the two files
are apart so that the suite's two workers can run them side by side.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from run_files import metrics_of, run_dir_of

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------- grpo train at 2 ranks


def test_two_ranks_with_an_engine_each_train_countdown_on_its_shipped_model(tmp_path):
    """The second built-in task at 2 ranks: its own shipped model in a vLLM engine per rank, the expression
    rewards, a push check on both engines every step, one run directory with both logs, and a gathered
    checkpoint with the base model's files that transformers loads."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    out = tmp_path / "runs"
    done = subprocess.run([sys.executable, "-m", "grpo_cli", "train", "recipe=countdown", "dist.nproc_per_node=2",
                           "trainer.steps=2", "eval.num_problems=8", "eval.every=2", "checkpoint.every=1",
                           "rollout.push_check_every=1", "rollout.enforce_eager=true", f"output_dir={out}"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2 processes (FSDP2, an engine each)" in done.stdout
    (run_dir,) = (out / "countdown").iterdir()
    assert (run_dir / "train.log").is_file() and (run_dir / "train-rank1.log").is_file()
    metrics = metrics_of(run_dir)
    assert [m["step"] for m in metrics] == [0, 1, 2]
    for m in metrics[1:]:  # both engines took every push: each rank checked its own, the worst is logged
        assert m["push_check/max_abs_diff"] < 1e-3
        assert m["samples"] == 64  # 8 prompts x 8, gathered from the two engines
        assert m["reward/failures"] == 0
    assert sum(m["reward/countdown_valid"] for m in metrics[1:]) > 1.0  # the shipped model writes valid expressions
    final = run_dir / "checkpoints" / "final"
    model = AutoModelForCausalLM.from_pretrained(final, use_safetensors=True)
    saved = load_file(final / "model.safetensors")
    assert model.model.embed_tokens.weight.equal(saved["model.embed_tokens.weight"])
    assert json.loads((final / "checkpoint.json").read_text())["world_size"] == 2
    base = load_file(REPO / "grpo_cli" / "models" / "countdown_base" / "model.safetensors")
    assert saved.keys() == base.keys()  # the same files as a one-process checkpoint (tied lm_head written once)
    assert all(saved[k].shape == base[k].shape and saved[k].dtype == base[k].dtype for k in base)
    assert any(not saved[k].equal(base[k]) for k in saved)  # trained weights, not the start


def test_two_ranks_can_share_one_tensor_parallel_vllm_engine(tmp_path, vllm_engine, shipped_weights):
    """One engine over both ranks (each holds its slice) takes every push; the checkpoint the two ranks
    gathered serves in vLLM (the session's engine takes its weights) and has the base model's files."""
    from safetensors.torch import load_file

    from grpo_cli import evaluate
    from grpo_cli.cli import load_config

    out = tmp_path / "runs"
    done = subprocess.run([sys.executable, "-m", "grpo_cli", "train", "recipe=bike_pricing", "dist.nproc_per_node=2",
                           "rollout.tensor_parallel_size=2", "trainer.steps=1", "eval.num_problems=4",
                           "rollout.max_new_tokens=96",
                           "rollout.push_check_every=1", "rollout.enforce_eager=true", f"output_dir={out}"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = run_dir_of(out)
    metrics = metrics_of(run_dir)
    assert [m["step"] for m in metrics] == [0, 1]
    assert metrics[1]["push_check/max_abs_diff"] < 1e-3  # the engine's two halves took the push
    assert metrics[1]["samples"] == 64  # all 8 prompts once (one engine), not twice
    final = run_dir / "checkpoints" / "final"
    saved = load_file(final / "model.safetensors")
    base = load_file(REPO / "grpo_cli" / "models" / "bike_base" / "model.safetensors")
    assert saved.keys() == base.keys() and any(not saved[k].equal(base[k]) for k in saved)
    try:
        assert evaluate.run(load_config("eval", [f"checkpoint={final}", "eval.num_problems=4"]),
                            engine=vllm_engine) == 0
    finally:
        vllm_engine.push_weights(shipped_weights.items())
    written = json.loads((final / "eval.json").read_text())
    assert written["num_problems"] == 4 and 0.0 <= written["pass@1"] <= 1.0
