"""Benchmark: the parameter bytes a rank holds during the update, layer-by-layer resharding vs gathered
through the step, on a random Qwen2 built from a config (no download).

    python scripts/bench_reshard.py                 # 2 ranks, a 70.8M-parameter model (about 2 minutes on 2 cores)
    python scripts/bench_reshard.py --ranks 2 --layers 8 --out reshard.json

It starts itself under torchrun (gloo, one thread a rank) and runs the same update twice from the same
weights, once with `dist.reshard_layers=true` and once with `false`: the reference pass and one
optimizer step of `grpo_cli.step.update` on a synthetic batch (P prompts x G completions, the shared prompt
pass, 2 micro-batches). For each it reports, from rank 0:

- `peak_param_bytes`: the most parameter data the rank held at once during the update: its shards,
  every gathered parameter, and the all-gather buffers in flight, sampled each time FSDP2 starts or
  finishes a gather (`HeldBytes`, which reads FSDP2's internals of torch 2.13: a measuring tool, not
  product code), and that as a share of the full model's bytes;
- the update's seconds, its loss and grad norm (equal in both modes: the layout changes what is held,
  not the numbers), and whether the final weights are bit-identical.

No assertion on the figures: tests/test_distributed.py checks the bound on a tiny model.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def random_qwen2(layers: int, hidden: int = 384, vocab: int = 4096, seed: int = 0) -> Any:
    """A Qwen2 of `layers` decoder layers (at hidden 384, 32 layers: 70.8M parameters with a 4,096-token
    vocabulary and tied embeddings), random weights from `seed`."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden,
                         num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=2,
                         max_position_embeddings=512, tie_word_embeddings=True)
    return Qwen2ForCausalLM(config)


class HeldBytes:
    """The peak of the parameter bytes one rank holds: its shards, its gathered parameters and the all-gather
    buffers in flight, sampled after every FSDP2 `unshard` and `wait_for_unshard` (the only places that
    allocate parameter memory). Patches FSDP2's param-group class while open."""

    def __init__(self, model: Any) -> None:
        from grpo_cli.dist.shard import fsdp_modules

        self.groups = [group for module in fsdp_modules(model) for group in module._get_fsdp_state()._fsdp_param_groups]
        self.shard_bytes = sum(p.sharded_param.to_local().nbytes for g in self.groups for p in g.fsdp_params)
        self.peak = 0

    def now(self) -> int:
        gathered = sum(t.untyped_storage().nbytes() for g in self.groups for p in g.fsdp_params
                       for t in getattr(p, "all_gather_outputs", []))
        buffers = {}
        for g in self.groups:
            pending = [g._all_gather_result] if g._all_gather_result is not None else []
            retained = getattr(g.comm_ctx, "all_gather_state", None)  # set once the first forward has run
            if retained is not None:
                pending.append(retained.all_gather_result)
            for result in pending:
                storage = result.all_gather_output.untyped_storage()
                buffers[storage.data_ptr()] = storage.nbytes()
        return self.shard_bytes + gathered + sum(buffers.values())

    def __enter__(self) -> HeldBytes:
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

        self.cls, self.saved = FSDPParamGroup, (FSDPParamGroup.unshard, FSDPParamGroup.wait_for_unshard)
        tracker = self

        def sampled(method: Any) -> Any:
            def wrapper(group: Any, *args: Any, **kwargs: Any) -> Any:
                result = method(group, *args, **kwargs)
                tracker.peak = max(tracker.peak, tracker.now())
                return result
            return wrapper

        FSDPParamGroup.unshard, FSDPParamGroup.wait_for_unshard = (sampled(m) for m in self.saved)
        self.peak = self.now()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.cls.unshard, self.cls.wait_for_unshard = self.saved


def synthetic_batch(prompts: int, group_size: int, prompt_tokens: int, completion_tokens: int, vocab: int) -> Any:
    """Groups of random prompts and completions (uneven lengths), random advantages, every group kept."""
    import torch

    from grpo_cli.engines.base import Rollouts
    from grpo_cli.rewards import RewardFailures, Scores
    from grpo_cli.step.collect import Groups

    g = torch.Generator().manual_seed(1)
    P, G = prompts, group_size
    prompt_ids = [torch.randint(1, vocab, (prompt_tokens - p % 4,), generator=g).tolist() for p in range(P)]
    completion_ids = [[torch.randint(1, vocab, (completion_tokens - (p + i) % 8,), generator=g).tolist()
                       for i in range(G)] for p in range(P)]
    rollouts = Rollouts(prompt_ids, completion_ids, [[[-2.0] * len(c) for c in grp] for grp in completion_ids],
                        [["x"] * G for _ in range(P)], [[False] * G for _ in range(P)])
    n = P * G
    none = torch.zeros(P, dtype=torch.bool)
    return Groups([{}] * P, prompt_ids, rollouts, Scores([0.0] * n, {"correct": [0.0] * n}, [False] * n),
                  RewardFailures(), torch.zeros(P, G), torch.randn(P, G, generator=g), none, none,
                  torch.ones(P, dtype=torch.bool), dropped=torch.zeros(P, G, dtype=torch.bool))


