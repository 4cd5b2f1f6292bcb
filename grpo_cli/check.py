"""`grpo check recipe=X [overrides]`: the batch arithmetic of a config and the settings that do nothing.

Loads no model and imports no torch: the numbers come from the config and the model's
config.json, so it answers in about a second, before a run is started.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from grpo_cli.config import TrainConfig

FP32_BYTES = 4


def model_shape(name_or_path: str) -> dict[str, Any] | None:
    """The model's config.json as a dict, or None when it is not a local directory (a hub id)."""
    from grpo_cli.checkpoint import resolve_model_path

    try:
        path = Path(resolve_model_path(name_or_path)) / "config.json"
    except FileNotFoundError:
        return None
    return json.loads(path.read_text()) if path.is_file() else None


def linear_shapes(shape: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(in, out) of each linear layer of one decoder layer of a Llama/Qwen2-style model, from its config."""
    H = shape["hidden_size"]
    heads = shape.get("num_attention_heads", 1)
    head_dim = shape.get("head_dim", H // heads)
    q, kv, inter = heads * head_dim, shape.get("num_key_value_heads", heads) * head_dim, shape.get("intermediate_size", 4 * H)
    return {"q_proj": (H, q), "k_proj": (H, kv), "v_proj": (H, kv), "o_proj": (q, H), "gate_proj": (H, inter),
            "up_proj": (H, inter), "down_proj": (inter, H)}


def layer_parameter_count(shape: dict[str, Any]) -> int:
    """Parameters of one decoder layer of a Llama/Qwen2-style model from its config: attention, MLP, norms."""
    dims = linear_shapes(shape)
    bias = dims["q_proj"][1] + 2 * dims["k_proj"][1] if shape.get("model_type") == "qwen2" else 0  # q, k, v biases
    return sum(i * o for i, o in dims.values()) + bias + 2 * shape["hidden_size"]


def parameter_count(shape: dict[str, Any]) -> int:
    """Parameters of a Llama/Qwen2-style decoder from its config: embeddings, attention, MLP, norms, head."""
    H, L, V = shape["hidden_size"], shape["num_hidden_layers"], shape["vocab_size"]
    head = 0 if shape.get("tie_word_embeddings", False) else V * H
    return V * H + L * layer_parameter_count(shape) + H + head


def batch_lines(cfg: TrainConfig, world_size: int) -> list[str]:
    """The step's arithmetic: prompts, completions, optimizer steps, tokens."""
    r, t = cfg.rollout, cfg.trainer
    P, G = r.prompts_per_step, r.group_size
    rounds = r.max_sampling_rounds if r.dynamic_sampling else 1
    updates = t.ppo_epochs * t.minibatches
    sampled = f"{P} prompts" + (f" (up to {P * rounds} over {rounds} dynamic-sampling rounds)" if rounds > 1 else "")
    return [
        f"per step: {sampled} x {G} samples = {P * G} completions in the loss; "
        f"per rank ({world_size}): {P // world_size} prompts, {P * G // world_size} completions",
        f"optimizer steps: {t.ppo_epochs} epoch(s) x {t.minibatches} minibatch(es) = {updates} per rollout batch, "
        f"{updates * t.steps} in {t.steps} steps (the lr schedule counts these)",
        f"completion tokens per step: at most {P * G * r.trajectory_tokens} (P x G x "
        f"{'the trajectory cap' if r.multi_turn else 'rollout.max_new_tokens'}={r.trajectory_tokens}); micro-batches of "
        f"<= {t.micro_batch_size} completions" + (f" and <= {t.micro_batch_tokens} padded tokens" if t.micro_batch_tokens else ""),
        *tool_lines(cfg),
    ]


def tool_lines(cfg: TrainConfig) -> list[str]:
    """A tool run's budgets: the tools and their call strings, the turn, call and token caps."""
    r = cfg.rollout
    if not r.multi_turn:
        return []
    from grpo_cli.tools.load import call_strings

    tools = ", ".join(f"{spec.function} ({call_strings(spec)[0]}...)" for spec in r.tools) or "none"
    env = r.environment
    env_line = [f"environment: {env.cls}, one instance per sample built from its row; its public methods are "
                "tools" + (f" (tags: {', '.join(f'{m} {t[0]}...' for m, t in env.tags.items())})" if env.tags else "")
                + (f"; {env.timeout_s:g} s per call" if env.timeout_s else "")] if env.cls else []
    return [f"tools: {tools}; results between {r.tool_result_tags[0]!r} and {r.tool_result_tags[1]!r}", *env_line,
            f"tool budgets per trajectory: <= {r.max_turns} model turns of <= {r.max_new_tokens} tokens, "
            f"<= {r.max_tool_calls} calls, <= {r.max_tool_result_tokens} tokens per result, <= {r.trajectory_tokens} "
            "tokens after the prompt (rollout.max_trajectory_tokens); tool replies are attended but leave the loss"]


def adapter_parameter_count(shape: dict[str, Any], rank: int, targets: list[str]) -> int:
    """Parameters of rank-`rank` LoRA adapters (A: r x in, B: out x r) on `targets` in every decoder layer."""
    dims = linear_shapes(shape)
    return shape["num_hidden_layers"] * sum(rank * sum(dims[t]) for t in targets if t in dims)


def memory_lines(cfg: TrainConfig, shape: dict[str, Any] | None, world_size: int) -> list[str]:
    """A rough estimate: weights, gradients, AdamW's two moments, the reference, one logits chunk (fp32; with
    LoRA the frozen base in model.dtype and the adapters with their gradients and moments in fp32)."""
    if shape is None:
        return [f"memory: {cfg.model.name_or_path} is not a local model directory; no estimate"]
    if cfg.model.lora.enabled:
        return [lora_memory_line(cfg, shape, world_size)]
    params, layer = parameter_count(shape), layer_parameter_count(shape)
    gib = 2 ** 30
    # weights, grads and 2 Adam moments are sharded over ranks; during a pass a rank also holds what FSDP2 gathers
    # (dist/shard.py): the root group (embeddings, final norm, head) and 2 layers, or the whole model without
    # dist.reshard_layers
    if world_size == 1:
        gathered, held = 0, "the whole model"
    elif cfg.dist.reshard_layers:
        gathered, held = params - shape["num_hidden_layers"] * layer + 2 * layer, "its shard + embeddings + 2 layers"
    else:
        gathered, held = params, "its shard + the whole model"
    train = params * FP32_BYTES * 4 / world_size + gathered * FP32_BYTES
    ref = (params / world_size + gathered) * FP32_BYTES if cfg.trainer.kl_coef > 0 else 0  # during its pass
    logits = cfg.trainer.logprob_chunk_tokens * shape["vocab_size"] * FP32_BYTES * 3  # logits, softmax, grad
    return [f"memory (fp32, per rank, estimate): {params / 1e6:.1f}M parameters -> policy + grads + AdamW "
            f"{train / gib:.2f} GiB (weights at their peak: {held}), reference {ref / gib:.2f} GiB, one logits "
            f"chunk {logits / gib:.3f} GiB; activations and the rollout engine's KV cache come on top"]


def lora_memory_line(cfg: TrainConfig, shape: dict[str, Any], world_size: int) -> str:
    """With LoRA: the base once, frozen, in model.dtype (sharded, plus what FSDP2 gathers: the root group and 2
    layers), the adapters with fp32 gradients and AdamW moments; no reference copy (the adapters turned off)."""
    lora, gib = cfg.model.lora, 2**30
    params, layer = parameter_count(shape), layer_parameter_count(shape)
    adapters = adapter_parameter_count(shape, lora.rank, lora.target_modules)
    base_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}[cfg.model.dtype]
    gathered = 0 if world_size == 1 else params - shape["num_hidden_layers"] * layer + 2 * layer
    base = (params / world_size + gathered) * base_bytes
    trained = adapters * FP32_BYTES * 4 / world_size  # weights, gradients, 2 AdamW moments
    logits = cfg.trainer.logprob_chunk_tokens * shape["vocab_size"] * FP32_BYTES * 3
    return (f"memory (LoRA, per rank, estimate): {params / 1e6:.1f}M base parameters in {cfg.model.dtype} "
            f"{base / gib:.2f} GiB, {adapters / 1e6:.2f}M adapter parameters + grads + AdamW (fp32) "
            f"{trained / gib:.3f} GiB, reference 0 GiB (the base with the adapters off), one logits chunk "
            f"{logits / gib:.3f} GiB; activations and the rollout engine's weights and KV cache come on top")


