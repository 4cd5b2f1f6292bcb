"""`grpo check recipe=X [overrides]`: the run's own pre-run check, then the batch arithmetic of a config and the
settings that do nothing.

It runs `grpo train`'s pre-run check (preflight.py: data, rewards, tools, model files, templates, prompt
lengths), which reads tokenizers and model configs but never weights; the numbers come from the config and the
model's config.json. What needs the hub (a hub model or dataset) is reported as not checked.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from grpo_cli.checkpoint import resolve_model_path
from grpo_cli.config import SamplerConfig, TrainConfig
from grpo_cli.data import hub_sources
from grpo_cli.dist.ranks import gpu_roles, split_roles
from grpo_cli.engines.options import (
    ENGINE_WORKSPACE_GIB,
    adapter_sleep_level,
    engine_on_trainer_rank,
    logprob_groups,
    lora_requests_wanted,
    sleep_wanted,
)
from grpo_cli.tools.builtin import BUILTIN_TOOLS, PYTHON_MEMORY_BYTES, PYTHON_PROCESSES, runs_untrusted_code
from grpo_cli.tools.chat import CALL_FORMS, call_syntax, template_source
from grpo_cli.tools.load import call_strings, require_sandbox

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
    return json.loads(path.read_text()) if path.is_file() else HUB_SHAPES.get(name_or_path)


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
        logprob_line(cfg),
        *tool_lines(cfg),
        *sandbox_lines(cfg),
        *staleness_lines(cfg),
    ]


def logprob_line(cfg: TrainConfig) -> str:
    """Which groups bring the engine's sampling logprobs back (the run's own rule, engines.options.logprob_groups)."""
    groups, correction = logprob_groups(cfg), cfg.trainer.mismatch_correction
    if groups is None:
        why = f"trainer.mismatch_correction={correction} reads them" if correction != "none" else "rollout.mismatch_groups=-1"
        return f"sampling logprobs: every group's ({why})"
    if groups == 0:
        return "sampling logprobs: none (rollout.mismatch_groups=0: no train/inference mismatch metric)"
    return (f"sampling logprobs: the first {groups} group(s) of each sampling round, for the train/inference mismatch "
            f"metric (rollout.mismatch_groups; vLLM's logprobs cost ~9% of its throughput)")


def staleness_lines(cfg: TrainConfig) -> list[str]:
    """rollout.max_staleness: which weights sample each batch, and where the sampling runs."""
    r = cfg.rollout
    if not r.max_staleness:
        return []
    where = {"thread": "in a thread beside the update", "off": "after the update, in the loop's thread",
             "auto": "in a thread beside the update on CUDA, after it on the CPU"}[r.overlap]
    if r.placement == "split":
        where = "on the generator ranks while the trainers step"
    overlap = f" (rollout.overlap={r.overlap})" if r.placement != "split" else ""
    return [f"off-policy: the batch of step t is sampled from the weights after step t-1-{r.max_staleness} (the "
            f"start's for steps 1-{r.max_staleness + 1}), {where}{overlap}; the engine does not sleep; "
            f"trainer.mismatch_correction={cfg.trainer.mismatch_correction}"]


def tool_lines(cfg: TrainConfig) -> list[str]:
    """A tool run's budgets: the tools and their call strings, the turn, call and token caps; with the chat
    format, the call syntax parsed (read off the model's chat template with rollout.tool_call_syntax=auto: a
    template that shows none is refused here, as the run refuses it, rather than trained with zero calls)."""
    r = cfg.rollout
    if not r.multi_turn:
        return []
    syntax = []
    if r.tool_format == "chat":
        try:
            where = resolve_model_path(cfg.model.name_or_path)
        except FileNotFoundError:  # the pre-run check names the missing model
            where = None
        if where is None or not Path(where).is_dir():  # a hub id: its files are fetched when the run starts
            syntax = [f"tool calls: not checked: hub id {cfg.model.name_or_path} (the chat template is read when the "
                      "run loads the tokenizer)"]
        else:
            template = template_source(where)
            chosen = call_syntax(template, r.tool_call_syntax)
            how = "read off the chat template" if r.tool_call_syntax == "auto" else "rollout.tool_call_syntax"
            syntax = [f"tool calls: {chosen} syntax ({how}), {CALL_FORMS[chosen]}; every call of a turn, run in order"]

    if r.tool_format == "chat":  # schemas shown and calls parsed by the chat template: no tags are written
        tools = ", ".join(spec.function for spec in r.tools) or "none"
        shown = (f"tools: {tools}, each shown to the model as a JSON schema through the chat template; results go "
                 "back as the template's tool messages")
    else:
        tools = ", ".join(f"{spec.function} ({call_strings(spec)[0]}...)" for spec in r.tools) or "none"
        shown = f"tools: {tools}; results between {r.tool_result_tags[0]!r} and {r.tool_result_tags[1]!r}"
    env = r.environment
    env_line = [f"environment: {env.cls}, one instance per sample built from its row; its public methods are "
                "tools" + (f" (tags: {', '.join(f'{m} {t[0]}...' for m, t in env.tags.items())})" if env.tags else "")
                + (f"; {env.timeout_s:g} s per call" if env.timeout_s else "")] if env.cls else []
    return [shown, *env_line,
            f"tool budgets per trajectory: <= {r.max_turns} model turns of <= {r.max_new_tokens} tokens, "
            f"<= {r.max_tool_calls} calls, <= {r.max_tool_result_tokens} tokens per result, <= {r.trajectory_tokens} "
            "tokens after the prompt (rollout.max_trajectory_tokens); tool replies are attended but leave the loss",
            f"tool calls: up to {r.tool_workers} at once beside decoding (rollout.tool_workers); "
            + (f"{r.tool_budget_s:g} s of tool time per step (rollout.tool_budget_s)" if r.tool_budget_s else
               "no tool time budget per step")
            + f"; a trajectory is cut at {r.max_tool_timeouts} calls out of time (rollout.max_tool_timeouts)",
            "replies rejoin decoding " + ("at engine steps the run fixes: it replays bit for bit"
                                          if r.tool_rejoin == "wave" else "as they return: the run follows the "
                                          "clock and does not replay") + f" (rollout.tool_rejoin={r.tool_rejoin})",
            *syntax]


def sandbox_lines(cfg: TrainConfig) -> list[str]:
    """The sandbox of each built-in tool that runs model-written code; one that cannot be made here fails the
    check, as it would fail the run (docs/sandbox.md). A custom tool's module is imported by the run, not here."""
    out = []
    for i, spec in enumerate(cfg.rollout.tools):
        if runs_untrusted_code(BUILTIN_TOOLS.get(spec.function)) and spec.sandbox != "none":
            require_sandbox(f"rollout.tools[{i}]")
            out.append(f"rollout.tools[{i}] ({spec.function}): model-written code runs in the sandbox (bwrap: no "
                       f"network, no host files or processes; {PYTHON_MEMORY_BYTES // 2**20} MiB and "
                       f"{PYTHON_PROCESSES} processes a call, all together)")
        elif spec.sandbox == "bwrap":
            require_sandbox(f"rollout.tools[{i}]", opt_out="auto")
            out.append(f"rollout.tools[{i}] ({spec.function}): its worker lives in a sandbox (bwrap: no network, no "
                       "host files but its code's, no host processes; 512 MiB and 32 processes)")
    return out


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