def update_once(build: Callable[[], Any], reshard_layers: bool, groups: Any, dist: Any,
                compute_dtype: str | None = None) -> dict:
    """The reference pass and one optimizer step of a model from `build()` (the same weights at every call),
    FSDP2-sharded with `reshard_layers` and gathers in `compute_dtype`: the peak held bytes, the bytes of the
    root group and of the largest layer, seconds, loss, grad norm and the final weights."""
    import torch

    from grpo_cli.config import RewardSpec, RolloutConfig, TrainConfig, TrainerConfig
    from grpo_cli.dist.shard import full_tensors, shard_model
    from grpo_cli.step.batch import TrainBatch
    from grpo_cli.step.state import RunState
    from grpo_cli.step.update import fill_logprobs, loss_params, update

    P = len(groups.prompt_ids)
    cfg = TrainConfig(task="t", rewards=[RewardSpec(name="correct")],
                      rollout=RolloutConfig(prompts_per_step=P, group_size=groups.group_size),
                      trainer=TrainerConfig(lr=1e-4, kl_coef=0.02, micro_batch_size=P * groups.group_size // 4))
    whole = build()
    full_bytes = sum(p.nbytes for p in whole.parameters())
    layer_bytes = max(sum(p.nbytes for p in layer.parameters()) for layer in whole.model.layers)
    root_bytes = full_bytes - sum(p.nbytes for p in whole.model.layers.parameters())
    policy = shard_model(whole.train(), dist, reshard_layers, compute_dtype)
    reference = shard_model(build().eval().requires_grad_(False), dist, reshard_layers)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-4)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: 1.0)
    params = loss_params(cfg)
    batch = TrainBatch.build(groups, 0, cfg.trainer, dist, params)
    state = RunState(task=None, dist=dist, run_dir=None, start=None, policy=policy, reference=reference, engine=None,
                     optimizer=optimizer, scheduler=scheduler, pool=None, heldout=None)  # what the stages read
    dist.barrier()
    started = time.perf_counter()
    with HeldBytes(policy) as held:
        fill_logprobs(state, batch, groups, cfg)
        stats = update(state, batch, params, cfg)
    seconds = time.perf_counter() - started
    return {"reshard_layers": reshard_layers, "compute_dtype": compute_dtype, "peak_param_bytes": held.peak,
            "shard_bytes": held.shard_bytes, "full_model_bytes": full_bytes, "root_bytes": root_bytes,
            "layer_bytes": layer_bytes, "peak_share_of_model": held.peak / full_bytes, "update_s": seconds,
            "loss": stats["loss"], "grad_norm": stats["grad_norm"], "micro_batches": len(batch.micro_batches),
            "weights": {name: t.clone() for name, t in full_tensors(policy)}}


def worker(args: argparse.Namespace) -> None:
    import torch

    from grpo_cli.dist import Dist

    torch.set_num_threads(1)
    dist = Dist.init("cpu")
    groups = synthetic_batch(args.prompts, args.group_size, args.prompt_tokens, args.completion_tokens, 4096)
    runs = [update_once(lambda: random_qwen2(args.layers), mode, groups, dist) for mode in (True, False)]
    if dist.is_main:
        same = all(torch.equal(runs[0]["weights"][k], runs[1]["weights"][k]) for k in runs[0]["weights"])
        report = {"ranks": dist.world_size, "layers": args.layers, "params": runs[0]["full_model_bytes"] // 4,
                  "weights_bit_identical": same, "runs": [{k: v for k, v in r.items() if k != "weights"} for r in runs]}
        print(json.dumps(report, indent=2))
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--layers", type=int, default=32, help="decoder layers (32: 70.8M parameters)")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--completion-tokens", type=int, default=32)
    parser.add_argument("--out", help="write the report to this JSON file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.ranks),
           __file__, "--worker", *sys.argv[1:]]
    sys.exit(subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}).returncode)


if __name__ == "__main__":
    main()
