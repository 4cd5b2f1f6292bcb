"""One update on a fixed synthetic batch for each loss variant, at whatever world size torchrun gives (one
rank when run without torchrun);
rank 0 saves the full weights and the stats of each variant to argv[1]/VARIANT.pt, and each rank what the
loop's collectives gave it to argv[1]/collectives_rankR.json. argv[2] is trainer.micro_batch_size,
argv[3:] the variants (VARIANTS' keys).

Used by tests/test_distributed.py: 1 rank (in the test's own process, `update_once`), 2 ranks and
different micro-batch caps must give the same weights (the loss and gradient do not depend on how
the batch is split), tool-run trajectories with tokens out of the loss included. The same job saves
`reshard_runs` to argv[1]/reshard.pt: what a rank holds with and without layer-by-layer resharding."""

import json
import os
import sys
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from grpo_cli.config import LoraConfig, ModelConfig, RewardSpec, RolloutConfig, TrainConfig, TrainerConfig
from grpo_cli.dist import Dist
from grpo_cli.dist.shard import full_tensors, shard_model
from grpo_cli.engines.base import Rollouts
from grpo_cli.rewards import RewardFailures, Scores
from grpo_cli.step.batch import TrainBatch
from grpo_cli.step.collect import Groups
from grpo_cli.step.state import RunState
from grpo_cli.step.update import fill_logprobs, loss_params, update


def tiny(seed):
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=True)
    return Qwen2ForCausalLM(config)


# The variants: trainer.* overrides on top of the default loss. seq_mask's band rejects some samples of
# this batch (the tiny model's logprobs against the fixed sampling ones) and keeps others.
VARIANTS = {
    "grpo": {},
    "token_mean": {"loss": "token_mean"},
    "kl_in_reward": {"kl_in_reward": True},
    "seq_mask": {"mismatch_correction": "seq_mask", "seq_mask_low": 0.04},
    "tool_tokens": {"loss": "token_mean"},  # trajectories: tokens 1-2 of the longer completions are a tool's reply
    "lora": {},  # LoRA adapters on tiny(0): the reference is the same module with its adapters off
}
TRAJECTORIES = {"tool_tokens"}


def tool_reply_mask(completion: list[int]) -> list[int]:
    """1 on the model's tokens: all of a short completion; a longer one has a 2-token tool reply after its first."""
    return [0 if len(completion) > 3 and t in (1, 2) else 1 for t in range(len(completion))]


def update_once(micro_batch_size: int, variant: str, dist: Dist) -> dict:
    """The weights (full), the update's stats and the number of passes after one step of `variant`."""
    g = torch.Generator().manual_seed(1)
    P, G = 5, 4
    prompt_ids = [torch.randint(1, 40, (3 + p,), generator=g).tolist() for p in range(P)]
    completion_ids = [[torch.randint(1, 40, (2 + (p + i) % 5,), generator=g).tolist() for i in range(G)]
                      for p in range(P)]
    advantages = torch.randn(P, G, generator=g)
    # 3 groups kept, 2 minibatches of [2, 1] groups: in the second, rank 1 has no group at all (empty passes)
    keep = torch.tensor([True, True, False, True, False])
    rollouts = Rollouts(prompt_ids, completion_ids, [[[-0.5] * len(c) for c in grp] for grp in completion_ids],
                        [["x"] * G for _ in range(P)], [[False] * G for _ in range(P)])
    if variant in TRAJECTORIES:  # attended by every pass, out of the loss; no sampling logprob on a reply
        rollouts.model_mask = [[tool_reply_mask(c) for c in grp] for grp in completion_ids]
        rollouts.sampling_logprobs = [[[-0.5 * m for m in tool_reply_mask(c)] for c in grp] for grp in completion_ids]
    none = torch.zeros(P, dtype=torch.bool)
    groups = Groups([{}] * P, prompt_ids, rollouts, Scores([0.0] * (P * G), {"correct": [0.0] * (P * G)}, [False] * (P * G)),
                    RewardFailures(), torch.zeros(P, G), advantages, none, none, keep,
                    dropped=torch.zeros(P, G, dtype=torch.bool))
    lora = LoraConfig(rank=4, alpha=8) if variant == "lora" else LoraConfig()
    cfg = TrainConfig(task="t", rewards=[RewardSpec(name="correct")], rollout=RolloutConfig(prompts_per_step=P),
                      model=ModelConfig(lora=lora),
                      trainer=TrainerConfig(lr=0.5, kl_coef=0.1, ppo_epochs=2, minibatches=2,
                                            micro_batch_size=micro_batch_size, clip_eps=0.2, **VARIANTS[variant]))
    if lora.enabled:
        from grpo_cli.weights.lora import with_adapters

        torch.manual_seed(2)  # the adapters' A matrices (B starts at 0)
        policy = shard_model(with_adapters(tiny(0), lora, "tiny").train(), dist)
        reference = None  # the policy with its adapters off
    else:
        policy = shard_model(tiny(0).train(), dist)
        reference = shard_model(tiny(1).eval().requires_grad_(False), dist)
    # Plain SGD: Adam divides by the gradient's own size, so float noise in a near-zero gradient
    # would become a full lr step and hide whether two splits agree.
    optimizer = torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=0.5)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: 1.0)
    params = loss_params(cfg)
    batch = TrainBatch.build(groups, 0, cfg.trainer, dist, params)
    state = RunState(task=None, dist=dist, run_dir=None, start=None, policy=policy, reference=reference, engine=None,
                     optimizer=optimizer, scheduler=scheduler, pool=None, heldout=None)  # what the stages read
    fill_logprobs(state, batch, groups, cfg)
    stats = update(state, batch, params, cfg)
    weights = {name: t.clone() for name, t in full_tensors(policy)}
    return {"weights": weights, "stats": stats, "passes": len(batch.micro_batches)}


