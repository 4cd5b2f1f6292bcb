"""Benchmark: LoRA vs full fine-tuning on the default workload, one process.

    python scripts/bench_lora.py                       # 30 steps each (about 6 minutes on 2 cores)
    python scripts/bench_lora.py --steps 10 --rank 16 --out lora.json

Each configuration runs `grpo train recipe=bike_pricing trainer.steps=STEPS` in its own subprocess, one
after the other, with no held-out evaluation after step 0, no checkpoint before the end and no push check
(so `time/push` is the push alone); LoRA adds `model.lora.rank=RANK`, once with the adapters pushed as a vLLM
LoRA request (`rollout.lora_push=adapter`) and once merged into the base weights (`merged`). From metrics.jsonl, over steps
2..STEPS (step 1 pays for first-call set-up), medians of: the step, the update (forward, backward,
AdamW), the push (full: every tensor reloaded into vLLM; LoRA: the adapters written to a directory and
loaded as a vLLM LoRA request), and the reference pass (`time/logprobs`); and the process's peak resident
memory (trainer and vLLM engine together).

It also counts, exactly, the trainer's own bytes: the policy's weights, the gradients and AdamW's two
moments of what trains, and the reference model (full fine-tuning keeps a second copy; LoRA turns its
adapters off instead).

No assertion on timings: this is a measuring tool, not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from bench_tools import timed_rows  # scripts/ is on the path of a script run from it

PHASES = ("update", "push", "logprobs", "generate")


def run(extra: list[str], steps: int, out_dir: Path) -> dict:
    started = time.time()
    steps_rows = timed_rows(" ".join(extra) or "full", steps, out_dir, extra)
    return {"overrides": extra, "wall_s": time.time() - started,
            "s_per_step": statistics.median(r["time/step"] for r in steps_rows),
            "phases_s": {k: statistics.median(r.get(f"time/{k}", 0.0) for r in steps_rows) for k in PHASES},
            "peak_rss_gib": max(r.get("memory/peak_rss_gib", 0.0) for r in steps_rows),
            "reward_mean": statistics.mean(r["reward/mean"] for r in steps_rows)}


def trainer_bytes(rank: int | None) -> dict:
    """The trainer's bytes on the shipped model: weights held, and the gradients + AdamW moments of what trains
    (fp32), and the reference model's weights."""
    from grpo_cli.config import LoraConfig
    from grpo_cli.weights.checkpoint import load_policy, resolve_model_path
    from grpo_cli.weights.lora import with_adapters

    path = resolve_model_path("builtin:bike_base")
    model = load_policy(path, "float32")
    if rank is not None:
        model = with_adapters(model, LoraConfig(rank=rank), path)
    params = list(model.parameters())
    weights = sum(p.nbytes for p in params)
    trained = sum(p.nbytes for p in params if p.requires_grad)
    reference = 0 if rank is not None else weights
    return {"weights": weights, "trainable": trained, "grads_and_adam": 3 * trained, "reference": reference,
            "total": weights + 3 * trained + reference}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--lora-lr", default="1e-3", help="model.lora.lr of the LoRA runs")
    parser.add_argument("--out", help="write every number to this JSON file")
    args = parser.parse_args()
    lora = [f"model.lora.rank={args.rank}", f"model.lora.lr={args.lora_lr}"]
    configs = {"full": [], "lora adapter": [*lora, "rollout.lora_push=adapter"],
               "lora merged": [*lora, "rollout.lora_push=merged"]}
    results = {}
    for name, extra in configs.items():
        with tempfile.TemporaryDirectory() as tmp:
            results[name] = run(extra, args.steps, Path(tmp))
        results[name]["trainer_bytes"] = trainer_bytes(args.rank if extra else None)
    print(f"{'':>12} {'s/step':>7} " + " ".join(f"{p:>9}" for p in PHASES) + f" {'peak GiB':>8} {'trainer MiB':>11}")
    for name, r in results.items():
        print(f"{name:>12} {r['s_per_step']:>7.3f} " + " ".join(f"{r['phases_s'][p]:>9.4f}" for p in PHASES)
              + f" {r['peak_rss_gib']:>8.2f} {r['trainer_bytes']['total'] / 2**20:>11.2f}")
    full_push = results["full"]["phases_s"]["push"]
    for name in ("lora adapter", "lora merged"):
        if results[name]["phases_s"]["push"] > 0:
            print(f"push: {name} {full_push / results[name]['phases_s']['push']:.1f}x cheaper than full")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
