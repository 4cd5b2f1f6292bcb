"""rollout.*: sampling the groups, and the tools and environment a rollout calls."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from omegaconf import MISSING

from grpo_cli.config.errors import require


@dataclass
class ToolSpec:
    function: str = MISSING  # a built-in tool ("calculator") or "package.module:function": (text between the tags) -> result text
    open: str | None = None  # what the model writes before the call's argument; None = "<NAME>" (NAME: the function's name)
    close: str | None = None  # what ends the call (and the model's turn); None = "</NAME>"
    timeout_s: float | None = 10.0  # time limit per call, in a worker process killed on overrun; None = in-process, no limit
    sandbox: str = "auto"  # "auto": a tool that runs model-written code (the built-in python) runs it in the sandbox, others as the trainer's user | "bwrap": every tool in it (another tool's worker lives in one; docs/sandbox.md) | "none": model-written code as the trainer's user (warned)


@dataclass
class EnvironmentSpec:
    cls: str | None = None  # "package.module:Class": one instance per sample, built from its row; its public methods are tools (docs/tools.md); None = none
    tags: dict[str, list[str]] = field(default_factory=dict)  # tags format: METHOD -> [open, close]; default "<METHOD>", "</METHOD>"
    timeout_s: float | None = 10.0  # time limit per method call, in the environment's worker process (killed on overrun); None = in-process


TOOL_REJOIN = ("wave", "asap")  # the rejoin rules of tools.pool.REJOIN_RULES


@dataclass
class RolloutConfig:
    engine: str = "vllm"  # generation backend: "vllm" (default) | "hf" (transformers generate, for machines without vLLM)
    prompts_per_step: int = 8  # P: distinct prompts sampled per optimizer step
    group_size: int = 8  # G: completions sampled per prompt; advantages are relative within a group
    temperature: float = 1.0  # sampling temperature; > 0 so a group has diversity
    top_p: float = 1.0  # nucleus sampling mass
    max_new_tokens: int = 64  # completion length cap, in tokens; longer answers are truncated and counted
    kv_cache_gib: float = 1.0  # vLLM KV-cache size in GiB of host RAM (CPU) or device memory (GPU, unless gpu_memory_utilization is set)
    enforce_eager: bool = False  # vLLM without torch.compile or graph capture: starts in seconds, generates slower (docs/design.md)
    gpu_memory_utilization: float | None = None  # GPU: None = vLLM reserves its weights + kv_cache_gib + a workspace, checked against free memory at its start; a fraction = vLLM's share of the whole device, from which it sizes the KV cache itself
    push_check_every: int = 10  # every N steps compare vLLM logprobs (and, at the first step too, a few tensors exactly) with the trainer's after a push; 0 = never
    mismatch_groups: int = 1  # groups a step (the first prompts' of each sampling round) whose samples bring the engine's sampling logprobs back for the train/inference mismatch metric, when no trainer.mismatch_correction reads them (then every group's do); -1 = every group, 0 = none (no metric). vLLM's logprobs cost ~9% of its throughput here (docs/benchmarks.md)
    push_check_tol: float = 1e-3  # max mean |logprob difference| before the run stops with a stale-weights error (>= 0.02 in bf16/fp16)
    sleep_mode: str = "auto"  # vLLM sleep mode: "auto" (on when vLLM shares a CUDA device with the trainer) | "on" | "off"
    sleep_level: int = 1  # 1: vLLM's weights go to host memory and its KV cache is dropped while the trainer steps; 2: both dropped
    lora_push: str = "auto"  # model.lora: "adapter" (vLLM serves the base and takes the adapters as a LoRA request) | "merged" (the base with the adapters merged in, pushed whole) | "auto": adapter on CUDA, merged on the CPU (docs/lora.md)
    dynamic_sampling: bool = False  # DAPO: sample more prompts until prompts_per_step groups have reward variance
    max_sampling_rounds: int = 4  # dynamic sampling: at most this many rounds of prompts_per_step prompts a step
    tensor_parallel_size: int = 1  # consecutive ranks that share one vLLM engine (tensor parallel); 1 = an engine per rank
    max_staleness: int = 0  # K: the batch of step t is sampled from the weights after step t-1-K, while step t-1 trains (docs/async.md); 0 = on-policy, no overlap
    placement: str = "colocated"  # "colocated": an engine in every rank, every rank trains | "split": the first ranks train, the last rollout.generator_ranks only generate (docs/async.md)
    generator_ranks: int = 1  # split: the job's last N ranks, each a vLLM engine sampling its share of every step's prompts; the others train (FSDP2 among themselves)
    overlap: str = "auto"  # max_staleness > 0: "thread" samples beside the update, "off" after it (the same batches); "auto": thread on CUDA, off on the CPU (slower there)
    # Tools (docs/tools.md): with any listed, a rollout is a conversation: the model's turns, each tool's reply.
    tools: list[ToolSpec] = field(default_factory=list)  # tools the model may call mid-rollout; [] = one completion per sample
    environment: EnvironmentSpec = field(default_factory=EnvironmentSpec)  # a class whose methods are tools, with state per sample
    tool_format: str = "tags"  # tools: "tags" (open/close strings, plain-text models) | "chat" (the chat template's tools= and tool role)
    tool_call_syntax: str = "auto"  # chat: how the model writes its calls: "auto" (the syntax its chat template shows) | "hermes" | "llama3_json" | "mistral" (docs/tools.md)
    tool_result_tags: list[str] = field(default_factory=lambda: ["<result>", "</result>"])  # tags format: written around a tool's result
    max_turns: int = 4  # tools: model turns per trajectory (each call's reply starts a new one)
    max_tool_calls: int = 3  # tools: tool calls per trajectory
    max_tool_result_tokens: int = 32  # tools: tokens of one tool result; a longer one is cut
    max_trajectory_tokens: int | None = None  # tools: tokens after the prompt, model's and tools' together; None = max_new_tokens x max_turns
    tool_workers: int = 16  # tools: calls run at once, off the decoding loop (a tool with timeout_s: a worker process per slot; docs/tools.md)
    tool_budget_s: float | None = 120.0  # tools: wall seconds with a call running, per generate call (a step's sampling, an evaluation); then calls fail at once; None = no budget
    max_tool_timeouts: int = 2  # tools: a trajectory whose calls time out (or meet the spent budget) this many times is cut
    tool_rejoin: str = "wave"  # tools: when a reply rejoins decoding: "wave" (at an engine step the run fixes: it replays bit for bit) | "asap" (as it returns: faster with slow tools; the run follows the clock and does not replay; docs/tools.md)

    @property
    def multi_turn(self) -> bool:
        """A tool run: the model has tools (rollout.tools, or an environment's methods)."""
        return bool(self.tools or self.environment.cls)

    @property
    def trajectory_tokens(self) -> int:
        """The most tokens a completion can hold after its prompt: max_new_tokens, or a tool run's cap."""
        if not self.multi_turn:
            return self.max_new_tokens
        return self.max_trajectory_tokens or self.max_new_tokens * self.max_turns

    def __post_init__(self) -> None:
        require(self.engine in ("vllm", "hf"), "rollout.engine", f"'{self.engine}' is not one of vllm, hf")
        require(self.tensor_parallel_size >= 1, "rollout.tensor_parallel_size", "must be >= 1")
        require(self.tensor_parallel_size == 1 or self.engine == "vllm", "rollout.tensor_parallel_size",
                "splits a vLLM engine; rollout.engine=hf runs one per rank (set it to 1)")
        require(1 <= self.max_sampling_rounds <= 63, "rollout.max_sampling_rounds",
                "must be in 1..63 (each round samples from seeds of its own)")
        require(self.max_staleness >= 0, "rollout.max_staleness", "must be >= 0 (0 = on-policy)")
        require(self.mismatch_groups >= -1, "rollout.mismatch_groups", "must be >= -1 (-1 = every group, 0 = none)")
        require(self.placement in ("colocated", "split"), "rollout.placement",
                f"'{self.placement}' is not one of colocated, split")
        require(self.placement == "colocated" or (self.engine == "vllm" and self.tensor_parallel_size == 1),
                "rollout.placement", "split gives the generator rank a vLLM engine of its own: needs "
                "rollout.engine=vllm and rollout.tensor_parallel_size=1")
        require(self.generator_ranks >= 1, "rollout.generator_ranks", "must be >= 1")
        require(self.generator_ranks == 1 or self.placement == "split", "rollout.generator_ranks",
                f"{self.generator_ranks}: only a split job has generator ranks; set rollout.placement=split")
        require(self.placement == "colocated" or self.sleep_mode != "on", "rollout.sleep_mode",
                "on: a split job's engine has the generator rank's GPU to itself and never sleeps; set auto or off")
        require(self.overlap in ("auto", "thread", "off"), "rollout.overlap",
                f"'{self.overlap}' is not one of auto, thread, off")
        if self.max_staleness:  # the engine samples while the trainer steps (docs/async.md)
            require(self.engine == "vllm", "rollout.max_staleness",
                    "needs rollout.engine=vllm: the hf engine samples from the very module the trainer updates")
            require(self.tensor_parallel_size == 1, "rollout.max_staleness",
                    "needs rollout.tensor_parallel_size=1: a tensor-parallel engine's collectives would run beside "
                    "the trainer's")
            require(self.sleep_mode != "on", "rollout.max_staleness",
                    "samples while the trainer steps, so the engine cannot sleep then; set rollout.sleep_mode=auto or off")
            require(not self.dynamic_sampling, "rollout.max_staleness",
                    "does not combine with rollout.dynamic_sampling yet (its rounds wait on the rewards)")
        require(self.lora_push in ("auto", "adapter", "merged"), "rollout.lora_push",
                f"'{self.lora_push}' is not one of auto, adapter, merged")
        require(self.sleep_mode in ("auto", "on", "off"), "rollout.sleep_mode",
                f"'{self.sleep_mode}' is not one of auto, on, off")
        require(self.sleep_level in (1, 2), "rollout.sleep_level", f"is {self.sleep_level}; vLLM has levels 1 and 2")
        require(self.group_size >= 2, "rollout.group_size",
                f"is {self.group_size}; a group needs >= 2 completions for a relative advantage")
        require(self.prompts_per_step >= 1, "rollout.prompts_per_step", "must be >= 1")
        require(self.temperature > 0, "rollout.temperature", "must be > 0 (groups need diverse samples)")
        require(0 < self.top_p <= 1, "rollout.top_p", "must be in (0, 1]")
        require(self.max_new_tokens >= 1, "rollout.max_new_tokens", "must be >= 1")
        require(self.kv_cache_gib > 0, "rollout.kv_cache_gib", "must be > 0")
        require(self.gpu_memory_utilization is None or 0 < self.gpu_memory_utilization <= 1,
                "rollout.gpu_memory_utilization", "must be in (0, 1], or null (size the KV cache by kv_cache_gib)")
        require(self.push_check_every >= 0, "rollout.push_check_every", "must be >= 0 (0 = never)")
        if self.multi_turn:
            require(self.max_turns >= 2, "rollout.max_turns", f"is {self.max_turns}; with tools a trajectory needs >= 2 "
                    "turns (the call, then the model reading its result)")
            require(self.max_tool_calls >= 1, "rollout.max_tool_calls", "must be >= 1 with tools")
            require(self.max_tool_result_tokens >= 1, "rollout.max_tool_result_tokens", "must be >= 1")
            require(self.tool_workers >= 1, "rollout.tool_workers", "must be >= 1")
            require(self.tool_budget_s is None or (math.isfinite(self.tool_budget_s) and self.tool_budget_s > 0),
                    "rollout.tool_budget_s", f"{self.tool_budget_s} must be > 0 seconds, or null for no budget")
            require(self.max_tool_timeouts >= 1, "rollout.max_tool_timeouts", "must be >= 1")
            require(self.tool_rejoin in TOOL_REJOIN, "rollout.tool_rejoin",
                    f"'{self.tool_rejoin}' is not one of {', '.join(TOOL_REJOIN)}")
            require(self.max_trajectory_tokens is None or self.max_trajectory_tokens >= self.max_new_tokens,
                    "rollout.max_trajectory_tokens", f"{self.max_trajectory_tokens} is below rollout.max_new_tokens="
                    f"{self.max_new_tokens}, the first turn's cap")
            require(self.tool_format in ("tags", "chat"), "rollout.tool_format",
                    f"'{self.tool_format}' is not one of tags, chat")
            require(self.tool_call_syntax in ("auto", "hermes", "llama3_json", "mistral"), "rollout.tool_call_syntax",
                    f"'{self.tool_call_syntax}' is not one of auto, hermes, llama3_json, mistral")
            require(len(self.tool_result_tags) == 2, "rollout.tool_result_tags",
                    f"has {len(self.tool_result_tags)} strings; give two, e.g. ['<result>', '</result>']")
            for i, spec in enumerate(self.tools):
                require(spec.sandbox in ("auto", "bwrap", "none"), f"rollout.tools[{i}].sandbox",
                        f"'{spec.sandbox}' is not one of auto, bwrap, none")
            require(self.tensor_parallel_size == 1, "rollout.tensor_parallel_size",
                    "tools run on each rank, and ranks sharing a tensor-parallel engine must submit the same "
                    "requests; set it to 1 with tools")