def correctness_line(cfg: TrainConfig) -> str:
    """Which reward is the correctness check, and what it decides."""
    i, spec = next((i, s) for i, s in enumerate(cfg.rewards) if s.correctness or len(cfg.rewards) == 1)
    return (f"correctness check: rewards[{i}] {spec.name} (held-out pass@1, the all-correct/all-wrong groups, "
            "the best checkpoint)")


def warnings(cfg: TrainConfig) -> list[str]:
    """Settings that change nothing in this config, each with the reason."""
    r, t = cfg.rollout, cfg.trainer
    one_update = t.ppo_epochs * t.minibatches == 1
    out = []
    if one_update and t.mismatch_correction == "none":
        ratio_knobs = [k for k, on in (("trainer.clip_eps_high", t.clip_eps_high is not None),
                                       ("trainer.clip_ratio_c", t.clip_ratio_c is not None),
                                       ("trainer.policy_loss=gspo", t.policy_loss == "gspo")) if on]
        if ratio_knobs:
            out.append(f"{', '.join(ratio_knobs)}: with one optimizer step per batch the ratio is exactly 1, so "
                       "clipping never acts; set trainer.ppo_epochs or trainer.minibatches > 1")
    if t.policy_loss == "gspo" and t.clip_eps >= 0.05:
        out.append(f"trainer.policy_loss=gspo with clip_eps={t.clip_eps}: sequence ratios rarely leave that band; "
                   "the GSPO paper clips at 3e-4 / 4e-4")
    if t.kl_coef == 0 and t.kl_estimator != "k3":
        out.append(f"trainer.kl_estimator={t.kl_estimator} with trainer.kl_coef=0: there is no KL term")
    if r.group_size == 2 and t.advantage == "group_std":
        out.append("rollout.group_size=2 with trainer.advantage=group_std: every advantage is +1, -1 or 0 whatever "
                   "the reward gap; use a larger group or trainer.advantage=group_mean")
    if t.filter_zero_variance and t.kl_coef == 0 and t.entropy_coef == 0:
        out.append("trainer.filter_zero_variance without a KL or entropy term: all-equal groups already have zero "
                   "advantage, so the filter only changes the loss's normalizer")
    if r.dynamic_sampling and t.filter_zero_variance:
        out.append("trainer.filter_zero_variance with rollout.dynamic_sampling: dynamic sampling keeps only groups "
                   "with reward variance already")
    if t.mismatch_correction == "none" and (t.tis_cap != 2.0 or (t.seq_mask_low, t.seq_mask_high) != (0.5, 2.0)):
        out.append("trainer.tis_cap / seq_mask_*: unused with trainer.mismatch_correction=none")
    if r.dynamic_sampling and r.max_sampling_rounds == 1:
        out.append("rollout.dynamic_sampling with max_sampling_rounds=1: no further round is ever sampled")
    return out


def run_check(cfg: TrainConfig, run_dir: Any) -> int:
    world_size = max(cfg.dist.world_size, int(os.environ.get("WORLD_SIZE", "1")))  # dist.* or plain torchrun
    print(f"grpo check: {cfg.task} | model {cfg.model.name_or_path} | {cfg.trainer.steps} steps")
    lines = batch_lines(cfg, world_size) + memory_lines(cfg, model_shape(cfg.model.name_or_path), world_size)
    lines.append(correctness_line(cfg))
    for line in lines:
        print(f"  {line}")
    found = warnings(cfg)
    for line in found:
        print(f"  warning: {line}")
    if not found:
        print("  no setting without effect found")
    return 0
