"""The typed configuration schema: one dataclass per section, a comment per field.

Every recipe and every command-line override is validated against these
dataclasses before any model, torch or vLLM import. Only this module and
`cli.py` touch OmegaConf/Hydra; everything below receives plain dataclasses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from grpo_cli.prompts import CHAT_INSTRUCTION  # pure
from grpo_cli.rewards.answers import ANSWER_FORMATS  # pure: re and decimal only
from grpo_cli.schedules import LR_SCHEDULES  # pure: math only

BUILTIN_MODEL = "builtin:bike_base"  # the small model shipped inside the package


# Names of the loss axes' tables in grpo_cli/grpo.py (LOSSES, POLICY_TERMS, KL_ESTIMATORS, ADVANTAGES,
# CORRECTIONS, OBJECTIVES), spelled out so validation imports no torch; tests/test_loss_variants.py ties each to
# its table.
LOSS_NAMES = ("grpo", "token_mean", "dr_grpo")
POLICY_LOSS_NAMES = ("ppo_clip", "gspo")
KL_ESTIMATOR_NAMES = ("k1", "k2", "k3")
ADVANTAGE_NAMES = ("group_std", "group_mean", "batch_std", "reinforce_pp_baseline", "rloo")
CORRECTION_NAMES = ("none", "tis", "seq_mask")
OBJECTIVE_NAMES = ("grpo", "distill", "grpo+distill")


class ConfigError(ValueError):
    """A config value is wrong; the message names the full key and the fix."""


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {message}")


# The linear layers of a Llama/Qwen2-style decoder layer: attention and MLP (docs/lora.md).
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class LoraConfig:
    """LoRA adapters (docs/lora.md): the base weights stay frozen, low-rank updates on `target_modules` train."""

    rank: int | None = None  # the adapters' rank r; None = no LoRA (every weight trains), e.g. 16
    alpha: float = 32.0  # the adapters' output is scaled by alpha / rank (peft's lora_alpha)
    dropout: float = 0.0  # dropout on each adapter's input while training; > 0 makes the trainer's logprobs noisier than the engine's
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))  # module names (last part) that get an adapter
    lr: float | None = None  # the adapters' AdamW learning rate (LoRA wants ~10x full fine-tuning's); None = trainer.lr

    def __post_init__(self) -> None:
        _require(self.rank is None or self.rank >= 1, "model.lora.rank",
                 f"is {self.rank}; it must be >= 1 (or null, the default, to train every weight)")
        _require(self.alpha > 0, "model.lora.alpha", "must be > 0")
        _require(0 <= self.dropout < 1, "model.lora.dropout", "must be in [0, 1)")
        _require(bool(self.target_modules), "model.lora.target_modules", "is empty; name at least one module")
        _require(self.lr is None or self.lr > 0, "model.lora.lr", "must be > 0 (or null: trainer.lr)")

    @property
    def enabled(self) -> bool:
        return self.rank is not None


@dataclass
class ModelConfig:
    name_or_path: str = BUILTIN_MODEL  # local HF directory, hub id, or "builtin:NAME" for a model shipped in grpo_cli/models
    dtype: str = "float32"  # compute dtype: float32 | bfloat16 | float16; on CUDA the trainer keeps fp32 master weights and autocasts
    max_context_tokens: int | None = None  # cap on prompt+completion tokens; None = the model's max_position_embeddings
    lora: LoraConfig = field(default_factory=LoraConfig)  # train LoRA adapters instead of every weight (model.lora.rank=16)

    def __post_init__(self) -> None:
        _require(self.dtype in ("float32", "bfloat16", "float16"), "model.dtype",
                 f"'{self.dtype}' is not one of float32, bfloat16, float16")


# Names of the prompt samplers' table in grpo_cli/pool.py (KEEP), spelled out so validation imports no pool code.
SAMPLER_NAMES = ("uniform", "skip_settled", "signal_by_column")


@dataclass
class SamplerConfig:
    """Which training prompts a step draws (docs/sampling.md). Every sampler walks the same seeded order; one that
    is not uniform passes over some prompts at their turn, judged on their groups already scored."""

    name: str = "uniform"  # "uniform" (every prompt at its turn) | "skip_settled" (GRESO: pass over a prompt whose last `visits` groups were settled) | "signal_by_column" (SEC: favour the values of `column` whose recent groups carried signal)
    visits: int = 1  # skip_settled: the prompt's last visits that must all be settled before it is passed over
    band: list[float] = field(default_factory=lambda: [0.0, 1.0])  # [low, high]: a group whose pass rate is <= low or >= high is settled (no signal); the default is all wrong or all right
    floor: float = 0.1  # the probability that a prompt the sampler would pass over is taken anyway (a settled prompt comes back)
    max_skips: int = 4  # a prompt passed over this many times in a row is taken at its next turn (none starves)
    column: str = "tier"  # signal_by_column: the dataset column whose values are tracked (bike pricing and Countdown: tier)
    decay: float = 0.95  # signal_by_column: per recorded group, the weight of a value's old signal share (EMA)

    def __post_init__(self) -> None:
        _require(self.name in SAMPLER_NAMES, "data.sampler.name",
                 f"'{self.name}' is not one of {', '.join(SAMPLER_NAMES)}")
        _require(self.visits >= 1, "data.sampler.visits", "must be >= 1")
        _require(len(self.band) == 2 and 0.0 <= self.band[0] < self.band[1] <= 1.0, "data.sampler.band",
                 f"{list(self.band)} must be [low, high] with 0 <= low < high <= 1")
        _require(0.0 < self.floor <= 1.0, "data.sampler.floor", "must be in (0, 1]: 0 would let a prompt starve")
        _require(self.max_skips >= 0, "data.sampler.max_skips", "must be >= 0")
        _require(0.0 <= self.decay < 1.0, "data.sampler.decay", "must be in [0, 1)")


@dataclass
class DataConfig:
    source: str = "builtin:bike_pricing"  # builtin:NAME (generator) | path/to/file.jsonl | path/to/file.parquet | hub:owner/dataset
    split: str = "train"  # split name when source is a hub dataset
    hub_config: str | None = None  # the hub dataset's configuration (subset), e.g. "main" for openai/gsm8k; None = its default
    prompt_column: str = "question"  # column holding the question: text given to the template, or chat messages (data.template=chat only)
    rename_columns: dict[str, str] = field(default_factory=dict)  # file/hub rows: {old: new} column names, e.g. {solution: answer}, applied first
    num_train: int = 20000  # problems generated for training (builtin sources only)
    num_heldout: int = 200  # fixed-size held-out set used for evaluation (never shares a question with train)
    heldout_source: str | None = None  # file or hub:owner/name[@split] with the held-out rows (e.g. an exported heldout.jsonl); None = carve them out of source
    template: str = "plain"  # prompt rendering: "plain" (shipped model) | "chat" (tokenizer chat template + <answer> instruction)
    system_prompt: str | None = None  # chat template only: the system message; None = none
    instruction: str | None = CHAT_INSTRUCTION  # chat template only: appended to the question in the user message; None = none
    answer_format: str = "answer_line"  # how the final answer is marked: "answer_line" (Answer: X) | "answer_tag" (<answer>X</answer>) | "boxed" (\\boxed{X}) | "hash" (#### X)
    tiers: list[int] = field(default_factory=lambda: [1, 2, 3])  # difficulty tiers to draw (builtin bike_pricing)
    seed: int = 1234  # generator seed; fixes the problems and the train/held-out split
    sampler: SamplerConfig = field(default_factory=SamplerConfig)  # which training prompts a step draws (held-out evaluation always uses all)

    def __post_init__(self) -> None:
        _require(self.template in ("plain", "chat"), "data.template",
                 f"'{self.template}' is not one of plain, chat")
        _require(self.answer_format in ANSWER_FORMATS, "data.answer_format",
                 f"'{self.answer_format}' is not one of {', '.join(ANSWER_FORMATS)}")
        _require(self.num_train > 0, "data.num_train", "must be > 0")
        _require(self.num_heldout > 0, "data.num_heldout", "must be > 0")


@dataclass
class RewardSpec:
    name: str | None = None  # a built-in reward ("correct", "format") or "package.module:function"; with `model`, the learned reward's name in the metrics (default reward_model)
    weight: float = 1.0  # weight of this function in the summed reward
    args: dict[str, Any] = field(default_factory=dict)  # keyword arguments the function is called with, e.g. {buffer: 32}
    timeout_s: float | None = 10.0  # time limit per call (one prompt's group), in a worker process killed on overrun; None = in-process, no limit. A reward model in process has none (a forward pass over bounded text)
    on_failure: str = "zero"  # a sample it raised, timed out or returned junk on: "zero" (scores 0) | "drop" (leaves the loss)
    correctness: bool = False  # this reward is the task's correctness check (pass@1, zero-variance groups, best checkpoint); exactly one, or the only reward
    # A learned reward (docs/rewards.md): a sequence classifier that scores the prompt and the completion.
    model: str | None = None  # a reward model: a Hugging Face sequence classifier (directory, hub id or builtin:NAME); None = `name` is a function
    label: str | None = None  # model: the label whose logit is the score (a classifier of several labels needs one); None = its only logit
    transform: str = "raw"  # model: "raw" (the logit) | "sigmoid" (a probability in 0..1)
    clip: float | None = None  # model: the transformed score clipped to [-clip, clip]; None = no clip
    template: str = "auto"  # model: its input, "chat" (the reward model's chat template: the prompt as the user's turn, the completion as the assistant's) | "plain" (prompt, a newline, completion) | "auto" (chat when its tokenizer has a template)
    batch_size: int = 32  # model: samples per forward pass (served: per request)
    server: str | None = None  # model: None = in the trainer's process | "start" = a vLLM pooling server grpo starts on `model` for the run (stopped with it) | a URL of one you run (`vllm serve MODEL --runner pooling`); timeout_s bounds each request there
    requests_in_flight: int = 4  # served: requests at once
    # A generative judge (docs/rewards.md): an LLM on a vLLM server reads a prompt made from each sample.
    judge: str | None = None  # the judge's prompt: a template with {prompt}, {completion} and dataset columns ({answer}); needs `server` (start: on `model`); name defaults to judge
    parser: str = "score_10"  # judge: its reply -> the score: "score_10" ("7/10", "Score: 7" -> 0.7) | "yes_no" (1 | 0) | a regex whose first group is the number; an unreadable reply fails the sample
    max_tokens: int = 32  # judge: reply tokens at most (greedy)
    server_start_timeout_s: float = 300.0  # server=start: seconds for the server to answer /health
    server_kv_cache_gib: float = 1.0  # server=start: the server's KV cache, GiB (on a GPU: the trainer's, beside its weights; grpo check counts both)


REWARD_TRANSFORMS = ("raw", "sigmoid")  # rewards[i].transform (rewards/model.py)
REWARD_TEMPLATES = ("auto", "chat", "plain")  # rewards[i].template


def check_reward_spec(spec: RewardSpec, key: str) -> None:
    """One reward's settings, before anything loads; a reward model's name defaults to reward_model."""
    if spec.name is None and (spec.model is not None or spec.judge is not None):
        spec.name = "judge" if spec.judge is not None else "reward_model"
    _require(spec.name is not None, f"{key}.name", "missing: give a reward function (a built-in name or "
             "package.module:function), a reward model as model=DIR_OR_HUB_ID, or a judge as judge=TEMPLATE")
    if spec.model is None and spec.judge is None:
        learned = [k for k in ("label", "clip", "server") if getattr(spec, k) is not None]
        learned += [k for k, default in (("transform", "raw"), ("template", "auto"), ("batch_size", 32),
                                         ("requests_in_flight", 4), ("server_start_timeout_s", 300.0),
                                         ("server_kv_cache_gib", 1.0), ("parser", "score_10"), ("max_tokens", 32))
                    if getattr(spec, k) != default]
        _require(not learned, f"{key}.{learned[0] if learned else ''}", "is a learned reward's setting; this reward "
                 f"is the function '{spec.name}' (set {key}.model for a reward model, {key}.judge for a judge)")
        return
    _require(spec.transform in REWARD_TRANSFORMS, f"{key}.transform",
             f"'{spec.transform}' is not one of {', '.join(REWARD_TRANSFORMS)}")
    _require(spec.template in REWARD_TEMPLATES, f"{key}.template",
             f"'{spec.template}' is not one of {', '.join(REWARD_TEMPLATES)}")
    _require(spec.clip is None or spec.clip > 0, f"{key}.clip", f"{spec.clip} must be > 0 (or null for none)")
    _require(spec.batch_size >= 1, f"{key}.batch_size", "must be >= 1")
    _require(spec.requests_in_flight >= 1, f"{key}.requests_in_flight", "must be >= 1")
    _require(spec.max_tokens >= 1, f"{key}.max_tokens", "must be >= 1")
    _require(spec.server_start_timeout_s > 0, f"{key}.server_start_timeout_s", "must be > 0")
    _require(spec.server_kv_cache_gib > 0, f"{key}.server_kv_cache_gib", "must be > 0 GiB")
    _require(spec.server is None or spec.server == "start" or spec.server.startswith(("http://", "https://")),
             f"{key}.server", f"'{spec.server}' is not start or an http(s):// URL")


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
        _require(self.engine in ("vllm", "hf"), "rollout.engine", f"'{self.engine}' is not one of vllm, hf")
        _require(self.tensor_parallel_size >= 1, "rollout.tensor_parallel_size", "must be >= 1")
        _require(self.tensor_parallel_size == 1 or self.engine == "vllm", "rollout.tensor_parallel_size",
                 "splits a vLLM engine; rollout.engine=hf runs one per rank (set it to 1)")
        _require(1 <= self.max_sampling_rounds <= 63, "rollout.max_sampling_rounds",
                 "must be in 1..63 (each round samples from seeds of its own)")
        _require(self.max_staleness >= 0, "rollout.max_staleness", "must be >= 0 (0 = on-policy)")
        _require(self.mismatch_groups >= -1, "rollout.mismatch_groups", "must be >= -1 (-1 = every group, 0 = none)")
        _require(self.placement in ("colocated", "split"), "rollout.placement",
                 f"'{self.placement}' is not one of colocated, split")
        _require(self.placement == "colocated" or (self.engine == "vllm" and self.tensor_parallel_size == 1),
                 "rollout.placement", "split gives the generator rank a vLLM engine of its own: needs "
                 "rollout.engine=vllm and rollout.tensor_parallel_size=1")
        _require(self.generator_ranks >= 1, "rollout.generator_ranks", "must be >= 1")
        _require(self.generator_ranks == 1 or self.placement == "split", "rollout.generator_ranks",
                 f"{self.generator_ranks}: only a split job has generator ranks; set rollout.placement=split")
        _require(self.placement == "colocated" or self.sleep_mode != "on", "rollout.sleep_mode",
                 "on: a split job's engine has the generator rank's GPU to itself and never sleeps; set auto or off")
        _require(self.overlap in ("auto", "thread", "off"), "rollout.overlap",
                 f"'{self.overlap}' is not one of auto, thread, off")
        if self.max_staleness:  # the engine samples while the trainer steps (docs/async.md)
            _require(self.engine == "vllm", "rollout.max_staleness",
                     "needs rollout.engine=vllm: the hf engine samples from the very module the trainer updates")
            _require(self.tensor_parallel_size == 1, "rollout.max_staleness",
                     "needs rollout.tensor_parallel_size=1: a tensor-parallel engine's collectives would run beside "
                     "the trainer's")
            _require(self.sleep_mode != "on", "rollout.max_staleness",
                     "samples while the trainer steps, so the engine cannot sleep then; set rollout.sleep_mode=auto or off")
            _require(not self.dynamic_sampling, "rollout.max_staleness",
                     "does not combine with rollout.dynamic_sampling yet (its rounds wait on the rewards)")
        _require(self.lora_push in ("auto", "adapter", "merged"), "rollout.lora_push",
                 f"'{self.lora_push}' is not one of auto, adapter, merged")
        _require(self.sleep_mode in ("auto", "on", "off"), "rollout.sleep_mode",
                 f"'{self.sleep_mode}' is not one of auto, on, off")
        _require(self.sleep_level in (1, 2), "rollout.sleep_level", f"is {self.sleep_level}; vLLM has levels 1 and 2")
        _require(self.group_size >= 2, "rollout.group_size",
                 f"is {self.group_size}; a group needs >= 2 completions for a relative advantage")
        _require(self.prompts_per_step >= 1, "rollout.prompts_per_step", "must be >= 1")
        _require(self.temperature > 0, "rollout.temperature", "must be > 0 (groups need diverse samples)")
        _require(0 < self.top_p <= 1, "rollout.top_p", "must be in (0, 1]")
        _require(self.max_new_tokens >= 1, "rollout.max_new_tokens", "must be >= 1")
        _require(self.kv_cache_gib > 0, "rollout.kv_cache_gib", "must be > 0")
        _require(self.gpu_memory_utilization is None or 0 < self.gpu_memory_utilization <= 1,
                 "rollout.gpu_memory_utilization", "must be in (0, 1], or null (size the KV cache by kv_cache_gib)")
        _require(self.push_check_every >= 0, "rollout.push_check_every", "must be >= 0 (0 = never)")
        if self.multi_turn:
            _require(self.max_turns >= 2, "rollout.max_turns", f"is {self.max_turns}; with tools a trajectory needs >= 2 "
                     "turns (the call, then the model reading its result)")
            _require(self.max_tool_calls >= 1, "rollout.max_tool_calls", "must be >= 1 with tools")
            _require(self.max_tool_result_tokens >= 1, "rollout.max_tool_result_tokens", "must be >= 1")
            _require(self.tool_workers >= 1, "rollout.tool_workers", "must be >= 1")
            _require(self.tool_budget_s is None or (math.isfinite(self.tool_budget_s) and self.tool_budget_s > 0),
                     "rollout.tool_budget_s", f"{self.tool_budget_s} must be > 0 seconds, or null for no budget")
            _require(self.max_tool_timeouts >= 1, "rollout.max_tool_timeouts", "must be >= 1")
            _require(self.tool_rejoin in TOOL_REJOIN, "rollout.tool_rejoin",
                     f"'{self.tool_rejoin}' is not one of {', '.join(TOOL_REJOIN)}")
            _require(self.max_trajectory_tokens is None or self.max_trajectory_tokens >= self.max_new_tokens,
                     "rollout.max_trajectory_tokens", f"{self.max_trajectory_tokens} is below rollout.max_new_tokens="
                     f"{self.max_new_tokens}, the first turn's cap")
            _require(self.tool_format in ("tags", "chat"), "rollout.tool_format",
                     f"'{self.tool_format}' is not one of tags, chat")
            _require(self.tool_call_syntax in ("auto", "hermes", "llama3_json", "mistral"), "rollout.tool_call_syntax",
                     f"'{self.tool_call_syntax}' is not one of auto, hermes, llama3_json, mistral")
            _require(len(self.tool_result_tags) == 2, "rollout.tool_result_tags",
                     f"has {len(self.tool_result_tags)} strings; give two, e.g. ['<result>', '</result>']")
            for i, spec in enumerate(self.tools):
                _require(spec.sandbox in ("auto", "bwrap", "none"), f"rollout.tools[{i}].sandbox",
                         f"'{spec.sandbox}' is not one of auto, bwrap, none")
            _require(self.tensor_parallel_size == 1, "rollout.tensor_parallel_size",
                     "tools run on each rank, and ranks sharing a tensor-parallel engine must submit the same "
                     "requests; set it to 1 with tools")


@dataclass
class TrainerConfig:
    steps: int = 60  # training steps, one rollout batch each (ppo_epochs x minibatches optimizer steps per batch)
    lr: float = 1e-4  # AdamW learning rate, after warm-up
    norm_lr_scale: float = 1.0  # lr multiplier for normalization gains (1-D *norm* weights): they set the logit scale
    warmup_steps: int = 0  # linear LR warm-up, in optimizer steps (the schedule spans steps x ppo_epochs x minibatches)
    lr_schedule: str = "constant"  # after warm-up: "constant" | "linear" (to 0 at trainer.steps) | "cosine" (to 0)
    weight_decay: float = 0.0  # AdamW weight decay
    betas: list[float] = field(default_factory=lambda: [0.9, 0.99])  # AdamW betas
    max_grad_norm: float = 1.0  # gradient clipping threshold (global L2 norm)
    clip_eps: float = 0.2  # PPO clip range below 1: ratio >= 1 - clip_eps
    clip_eps_high: float | None = None  # PPO clip range above 1 (DAPO's clip-higher); None = clip_eps
    clip_ratio_c: float | None = None  # dual clip (Ye et al. 2020): for A < 0 the objective is bounded at c*A; > 1; None = off
    policy_loss: str = "ppo_clip"  # ratio and clip: "ppo_clip" (per token) | "gspo" (per sequence, Zheng et al. 2025)
    kl_coef: float = 0.02  # weight of the KL penalty to the frozen reference; 0 loads no reference model
    kl_estimator: str = "k3"  # per-token KL estimator: "k1" (logp - ref) | "k2" ((logp - ref)^2 / 2) | "k3" (exp(d) - d - 1)
    kl_in_reward: bool = False  # subtract kl_coef * (sequence's summed KL) from the reward instead of adding it to the loss
    advantage: str = "group_std"  # "group_std" (GRPO) | "group_mean" (Dr. GRPO, no std) | "batch_std" (raw-reward batch std) | "reinforce_pp_baseline" (centred-reward batch std) | "rloo" (leave-one-out)
    reward_round_decimals: int | None = None  # round summed rewards before normalising (damps noise in graded rewards)
    filter_zero_variance: bool = False  # drop groups whose rewards are all equal from the loss
    loss: str = "grpo"  # aggregation: "grpo" (per-sequence token mean) | "token_mean" (DAPO) | "dr_grpo" (sum / max_new_tokens)
    mismatch_correction: str = "auto"  # vs the engine's sampling logprobs: "none" | "tis" (capped token weights) | "seq_mask"; "auto": tis when rollout.max_staleness > 0 (docs/async.md), else none
    tis_cap: float = 2.0  # tis: cap C on the importance weight exp(trainer logp - engine logp) of each token
    seq_mask_low: float = 0.5  # seq_mask: a sample whose geometric-mean ratio trainer/engine is below this leaves the loss...
    seq_mask_high: float = 2.0  # ...and so does one above this
    entropy_coef: float = 0.0  # weight of an entropy bonus in the loss (the entropy is logged either way)
    ppo_epochs: int = 1  # passes over each rollout batch; > 1 reuses samples (the ratio moves away from 1)
    minibatches: int = 1  # optimizer steps per pass: the batch's groups split into this many parts
    mask_truncated: bool = False  # completions cut by rollout.max_new_tokens leave the loss (DAPO's overlong filter)
    micro_batch_size: int = 16  # at most this many completions per forward/backward pass (memory knob, not a math knob)
    micro_batch_tokens: int = 0  # and at most this many padded completion tokens per pass (0 = no cap); memory knob too
    logprob_chunk_tokens: int = 1024  # tokens per logits chunk when computing logprobs; bounds the [tokens, vocab] buffer
    threads: int = 0  # torch CPU threads for the trainer; 0 = all cores
    device: str = "auto"  # the trainer's device: "auto" (cuda:LOCAL_RANK when CUDA is present, else cpu) | "cpu" | "cuda[:N]"
    offload_optimizer: bool = False  # move AdamW's state to host memory while vLLM generates (frees GPU memory for the KV cache)
    seed: int = 0  # run seed: prompt order, sampling, init of anything random
    deterministic: bool = False  # torch deterministic algorithms (for bit-exact resume on CPU)
    max_bad_steps: int = 3  # non-finite loss or gradient: the step is skipped; this many in a row stop the run

    def __post_init__(self) -> None:
        _require(self.steps >= 1, "trainer.steps", "must be >= 1")
        _require(self.lr > 0, "trainer.lr", "must be > 0")
        _require(0 < self.clip_eps < 1, "trainer.clip_eps", "must be in (0, 1)")
        _require(self.clip_eps_high is None or self.clip_eps_high > 0, "trainer.clip_eps_high", "must be > 0 or null")
        _require(self.kl_coef >= 0, "trainer.kl_coef", "must be >= 0")
        _require(self.micro_batch_size >= 1, "trainer.micro_batch_size", "must be >= 1")
        _require(self.micro_batch_tokens >= 0, "trainer.micro_batch_tokens", "must be >= 0 (0 = no token cap)")
        _require(self.logprob_chunk_tokens >= 1, "trainer.logprob_chunk_tokens", "must be >= 1")
        _require(self.lr_schedule in LR_SCHEDULES, "trainer.lr_schedule",
                 f"'{self.lr_schedule}' is not one of {', '.join(LR_SCHEDULES)}")
        _require(self.norm_lr_scale > 0, "trainer.norm_lr_scale", "must be > 0")
        # The names of grpo_cli.grpo's tables, spelled out: that module imports torch (tests/test_config.py ties them).
        for key, value, names in (("loss", self.loss, LOSS_NAMES), ("policy_loss", self.policy_loss, POLICY_LOSS_NAMES),
                                  ("kl_estimator", self.kl_estimator, KL_ESTIMATOR_NAMES),
                                  ("advantage", self.advantage, ADVANTAGE_NAMES),
                                  ("mismatch_correction", self.mismatch_correction, (*CORRECTION_NAMES, "auto"))):
            _require(value in names, f"trainer.{key}", f"'{value}' is not one of {', '.join(names)}")
        _require(self.clip_ratio_c is None or self.clip_ratio_c > 1, "trainer.clip_ratio_c", "must be > 1 or null")
        _require(self.tis_cap > 0, "trainer.tis_cap", "must be > 0")
        _require(0 <= self.seq_mask_low < 1 < self.seq_mask_high, "trainer.seq_mask_low",
                 f"the band [{self.seq_mask_low}, {self.seq_mask_high}] must hold 1 (seq_mask_low < 1 < seq_mask_high)")
        _require(self.entropy_coef >= 0, "trainer.entropy_coef", "must be >= 0")
        _require(self.ppo_epochs >= 1, "trainer.ppo_epochs", "must be >= 1")
        _require(self.minibatches >= 1, "trainer.minibatches", "must be >= 1")
        _require(not (self.kl_in_reward and self.kl_coef == 0), "trainer.kl_in_reward",
                 "needs trainer.kl_coef > 0 (the penalty's weight)")
        _require(len(self.betas) == 2, "trainer.betas", "must be two numbers, e.g. [0.9,0.99]")
        _require(self.max_grad_norm > 0, "trainer.max_grad_norm", "must be > 0")
        _require(self.threads >= 0, "trainer.threads", "must be >= 0 (0 = all cores)")
        _require(self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:"), "trainer.device",
                 f"'{self.device}' is not one of auto, cpu, cuda, cuda:N")
        _require(self.max_bad_steps >= 1, "trainer.max_bad_steps", "must be >= 1")


@dataclass
class DistillConfig:
    """On-policy distillation (docs/distillation.md): a frozen teacher scores each token the student sampled."""

    teacher: str | None = None  # the teacher: a causal LM with the student's tokenizer (local dir, hub id or builtin:NAME); None = no distillation
    objective: str = "grpo+distill"  # with a teacher: "distill" (a token's advantage is -coef x (its student - teacher logprob); rewards logged, not trained on) | "grpo+distill" (the group advantage plus that)
    coef: float = 1.0  # weight of the per-token reverse KL in the advantage
    server: str | None = None  # a served teacher: "start" (grpo starts a vLLM server on distill.teacher, stopped with the run) | the URL of a vLLM server already serving it; None = the teacher in the trainer's process
    server_start_timeout_s: float = 300.0  # distill.server=start: seconds for the server to answer /health
    server_kv_cache_gib: float = 1.0  # distill.server=start: the server's KV cache, GiB (on a GPU: the trainer's, beside its weights; grpo check counts both)
    request_timeout_s: float = 60.0  # a served teacher: seconds for one sample's grades (then retried, 3 tries in all)
    requests_in_flight: int = 8  # a served teacher: samples graded at once

    def __post_init__(self) -> None:
        _require(self.objective in OBJECTIVE_NAMES[1:], "distill.objective",
                 f"'{self.objective}' is not one of {', '.join(OBJECTIVE_NAMES[1:])}")
        _require(self.coef > 0, "distill.coef", "must be > 0")
        _require(self.server is None or bool(self.teacher), "distill.server",
                 "needs distill.teacher too: the model it serves, whose tokenizer is checked against the student's")
        _require(self.server is None or self.server == "start" or self.server.startswith(("http://", "https://")),
                 "distill.server", f"'{self.server}' is neither start nor an http(s) URL")
        _require(self.requests_in_flight >= 1, "distill.requests_in_flight", "must be >= 1")
        _require(self.request_timeout_s > 0, "distill.request_timeout_s", "must be > 0 seconds")
        _require(self.server_start_timeout_s > 0, "distill.server_start_timeout_s", "must be > 0 seconds")
        _require(self.server_kv_cache_gib > 0, "distill.server_kv_cache_gib", "must be > 0 GiB")

    @property
    def loss_objective(self) -> str:
        """The name in grpo.OBJECTIVES the loss uses: plain GRPO without a teacher."""
        return self.objective if self.teacher else "grpo"


@dataclass
class EvalConfig:
    every: int = 10  # held-out evaluation every N steps (and at the end); 0 = only at the end
    num_problems: int = 200  # held-out problems used (<= data.num_heldout)
    samples_per_problem: int = 1  # k samples per problem (pass@1 is the mean correctness)
    temperature: float | None = None  # sampling temperature for evaluation; None: rollout.temperature, the training one
    greedy: bool = False  # also measure greedy (temperature 0) accuracy: in grpo eval, and at every held-out evaluation of grpo train (eval/greedy_accuracy)

    def __post_init__(self) -> None:
        _require(self.temperature is None or self.temperature >= 0, "eval.temperature",
                 "must be >= 0, or null for rollout.temperature")
        _require(self.every >= 0, "eval.every", "must be >= 0 (0 = only at the end)")
        _require(self.num_problems >= 1, "eval.num_problems", "must be >= 1")
        _require(self.samples_per_problem >= 1, "eval.samples_per_problem", "must be >= 1")


@dataclass
class CheckpointConfig:
    every: int = 10  # save a resumable checkpoint every N steps (and at the end); 0 = only at the end
    keep_last: int = 2  # periodic checkpoints kept; older ones are deleted (best and final are kept too)

    def __post_init__(self) -> None:
        _require(self.every >= 0, "checkpoint.every", "must be >= 0")
        _require(self.keep_last >= 1, "checkpoint.keep_last", "must be >= 1")


@dataclass
class LoggingConfig:
    every: int = 1  # print a metrics line every N steps when stdout is not a terminal
    samples_every: int = 10  # show and save a few sample completions every N steps; 0 = never
    wandb: bool = False  # also log to Weights & Biases (honours WANDB_MODE; offline without a key)
    wandb_project: str = "grpo_cli"  # wandb project name
    zero_variance_threshold: float = 0.9  # warn when at least this fraction of groups is all right or all wrong (no signal)...
    zero_variance_patience: int = 10  # ...for this many consecutive steps (or every reward is 0); one warning per case
    verbose_libraries: bool = False  # show vLLM/datasets/transformers progress bars and log chatter (silenced by default)


@dataclass
class DistConfig:
    """Several processes and nodes (torchrun). With nproc_per_node = nnodes = 1 a run is one process."""

    nproc_per_node: int = 1  # processes on this node; > 1 makes `grpo train` start itself under torchrun
    nnodes: int = 1  # nodes in the job; run the same command on each with its dist.node_rank
    node_rank: int = 0  # this node's index, 0..nnodes-1 (multi-node only)
    rdzv_endpoint: str = "127.0.0.1:29500"  # host:port of node 0, where the nodes meet (multi-node only)
    timeout_s: int = 600  # a collective that waits longer than this fails the job (a rank died or hangs)
    reshard_layers: bool = True  # FSDP2 frees each layer's gathered parameters after its forward and backward (a rank holds its shard + a layer or two: a model larger than one device trains); false keeps the model gathered through each optimizer step (fewer all-gathers); the same numbers either way

    def __post_init__(self) -> None:
        _require(self.nproc_per_node >= 1, "dist.nproc_per_node", "must be >= 1")
        _require(self.nnodes >= 1, "dist.nnodes", "must be >= 1")
        _require(0 <= self.node_rank < self.nnodes, "dist.node_rank",
                 f"is {self.node_rank}; it must be in 0..dist.nnodes-1 ({self.nnodes - 1})")
        host, _, port = self.rdzv_endpoint.rpartition(":")
        _require(bool(host) and port.isdigit(), "dist.rdzv_endpoint", f"'{self.rdzv_endpoint}' is not HOST:PORT")
        _require(self.timeout_s >= 10, "dist.timeout_s", "must be >= 10 seconds")

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes


@dataclass
class TrainConfig:
    """`grpo train`: everything a run needs. A recipe fills these in; overrides refine them."""

    task: str = MISSING  # task name, used for the run directory and logs (recipes set it)
    output_dir: str = "runs"  # run directories are created under here as TASK/TIMESTAMP-ID
    resume: str | None = None  # continue a run: its directory, or "auto" for the newest resumable run of the task
    model: ModelConfig = field(default_factory=ModelConfig)  # the policy (and the frozen reference's start)
    data: DataConfig = field(default_factory=DataConfig)  # where prompts come from and how they are rendered
    rewards: list[RewardSpec] = field(default_factory=list)  # reward functions, summed with their weights
    rollout: RolloutConfig = field(default_factory=RolloutConfig)  # sampling groups of completions
    trainer: TrainerConfig = field(default_factory=TrainerConfig)  # the GRPO update
    distill: DistillConfig = field(default_factory=DistillConfig)  # a teacher that grades each sampled token (on-policy distillation)
    eval: EvalConfig = field(default_factory=EvalConfig)  # held-out evaluation during training
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)  # what is saved and when
    logging: LoggingConfig = field(default_factory=LoggingConfig)  # console, metrics files, wandb
    dist: DistConfig = field(default_factory=DistConfig)  # processes and nodes (torchrun, FSDP2, a vLLM engine per rank)

    @property
    def trainer_ranks(self) -> int:
        """The ranks that train: every rank, or under rollout.placement=split the first ones, all but the last
        rollout.generator_ranks (docs/async.md)."""
        split = self.rollout.placement == "split"
        return self.dist.world_size - (self.rollout.generator_ranks if split else 0)

    def __post_init__(self) -> None:
        if self.eval.temperature is None:  # held-out samples drawn as the training samples are
            self.eval.temperature = self.rollout.temperature
        if self.trainer.mismatch_correction == "auto":  # samples from older weights: reweigh the gap (docs/async.md)
            self.trainer.mismatch_correction = "tis" if self.rollout.max_staleness else "none"
        _require(len(self.rewards) > 0, "rewards", "no reward functions; add e.g. rewards=[{name:correct,weight:1.0}]")
        for i, spec in enumerate(self.rewards):
            _require(spec.weight == spec.weight, f"rewards[{i}].weight", "is NaN")
            check_reward_spec(spec, f"rewards[{i}]")
        marked = [f"rewards[{i}] {spec.name}" for i, spec in enumerate(self.rewards) if spec.correctness]
        _require(len(marked) == 1 or (len(self.rewards) == 1 and not marked), "rewards",
                 f"{len(marked)} rewards are marked correctness: true ({', '.join(marked) or 'none'}); mark exactly one, "
                 "the task's correctness check (it gives pass@1, the zero-variance groups and the best checkpoint), "
                 "e.g. rewards=[{name:correct,weight:1.0,correctness:true},{name:format,weight:0.1}]")
        checks = [(i, spec) for i, spec in enumerate(self.rewards) if spec.correctness or len(self.rewards) == 1]
        _require(self.data.sampler.name == "uniform" or checks[0][1].weight != 0, "data.sampler.name",
                 f"{self.data.sampler.name} chooses prompts by their groups' pass rate under the correctness check, "
                 f"rewards[{checks[0][0]}] {checks[0][1].name}, which has weight 0 here: the run would choose its prompts "
                 "by a score it does not train on (a gold score logged beside a learned reward); use "
                 "data.sampler.name=uniform, or give that reward a weight")
        _require(self.model.dtype == "float32" or self.rollout.push_check_tol >= 0.02 or not self.rollout.push_check_every,
                 "rollout.push_check_tol", f"{self.rollout.push_check_tol} is below {self.model.dtype}'s round-off, "
                 "which alone moves the engine's and the trainer's logprobs further; set it to 0.05 (or turn the "
                 "check off with rollout.push_check_every=0)")
        _require(not (self.rollout.max_staleness and self.trainer.offload_optimizer), "trainer.offload_optimizer",
                 "moves AdamW's state out while the engine samples, which with rollout.max_staleness > 0 is while "
                 "the trainer steps; turn one of them off")
        _require(self.distill.loss_objective != "distill" or not (self.trainer.filter_zero_variance
                                                                  or self.rollout.dynamic_sampling),
                 "distill.objective", "distill trains on every group, whatever its rewards: trainer.filter_zero_variance "
                 "and rollout.dynamic_sampling would drop groups a teacher still grades; turn them off (or use grpo+distill)")
        _require(not self.distill.server or self.rollout.temperature == 1.0, "distill.server",
                 f"a served teacher's logprobs are of its untempered distribution, and rollout.temperature is "
                 f"{self.rollout.temperature:g}: load the teacher in the trainer's process (distill.server=null), "
                 "which grades at the sampling temperature")
        for i, spec in enumerate(self.rewards):
            _require(spec.server != "start" or self.dist.nnodes == 1, f"rewards[{i}].server",
                     "start runs the reward model's server on this node's loopback, which other nodes cannot reach: "
                     "start it yourself where every node reaches it and give its URL")
        _require(self.distill.server != "start" or self.dist.nnodes == 1, "distill.server",
                 "start runs the teacher's server on this node's loopback, which other nodes cannot reach: start it "
                 "yourself where every node reaches it and give its URL")
        _require(self.trainer.minibatches <= self.rollout.prompts_per_step, "trainer.minibatches",
                 f"{self.trainer.minibatches} exceeds rollout.prompts_per_step={self.rollout.prompts_per_step}: "
                 "minibatches split the step's groups")
        world = self.dist.world_size
        generators = self.rollout.generator_ranks
        _require(self.rollout.placement == "colocated" or world > generators, "rollout.placement",
                 f"split needs at least one trainer rank besides rollout.generator_ranks={generators}, and the job has "
                 f"{world} processes (dist.nproc_per_node={self.dist.nproc_per_node} x dist.nnodes={self.dist.nnodes}); "
                 f"e.g. dist.nproc_per_node={generators + 1}")
        world = self.trainer_ranks  # the prompts and the groups are shared between the ranks that train
        _require(world % self.rollout.tensor_parallel_size == 0, "rollout.tensor_parallel_size",
                 f"{self.rollout.tensor_parallel_size} does not divide the {world} processes (dist.nproc_per_node x "
                 "dist.nnodes): each engine spans that many of them")
        _require(self.rollout.prompts_per_step % world == 0, "rollout.prompts_per_step",
                 f"{self.rollout.prompts_per_step} does not split over {world} processes (dist.nproc_per_node x "
                 "dist.nnodes, less a split job's generator ranks); make it a multiple of that count")
        _require(not (self.rollout.multi_turn and self.rollout.tool_format == "chat" and self.data.template != "chat"),
                 "rollout.tool_format", "chat shows the tools through the chat template; set data.template=chat")
        _require(not (self.rollout.multi_turn and self.rollout.engine == "hf" and world > 1),
                 "rollout.tools" if self.rollout.tools else "rollout.environment.cls",
                 "with rollout.engine=hf at several processes each rank's generate gathers the sharded policy, and "
                 "ranks whose trajectories take different numbers of turns would not pair up; use rollout.engine=vllm")
        device = self.trainer.device
        _require(not (device.startswith("cuda:") and device != "cuda:0" and self.rollout.engine == "vllm"),
                 "trainer.device", f"{device}: the vLLM engine would still start on GPU 0; pick the GPU with "
                 f"CUDA_VISIBLE_DEVICES={device.partition(':')[2]} and trainer.device=cuda")
        _require(self.eval.num_problems <= self.data.num_heldout, "eval.num_problems",
                 f"{self.eval.num_problems} exceeds data.num_heldout={self.data.num_heldout}")


@dataclass
class RewardCommandConfig(TrainConfig):
    """`grpo reward`: score hand-written completions with a recipe's reward functions."""

    cases: str = MISSING  # JSONL file; each line: completion, the dataset columns (e.g. answer), optional expected