def bench_reshard():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_reshard", Path(__file__).parents[2] / "scripts" / "bench_reshard.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def reshard_model():
    """The 6-layer random Qwen2 of `reshard_runs` (the same weights at every call)."""
    return bench_reshard().random_qwen2(6, hidden=128, vocab=256)


def reshard_start() -> dict:
    """`reshard_model`'s weights before the update, by the names `full_tensors` gives."""
    return {name: t.detach().clone() for name, t in reshard_model().state_dict().items()}


def reshard_runs(dist: Dist) -> dict:
    """scripts/bench_reshard.py's update on `reshard_model`: layer by layer, gathered through the step, and layer
    by layer with bf16 gathers over fp32 master weights (as on CUDA); the peaks, sizes, stats and weights."""
    bench = bench_reshard()
    build = reshard_model
    groups = bench.synthetic_batch(4, 4, 12, 12, vocab=256)
    modes = {"layers": (True, None), "step": (False, None), "layers_bf16": (True, "bfloat16")}
    return {name: bench.update_once(build, layers, groups, dist, dtype) for name, (layers, dtype) in modes.items()}


if __name__ == "__main__":
    torch.set_num_threads(1)
    ranks = Dist.init("cpu")
    for name in sys.argv[3:]:
        result = update_once(int(sys.argv[2]), name, ranks)
        if ranks.is_main:
            torch.save(result, Path(sys.argv[1]) / f"{name}.pt")
    if ranks.world_size == 1:  # run without torchrun: the one-rank reference of each variant, nothing more
        sys.exit(0)
    reshard = reshard_runs(ranks)
    if ranks.is_main:
        torch.save(reshard, Path(sys.argv[1]) / "reshard.pt")
    # The loop's own collectives (dist.Dist), as each rank sees them
    seen = {"rank": ranks.rank, "world_size": ranks.world_size, "is_main": ranks.is_main,
            "sum": ranks.sum([float(ranks.rank + 1), 0.5]), "all": ranks.all(ranks.rank == 0),
            "any": ranks.any(ranks.rank == 1), "broadcast": ranks.broadcast({"from": ranks.rank})["from"],
            "gather": ranks.gather(ranks.rank * 10)}
    (Path(sys.argv[1]) / f"collectives_rank{ranks.rank}.json").write_text(json.dumps(seen))
    ranks.barrier()
    # Every file is written and closed. Leave without the interpreter's teardown: with the two cores busy
    # (the suite's two workers), gloo's threads were at times still joinable when it ran, and rank 0 aborted
    # ("terminate called without an active exception") after its work was done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
