"""What a config will cost before it runs: the model's shape (from its config.json, or the hub models the GPU
recipes name), parameter counts, the trainer's and the engine's memory by GPU role, a teacher's and a reward
model's, and the vLLM servers a run starts. `grpo check` prints these lines.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from grpo_cli.config import TrainConfig
from grpo_cli.dist.ranks import gpu_roles, split_roles
from grpo_cli.engines.options import (
    ENGINE_WORKSPACE_GIB,
    adapter_sleep_level,
    engine_on_trainer_rank,
    lora_requests_wanted,
    sleep_wanted,
)
from grpo_cli.weights.checkpoint import resolve_model_path

FP32_BYTES = 4

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # bytes an element, by model.dtype

# The shapes of the hub models the GPU recipes name, from their published config.json (the fields the estimate
# reads), so that `grpo check` answers for them on a machine that has never downloaded them.
HUB_SHAPES: dict[str, dict[str, Any]] = {
    "Qwen/Qwen2.5-0.5B-Instruct": dict(model_type="qwen2", hidden_size=896, intermediate_size=4864,
                                       num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                                       vocab_size=151936, tie_word_embeddings=True),
    "Qwen/Qwen2.5-7B-Instruct": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944,
                                     num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                                     vocab_size=152064, tie_word_embeddings=False),
}

# Bytes autograd keeps for the backward per token and decoder layer, per unit of (hidden_size, intermediate_size,
# key/value width), by compute dtype and LoRA: measured with saved-tensor hooks on Qwen2-shaped models (sdpa
# attention, no recomputation; tests/test_gpu_path.py measures again). "bfloat16" is autocast over fp32 master
# weights, or with LoRA over a bf16 base with fp32 adapters, as the trainer runs on CUDA.
ACTIVATION_BYTES = {("float32", False): (32, 16, 8), ("float32", True): (25, 16, 8),
                    ("bfloat16", False): (30, 8, 4), ("bfloat16", True): (25, 8, 4)}

# What a prompt is assumed to take when the estimate cannot tokenize the data (a chat-template bike_pricing
# prompt is well under it)
PROMPT_TOKENS = 256

# What a sleeping vLLM engine is taken to keep on the GPU (its CUDA context and allocations outside its memory
# pool): an assumption, not measured here
ASLEEP_GIB = 1.0

def model_shape(name_or_path: str) -> dict[str, Any] | None:
    """The model's config.json as a dict (a hub model in HUB_SHAPES without a local copy: its shape from there),
    or None when neither has it."""
    try:
        path = Path(resolve_model_path(name_or_path)) / "config.json"
    except FileNotFoundError:
        return HUB_SHAPES.get(name_or_path)
    if not path.is_file():
        return HUB_SHAPES.get(name_or_path)
    config = json.loads(path.read_text())
    if "text_config" in config and "vision_config" in config:  # a vision-language model: its text model's shape,
        return {**config["text_config"], "vision": config["vision_config"],  # with the tower beside it
                "scale_factor": config.get("scale_factor", 1), "tie_word_embeddings": config.get(
                    "tie_word_embeddings", config["text_config"].get("tie_word_embeddings", False))}
    return config

def vision_parameter_count(shape: dict[str, Any]) -> int:
    """Parameters of a vision-language model's tower and connector (Idefics3/SmolVLM: a SigLIP-style encoder, a
    pixel-shuffle projection into the text model's width); 0 for a text model."""
    v = shape.get("vision")
    if not v:
        return 0
    Hv, inter, layers = v.get("hidden_size", 768), v.get("intermediate_size", 3072), v.get("num_hidden_layers", 12)
    patch, side, channels = v.get("patch_size", 16), v.get("image_size", 224), v.get("num_channels", 3)
    embeddings = channels * patch * patch * Hv + Hv + (side // patch) ** 2 * Hv
    layer = 4 * (Hv * Hv + Hv) + 4 * Hv + 2 * Hv * inter + inter + Hv  # q k v out, two norms, the MLP
    connector = Hv * shape.get("scale_factor", 1) ** 2 * shape["hidden_size"]
    return embeddings + layers * layer + 2 * Hv + connector

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
    if shape.get("attention_bias"):  # a Llama with them: q, k, v and o
        bias = dims["q_proj"][1] + 2 * dims["k_proj"][1] + shape["hidden_size"]
    return sum(i * o for i, o in dims.values()) + bias + 2 * shape["hidden_size"]

def parameter_count(shape: dict[str, Any]) -> int:
    """Parameters of a Llama/Qwen2-style decoder from its config: embeddings, attention, MLP, norms, head."""
    H, L, V = shape["hidden_size"], shape["num_hidden_layers"], shape["vocab_size"]
    head = 0 if shape.get("tie_word_embeddings", False) else V * H
    return V * H + L * layer_parameter_count(shape) + H + head + vision_parameter_count(shape)

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
    frozen = vision_parameter_count(shape) if cfg.model.freeze_vision else 0  # no gradient, no AdamW moments
    train = (params * 4 - frozen * 3) * FP32_BYTES / world_size + gathered * FP32_BYTES
    ref = (params / world_size + gathered) * FP32_BYTES if cfg.trainer.kl_coef > 0 else 0  # during its pass
    logits = cfg.trainer.logprob_chunk_tokens * shape["vocab_size"] * FP32_BYTES * 3  # logits, softmax, grad
    tower = (f" (the vision tower and connector {vision_parameter_count(shape) / 1e6:.2f}M of them"
             f"{', frozen' if frozen else ''})" if shape.get("vision") else "")
    return [f"memory (fp32, per rank, estimate): {params / 1e6:.1f}M parameters{tower} -> policy + grads + AdamW "
            f"{train / gib:.2f} GiB (weights at their peak: {held}), reference {ref / gib:.2f} GiB, one logits "
            f"chunk {logits / gib:.3f} GiB; activations and the rollout engine's KV cache come on top"]

def lora_memory_line(cfg: TrainConfig, shape: dict[str, Any], world_size: int) -> str:
    """With LoRA: the base once, frozen, in model.dtype (sharded, plus what FSDP2 gathers: the root group and 2
    layers), the adapters with fp32 gradients and AdamW moments; no reference copy (the adapters turned off)."""
    lora, gib = cfg.model.lora, 2**30
    params, layer = parameter_count(shape), layer_parameter_count(shape)
    adapters = adapter_parameter_count(shape, lora.rank, lora.target_modules)
    base_bytes = DTYPE_BYTES[cfg.model.dtype]
    gathered = 0 if world_size == 1 else params - shape["num_hidden_layers"] * layer + 2 * layer
    base = (params / world_size + gathered) * base_bytes
    trained = adapters * FP32_BYTES * 4 / world_size  # weights, gradients, 2 AdamW moments
    logits = cfg.trainer.logprob_chunk_tokens * shape["vocab_size"] * FP32_BYTES * 3
    return (f"memory (LoRA, per rank, estimate): {params / 1e6:.1f}M base parameters in {cfg.model.dtype} "
            f"{base / gib:.2f} GiB, {adapters / 1e6:.2f}M adapter parameters + grads + AdamW (fp32) "
            f"{trained / gib:.3f} GiB, reference 0 GiB (the base with the adapters off), one logits chunk "
            f"{logits / gib:.3f} GiB; activations and the rollout engine's weights and KV cache come on top")

def activation_bytes_per_token(shape: dict[str, Any], dtype: str, lora: bool) -> int:
    """Bytes a forward pass keeps for its backward per token, over every decoder layer (ACTIVATION_BYTES)."""
    per_h, per_i, per_kv = ACTIVATION_BYTES[("float32" if dtype == "float32" else "bfloat16", lora)]
    dims = linear_shapes(shape)
    return shape["num_hidden_layers"] * (per_h * shape["hidden_size"] + per_i * dims["gate_proj"][1]
                                         + per_kv * dims["k_proj"][1])

def started_servers(cfg: TrainConfig) -> list[tuple[str, str, float]]:
    """The vLLM servers grpo starts for the run (server=start): (key, model, KV cache GiB) each. On a GPU each
    runs on rank 0's (the trainer's) with its memory sized explicitly (served.placement)."""
    out = [(f"rewards[{i}].server", spec.model or "", spec.server_kv_cache_gib)
           for i, spec in enumerate(cfg.rewards) if spec.server == "start"]
    if cfg.distill.server == "start":
        out.append(("distill.server", cfg.distill.teacher or "", cfg.distill.server_kv_cache_gib))
    return out

def server_lines(cfg: TrainConfig) -> list[str]:
    """What the started servers hold on rank 0's GPU, throughout the run (weights in model.dtype, their KV cache,
    vLLM's workspace), each and in all (a model whose shape is unknown is named and not counted)."""
    lines, total, gib = [], 0.0, 2**30
    for key, model, kv_cache_gib in started_servers(cfg):
        shape = model_shape(model) if model else None
        if shape is None:
            lines.append(f"  {key}=start: {model or 'its model'} is not a local model directory; its GPU memory is not "
                         f"counted (KV cache {kv_cache_gib:g} GiB + its weights + {ENGINE_WORKSPACE_GIB:g} workspace)")
            continue
        weights = parameter_count(shape) * DTYPE_BYTES[cfg.model.dtype]
        held = weights + (kv_cache_gib + ENGINE_WORKSPACE_GIB) * gib
        total += held
        lines.append(f"  {key}=start: a vLLM server on rank 0's GPU, {held / gib:.1f} GiB throughout (weights "
                     f"{weights / gib:.1f}, KV cache {kv_cache_gib:g} ({key}_kv_cache_gib), workspace "
                     f"{ENGINE_WORKSPACE_GIB:g}); its --gpu-memory-utilization is sized from them")
    if total:
        lines.append(f"  rank 0's GPU: the peak above + {total / gib:.1f} GiB of started servers")
    return lines

def gpu_lines(cfg: TrainConfig, shape: dict[str, Any] | None, world_size: int) -> list[str]:
    """Each rank's GPU at its two peaks, the trainer and a vLLM engine sharing it: while vLLM generates (the
    trainer's weights and AdamW state stay) and while the trainer updates (vLLM asleep with sleep mode); the
    servers grpo starts beside them on rank 0's."""
    if shape is None or (cfg.model.dtype == "float32" and not cfg.trainer.device.startswith("cuda")):
        return []  # a CPU run
    return trainer_gpu_lines(cfg, shape, world_size) + server_lines(cfg)

def trainer_gpu_lines(cfg: TrainConfig, shape: dict[str, Any], world_size: int) -> list[str]:
    """gpu_lines without the started servers."""

    m, r, t, gib = cfg.model, cfg.rollout, cfg.trainer, 2**30
    dtype_bytes = DTYPE_BYTES[m.dtype]
    params, layer = parameter_count(shape), layer_parameter_count(shape)
    gathered = 0 if world_size == 1 else params - shape["num_hidden_layers"] * layer + 2 * layer
    lora = m.lora.enabled
    if lora:  # the base in model.dtype, the adapters and their AdamW moments in fp32; the reference is the base
        adapters = adapter_parameter_count(shape, m.lora.rank, m.lora.target_modules)
        weights = (params / world_size + gathered) * dtype_bytes + adapters * FP32_BYTES / world_size
        moments, grads, ref = adapters * 8 / world_size, adapters * FP32_BYTES / world_size, 0.0
    else:  # fp32 master weights (FSDP2 gathers them in model.dtype), the reference stored in model.dtype
        adapters = 0
        weights = params * FP32_BYTES / world_size + gathered * dtype_bytes
        moments, grads = params * 8 / world_size, params * FP32_BYTES / world_size
        ref = (params / world_size + gathered) * dtype_bytes if t.kl_coef > 0 else 0.0
    ref += teacher_bytes(cfg, world_size) or 0.0  # a distillation teacher in this process: frozen beside the reference
    ref += reward_model_bytes(cfg) or 0.0  # the reward models, whole on each trainer rank
    held_while_generating = weights + ref + (0 if t.offload_optimizer else moments)
    prompts = r.prompts_per_step // world_size // t.minibatches
    tokens = prompts * PROMPT_TOKENS + t.micro_batch_size * r.trajectory_tokens  # the prompt pass + one micro-batch
    activations = tokens * activation_bytes_per_token(shape, m.dtype, lora)
    logits = t.logprob_chunk_tokens * shape["vocab_size"] * FP32_BYTES * 3
    updating = weights + ref + moments + grads + activations + logits
    lines = [f"on a GPU, per rank (estimate; {m.dtype}, trainer.device=cuda): the trainer holds {updating / gib:.1f} "
             f"GiB while it updates (weights {weights / gib:.1f}, reference{' + teacher' if cfg.distill.teacher and not cfg.distill.server else ''}{' + reward models' if reward_model_bytes(cfg) else ''} {ref / gib:.1f}, gradients and AdamW "
             f"{(grads + moments) / gib:.1f}, activations {activations / gib:.1f} for {tokens} tokens: {prompts} "
             f"prompts of <= {PROMPT_TOKENS} and {t.micro_batch_size} completions of <= {r.trajectory_tokens}, one "
             f"logits chunk {logits / gib:.1f})"]
    if r.engine != "vllm":
        return lines + [f"  peak {updating / gib:.1f} GiB (rollout.engine={r.engine} samples from the policy itself)"]
    tp = r.tensor_parallel_size
    engine = params * dtype_bytes / tp + adapters * dtype_bytes + (r.kv_cache_gib + ENGINE_WORKSPACE_GIB) * gib
    awake = (f"vLLM {engine / gib:.1f} GiB awake (weights {params * dtype_bytes / tp / gib:.1f}, KV cache "
             f"{r.kv_cache_gib:g}, workspace {ENGINE_WORKSPACE_GIB:g})")
    if not engine_on_trainer_rank(r):  # split: the run's own rule (engines/options.py), not a copy of it
        share = (f"rollout.gpu_memory_utilization={r.gpu_memory_utilization} of its GPU"
                 if r.gpu_memory_utilization is not None else awake)
        d = cfg.dist
        return lines + [f"  GPUs ({gpu_roles(cfg.trainer_ranks, d.nproc_per_node, d.nnodes)}; each rank its node's "
                        "LOCAL_RANK-th):",
                        f"  peak {updating / gib:.1f} GiB on each trainer rank's GPU (no engine there)",
                        f"  each generator rank's GPU: {share}, throughout (a split job's engine never sleeps)"]
    if r.gpu_memory_utilization is not None:
        return lines + [f"  vLLM takes rollout.gpu_memory_utilization={r.gpu_memory_utilization} of the device"]
    sleeping = sleep_wanted(r, "cuda")  # the run's rule: not while the engine samples beside the update (K > 0)
    level = adapter_sleep_level(r.sleep_level) if lora and lora_requests_wanted(r, on_cpu=False) else r.sleep_level
    asleep = ASLEEP_GIB * gib if sleeping else engine
    generating, peak = held_while_generating + engine, max(held_while_generating + engine, updating + asleep)
    return lines + [
        f"  {awake}, "
        + (f"{ASLEEP_GIB:g} asleep (sleep level {level})" if sleeping else
           "awake throughout (" + ("it samples while the trainer steps" if r.max_staleness else "rollout.sleep_mode=off")
           + ")"),
        f"  peak {peak / gib:.1f} GiB: {generating / gib:.1f} while vLLM generates"
        + (" (AdamW's moments offloaded)" if t.offload_optimizer else "")
        + f", {(updating + asleep) / gib:.1f} while the trainer updates"]

def placement_line(cfg: TrainConfig, shape: dict[str, Any] | None) -> str:
    """rollout.placement=split: which ranks do what, and what each generator rank holds."""
    engine = "a vLLM engine"
    if shape is not None:
        weights = parameter_count(shape) * DTYPE_BYTES[cfg.model.dtype] / 2**30
        engine += f" (weights {weights:.2f} GiB + KV cache {cfg.rollout.kv_cache_gib:g} GiB)"
    trainers, world = cfg.trainer_ranks, cfg.dist.world_size
    train = "alone, no FSDP2" if trainers == 1 else f"FSDP2 over {trainers}"
    return (f"placement: split; {split_roles(trainers, world)}: the memory above is each trainer rank's ({train}, no "
            f"engine); each generator holds {engine} and samples its share of every step's prompts; after every "
            "optimizer step the weights go to every generator at once (one broadcast, tensor by tensor)")

def teacher_bytes(cfg: TrainConfig, world_size: int) -> float | None:
    """What an in-process distill.teacher holds on each trainer rank through the run (frozen, in model.dtype, sharded
    like the reference, plus what FSDP2 gathers: the root group and 2 layers); 0 without one or when it is served,
    None when its shape is unknown (not a local model directory)."""
    d = cfg.distill
    if not d.teacher or d.server:
        return 0.0
    shape = model_shape(d.teacher)
    if shape is None:
        return None
    params, layer = parameter_count(shape), layer_parameter_count(shape)
    gathered = 0 if world_size == 1 else params - shape["num_hidden_layers"] * layer + 2 * layer
    return (params / world_size + gathered) * DTYPE_BYTES[cfg.model.dtype]

def reward_model_bytes(cfg: TrainConfig) -> float | None:
    """What the recipe's reward models hold on each trainer rank through the run: each whole (not sharded), frozen,
    in model.dtype; 0 without one, None when one's shape is unknown (not a local model directory)."""
    total = 0.0
    for spec in cfg.rewards:
        if spec.model is None or spec.judge is not None or spec.server is not None:  # served: not on the trainer
            continue
        shape = model_shape(spec.model)
        if shape is None:
            return None
        total += parameter_count(shape) * DTYPE_BYTES[cfg.model.dtype]
    return total

def reward_model_lines(cfg: TrainConfig) -> list[str]:
    """Each learned reward: what it is, how it reads a sample, where it runs and what it holds on a trainer rank."""
    lines = []
    for i, spec in enumerate(cfg.rewards):
        key = f"rewards[{i}] {spec.name} (weight {spec.weight:g})"
        where = ("a vLLM server grpo starts for the run" if spec.server == "start" else f"the server at {spec.server}")
        if spec.judge is not None:
            lines.append(f"judge {key}: {spec.model or 'the served model'} on {where}, reply -> score by parser "
                         f"{spec.parser}, {spec.requests_in_flight} requests at once, {spec.timeout_s or 60.0:g} s each")
            continue
        if spec.model is None:
            continue
        shape = model_shape(spec.model)
        if spec.server is not None:
            held = f"served by {where} ({spec.requests_in_flight} requests at once, {spec.timeout_s or 60.0:g} s each)"
        elif shape is None:
            held = "no memory estimate (not a local model directory)"
        else:
            held = (f"{parameter_count(shape) / 1e6:.1f}M parameters, "
                    f"{parameter_count(shape) * DTYPE_BYTES[cfg.model.dtype] / 2**30:.3f} GiB per trainer rank in "
                    f"{cfg.model.dtype} (whole, frozen, on the trainer's device through the run)")
        clip = f", clipped to +-{spec.clip:g}" if spec.clip is not None else ""
        lines.append(f"reward model {key}: {spec.model}, the {spec.label or 'only'} logit ({spec.transform}{clip}) "
                     f"of prompt + completion (template {spec.template}), {spec.batch_size} samples a pass; {held}")
    return lines

def teacher_line(cfg: TrainConfig, world_size: int) -> str:
    """distill.teacher: the objective, and where the teacher is: its memory on each trainer rank (on a GPU, inside the
    trainer's estimate above: gpu_lines), or the server that grades."""
    d, gib = cfg.distill, 2**30
    what = (f"distill: {d.objective}, coef {d.coef:g}: each sampled token's advantage "
            + ("is" if d.objective == "distill" else "adds") + " -coef x (student - teacher logprob)")
    if d.server:
        where = "a vLLM server grpo starts for the run" if d.server == "start" else f"the vLLM server at {d.server}"
        return (f"{what}; teacher {d.teacher} served by {where} (no memory on the trainer; "
                f"{d.requests_in_flight} samples graded at once, {d.request_timeout_s:g} s each)")
    held = teacher_bytes(cfg, world_size)
    if held is None:
        return f"{what}; teacher {d.teacher} is not a local model directory: no memory estimate"
    params = parameter_count(model_shape(d.teacher))
    return (f"{what}; teacher {d.teacher}: {params / 1e6:.1f}M parameters, {held / gib:.3f} GiB per rank in "
            f"{cfg.model.dtype} (frozen, on the trainer's device through the run)")