@dataclass
class ExportCommandConfig(TrainConfig):
    """`grpo export`: write a recipe's generated problems to JSONL."""

    out: str = MISSING  # output directory; train.jsonl and heldout.jsonl are written inside


@dataclass
class EvalCommandConfig(TrainConfig):
    """`grpo eval`: held-out metrics of checkpoints, sampled the way they were trained.

    The recipe is the run's own RUN_DIR/config.yaml when the checkpoints come from a run
    (run=DIR, or a path RUN_DIR/checkpoints/NAME), else `recipe=NAME`; command-line
    overrides apply on top of either. Uses eval.num_problems, eval.samples_per_problem (k),
    eval.temperature and eval.greedy. Replaces train's `checkpoint` section, which eval
    has no use for, with the checkpoint to evaluate.
    """

    checkpoint: str | None = None  # a checkpoint or HF model directory, or latest | best | base (of run=DIR)
    checkpoints: list[str] = field(default_factory=list)  # several, compared side by side on one engine, e.g. [base,latest]
    run: str | None = None  # the run directory that latest/best/base refer to (default: the run of a checkpoint path)
    samples_jsonl: bool = False  # also write every sample (prompt, completion, rewards) as JSONL beside the JSON
    out: str | None = None  # the JSON file (or a directory for eval.json); None = CHECKPOINT/eval.json, see grpo_cli/evaluate.py

    def __post_init__(self) -> None:
        super().__post_init__()
        _require(bool(self.checkpoint) or bool(self.checkpoints), "checkpoint",
                 "no checkpoint given; set checkpoint=PATH (or latest|best|base with run=DIR) or checkpoints=[A,B]")
        _require(not (self.checkpoint and self.checkpoints), "checkpoints",
                 "both checkpoint and checkpoints are set; list every checkpoint in checkpoints=[...]")