def sampler_line(cfg: TrainConfig) -> str:
    """data.sampler: which training prompts a step draws, with the settings the named sampler reads."""
    s = cfg.data.sampler
    band = f"a group is settled at pass rate <= {s.band[0]:g} or >= {s.band[1]:g}"
    kept = f"taken anyway with probability {s.floor:g}, and always after {s.max_skips} passes in a row"
    return {"uniform": "prompts: data.sampler.name=uniform, every train row at its turn in a seeded order, reshuffled "
                       "each epoch",
            "skip_settled": f"prompts: data.sampler.name=skip_settled, a row whose last {s.visits} group(s) were settled "
                            f"is passed over ({band}); {kept}",
            "signal_by_column": f"prompts: data.sampler.name=signal_by_column on column '{s.column}', each value taken "
                                f"in proportion to its recent share of unsettled groups (EMA decay {s.decay:g}; "
                                f"{band}); {kept}"}[s.name]


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
    for i, spec in enumerate(r.tools):
        if runs_untrusted_code(BUILTIN_TOOLS.get(spec.function)) and spec.sandbox == "none":
            out.append(f"rollout.tools[{i}].sandbox=none: {spec.function} runs model-written code as your user, "
                       "with your files, processes and network")
    s, default_sampler = cfg.data.sampler, SamplerConfig()
    unused = {"uniform": ("visits", "band", "floor", "max_skips", "column", "decay"),
              "skip_settled": ("column", "decay"), "signal_by_column": ("visits",)}[s.name]
    changed = [f"data.sampler.{k}" for k in unused if getattr(s, k) != getattr(default_sampler, k)]
    if changed:
        out.append(f"{', '.join(changed)}: unused with data.sampler.name={s.name}")
    draws = t.steps * r.prompts_per_step * (r.max_sampling_rounds if r.dynamic_sampling else 1)  # at most
    builtin_rows = cfg.data.num_train if cfg.data.source.startswith("builtin:") else None  # a file's count is unread here
    if s.name == "skip_settled" and builtin_rows is not None and draws <= builtin_rows:
        out.append(f"data.sampler.name=skip_settled: the run draws at most {draws} of "
                   f"{builtin_rows} train rows, so no prompt comes back and it never acts; use signal_by_column, "
                   "or a smaller data.num_train (docs/sampling.md)")
    if r.dynamic_sampling and r.max_sampling_rounds == 1:
        out.append("rollout.dynamic_sampling with max_sampling_rounds=1: no further round is ever sampled")
    return out + unused_settings(cfg)