@dataclass
class MergeCommandConfig:
    """`grpo merge`: a LoRA checkpoint's adapters merged into its base model, written as one whole Hugging Face
    model directory (needs no recipe)."""

    checkpoint: str = MISSING  # a LoRA checkpoint: adapter_config.json + adapter_model.safetensors (e.g. RUN_DIR/checkpoints/final)
    out: str = MISSING  # the directory to write: config.json, model.safetensors and the tokenizer
    base: str | None = None  # the base model; None = the one its checkpoint.json names (a run's base_model)


@dataclass
class PlotCommandConfig:
    """`grpo plot`: draw one run's metrics.jsonl, or several runs overlaid, into one PNG (needs no recipe)."""

    run: str | None = None  # a run directory holding metrics.jsonl
    runs: list[str] = field(default_factory=list)  # several run directories to overlay, e.g. runs=[A,B]
    out: str | None = None  # PNG path; None = RUN/metrics.png, or ./runs_comparison.png for several runs


# Primary config name of each sub-command in Hydra's ConfigStore.
COMMAND_SCHEMAS: dict[str, Any] = {
    "train": TrainConfig,
    "check": TrainConfig,
    "reward": RewardCommandConfig,
    "export": ExportCommandConfig,
    "eval": EvalCommandConfig,
    "plot": PlotCommandConfig,
    "merge": MergeCommandConfig,
}