def _changed(section: Any, name: str) -> bool:
    """Whether a config section's field differs from the schema's default."""
    field = next(f for f in dataclasses.fields(section) if f.name == name)
    default = field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default
    return getattr(section, name) != default


def unused_settings(cfg: TrainConfig) -> list[str]:
    """Keys set away from their default that this config never reads, and what they wait for (issue 65)."""
    r, lora, distill = cfg.rollout, cfg.model.lora, cfg.distill
    table = [  # (section, field, the key's name, read only when, what would make it act)
        (r, "max_sampling_rounds", "rollout.max_sampling_rounds", r.dynamic_sampling, "rollout.dynamic_sampling=true"),
        (lora, "alpha", "model.lora.alpha", lora.enabled, "model.lora.rank"),
        (r, "lora_push", "rollout.lora_push", lora.enabled, "model.lora.rank"),
        (distill, "objective", "distill.objective", bool(distill.teacher), "distill.teacher"),
        (cfg.data, "instruction", "data.instruction", cfg.data.template == "chat", "data.template=chat"),
        (r, "max_turns", "rollout.max_turns", r.multi_turn, "rollout.tools or rollout.environment"),
    ]
    return [f"{key}: unused without {needs}" for section, name, key, read, needs in table
            if not read and _changed(section, name)]


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


def not_checked(cfg: TrainConfig) -> list[str]:
    """What `grpo check` leaves to the run on this machine: a hub model's files, a CUDA device."""
    lines = [f"not checked: hub dataset {source} (its rows, columns and prompt lengths are read when the run "
             "fetches it)" for source in hub_sources(cfg.data)]
    if not Path(resolve_model_path(cfg.model.name_or_path)).is_dir():
        lines.append(f"not checked: hub id {cfg.model.name_or_path} (its config, tokenizer, prompt lengths and chat "
                     "template are read when the run fetches it)")
    if cfg.trainer.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            lines.append(f"not checked: trainer.device={cfg.trainer.device} (no CUDA device here)")
    return lines


def run_check(cfg: TrainConfig, run_dir: Any) -> int:
    """`grpo check`: the run's own pre-run check (preflight.preflight: data, rewards, tools, model files, templates,
    prompt lengths; no weights loaded), then the batch, memory and settings it would run with."""
    import time

    from grpo_cli.preflight import preflight  # not at the top: `grpo check` imports torch only when it runs

    started = time.perf_counter()
    preflight(cfg, checking=True)  # a mistake: UsageError, one line and exit 2, as `grpo train` says it
    checked_s = time.perf_counter() - started
    world_size = max(cfg.dist.world_size, int(os.environ.get("WORLD_SIZE", "1")))  # dist.* or plain torchrun
    print(f"grpo check: {cfg.task} | model {cfg.model.name_or_path} | {cfg.trainer.steps} steps")
    print(f"  the run's pre-run check passed in {checked_s:.1f} s (data, rewards, tools, model files, prompt lengths)")
    for line in not_checked(cfg):
        print(f"  warning: {line}")
    shape = model_shape(cfg.model.name_or_path)
    split = cfg.rollout.placement == "split"
    trainers = cfg.trainer_ranks if split else world_size
    lines = batch_lines(cfg, trainers) + memory_lines(cfg, shape, trainers) + gpu_lines(cfg, shape, trainers)
    if split:
        lines.append(placement_line(cfg, shape))
    if cfg.distill.teacher:
        lines.append(teacher_line(cfg, trainers))
    lines += reward_model_lines(cfg)
    lines.append(sampler_line(cfg))
    lines.append(correctness_line(cfg))
    for line in lines:
        print(f"  {line}")
    found = warnings(cfg)
    for line in found:
        print(f"  warning: {line}")
    if not found:
        print("  no setting without effect found")
    return 0
