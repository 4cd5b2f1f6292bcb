"""What every rollout engine is: the `Engine` protocol, its inputs (`Sampling`, `Request`) and outputs
(`Rollouts`, `Completion`), and `DelegatingEngine`, the base of the engines that wrap another.

The engines themselves live beside this module: `vllm.VLLMEngine` (the default), `hf.HFEngine`
(transformers on the trainer's own module), `remote.RemoteEngine` (a split job's generator rank),
and the wrappers `sharded.ShardedEngine` (a rank's share of a job) and `tools.ToolEngine` (the
multi-turn tool loop). Each one implements the whole protocol, so the loop never asks an engine
what it can do; `tests/test_layout.py` checks that no engine misses a method.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Hashable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Protocol


@dataclass
class Rollouts:
    """One step's samples, laid out [P][G] (prompts x group_size)."""

    prompt_ids: list[list[int]]  # [P] prompt token ids
    completion_ids: list[list[list[int]]]  # [P][G] sampled completion token ids
    sampling_logprobs: list[list[list[float]]]  # [P][G][T_i] each sampled token's logprob, after the temperature
    texts: list[list[str]]  # [P][G] decoded completions; a tool run's: the model's own words, tool replies left out
    truncated: list[list[bool]]  # [P][G] stopped by max_new_tokens (or a tool run's cap) instead of end-of-sequence
    # With tools (grpo_cli.engines.tools) a completion is a trajectory: the model's tokens and the
    # environment's replies. Empty lists: single-turn, every token is the model's.
    model_mask: list[list[list[int]]] = field(default_factory=list)  # [P][G][T_i] 1 on the model's tokens, 0 on the tools'
    segments: list[list[list[dict]]] = field(default_factory=list)  # [P][G] the turns: {"role": "model"|"tool", "text", ...}
    capped: list[list[str | None]] = field(default_factory=list)  # [P][G] the tool-run cap that stopped it, or None
    environments: list[list[Any]] = field(default_factory=list)  # [P][G] with rollout.environment: its EnvironmentEnd
    tool_seconds: list[float] = field(default_factory=list)  # one per engine share of a tool run: wall s with a call running
    tool_late_s: list[float] = field(default_factory=list)  # one per engine share: s the engine waited on late results
    trajectories: list[list[str]] = field(default_factory=list)  # [P][G] a tool run's whole decoded trajectory, replies in it

    FIELDS = ("prompt_ids", "completion_ids", "sampling_logprobs", "texts", "truncated", "model_mask", "segments",
              "capped", "environments", "tool_seconds", "tool_late_s", "trajectories")

    @property
    def num_tokens(self) -> int:
        return sum(len(c) for group in self.completion_ids for c in group)

    def model_tokens(self) -> list[int]:
        """[P*G] each completion's own tokens: its length, less the tools' replies in a trajectory."""
        if not self.model_mask:
            return [len(c) for group in self.completion_ids for c in group]
        return [sum(mask) for group in self.model_mask for mask in group]

    def trajectory_texts(self) -> tuple[list[str], list[int]] | None:
        """([P*G] each trajectory's whole text, [P*G] its tokens after the prompt, the replies' included), or None
        when single-turn: what the rewards receive as `trajectory` and `trajectory_tokens`."""
        if not self.segments:
            return None
        return ([text for group in self.trajectories for text in group],
                [len(c) for group in self.completion_ids for c in group])

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
    there by the caller (engines.tools.cut_at_stop). `logprob_seeds`: the prompts, named by their seed, whose
    samples come back with their sampling logprobs (None: every prompt's); an engine may return the others' as
    NaN, which costs vLLM nothing (`wants_logprobs`; the run's rule is rollout.logprob_seeds)."""

    n: int
    temperature: float
    top_p: float
    max_new_tokens: int
    stop: tuple[str, ...] = ()
    logprob_seeds: frozenset[int] | None = None


NO_LOGPROBS: frozenset[int] = frozenset()  # Sampling.logprob_seeds of a call that reads no sampling logprobs (evaluation)


def wants_logprobs(sampling: Sampling, seed: int) -> bool:
    """Whether the samples of the prompt sampled from `seed` must come back with their sampling logprobs."""
    return sampling.logprob_seeds is None or seed in sampling.logprob_seeds


def unknown_logprobs(length: int) -> list[float]:
    """[T] the sampling logprobs of a sample whose engine was not asked for them: NaN, so that nothing can read
    them as numbers unnoticed (the mismatch metric skips them: update.minibatch_step)."""
    return [math.nan] * length


class Request(NamedTuple):
    """One sequence to continue (VLLMEngine.generate_each): `key` names it to the caller."""

    key: Any
    prompt_ids: list[int]  # the prompt and everything after it so far
    sampling: Sampling  # n = 1
    seed: int


class Replies(Protocol):
    """Continuations that arrive after `on_finish` returned: a trajectory whose tool call ran off the engine
    loop (tools.pool), its reply appended. `generate_each` takes them between engine steps."""

    def waiting(self) -> int:
        """Continuations still to come (calls running or queued, or finished and not taken)."""

    def take(self, running: Collection[Hashable]) -> list[Request]:
        """After each engine step, with `running` the ids of the requests the engine holds (decoding or queued;
        empty when it is idle): the continuations whose rejoin point this step is (tools.pool), waiting for any
        whose call is still running. A pure function of the engine's steps, never of the clock."""


class Completion(NamedTuple):
    ids: list[int]  # the sampled token ids
    logprobs: list[float]  # each one's sampling logprob
    truncated: bool  # stopped by max_new_tokens


class Engine(Protocol):
    """What the loop, the held-out evaluation and `grpo eval` ask of a rollout engine."""

    tokenizer: Any
    # How a LoRA policy's adapters reach the engine (sync.push): "request" (push_adapter: vLLM serves the base
    # and applies the adapters per request), "merged" (push_weights with the adapters merged in), "shared"
    # (the engine samples from the policy module itself)
    adapters: str
    # Whether the engine samples in this process (a thread may run it beside the update, ahead.py); False for a
    # split job's generator rank, which samples in its own process while this one trains
    in_process: bool

    def generate(self, prompt_ids: list[list[int]], sampling: Sampling, seeds: list[int],
                 rows: list[dict] | None = None) -> Rollouts:
        """[P][G] samples of the P prompts, prompt i from seeds[i]. `rows`: the prompts' dataset rows, which a
        tool run's environment is built from (an engine without one ignores them). At world size > 1 every
        rank gets every engine's samples (a collective)."""

    def generate_share(self, prompt_ids: list[list[int]], sampling: Sampling, seeds: list[int],
                       rows: list[dict] | None = None) -> Rollouts:
        """This engine's share of the prompts, sampled, without a collective (all of them on one rank)."""

    def gather_shares(self, part: Rollouts) -> Rollouts:
        """Every engine's share, in prompt order (a collective at world size > 1; `part` itself on one rank)."""

    def start_generate(self, prompt_ids: list[list[int]], sampling: Sampling, seeds: list[int],
                       rows: list[dict] | None = None) -> Callable[[], tuple[Rollouts, float]]:
        """Begin sampling this engine's share; the returned call gives (the share, the sampling's seconds). An
        engine of another process has started when this returns; one of this process samples in the call."""

    def generate_each(self, requests: list[Request], on_finish: Callable[[Any, Completion], Request | None],
                      replies: Replies | None = None) -> None:
        """Sample each request (n = 1, its own seed) and hand each completion to `on_finish`; the request it
        returns, and those `replies` gives back later (a tool's reply appended), are sampled next, until none
        runs and none is waiting. The multi-turn tool loop's turns."""

    def push_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        """The trainer's checkpoint-format tensors, in place of the engine's."""

    def push_adapter(self, tensors: dict[str, Any], config: dict[str, Any]) -> None:
        """The policy's LoRA adapters (peft's tensors and config) as the ones the engine applies from now on."""

    def load_adapter(self, directory: str | Path | None) -> None:
        """The peft adapter saved in `directory` as the one the engine applies (None: the base alone)."""

    def read_weights(self, names: Iterable[str]) -> dict[str, Any]:
        """Copies of the engine's own tensors named `names` that it holds as loaded (the push check's exact
        comparison); {} for an engine that shares the trainer's."""

    def read_adapter(self, modules: Iterable[str]) -> dict[str, tuple[Any, Any]]:
        """Copies of the served adapter's (A, B) for `modules`; {} without one."""

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        """The engine's logprob of tokens 1.. of each sequence (teacher-forced), for the push check."""

    def sleep(self) -> None:
        """Free the device for the trainer (vLLM's sleep mode); nothing where there is nothing to free."""

    def wake_weights(self) -> None:
        """Weights back before a push (the KV cache stays asleep)."""

    def wake_kv_cache(self) -> None:
        """The KV cache back after the push."""

    def step_metrics(self) -> dict[str, float]:
        """What the engine adds to a step's metrics: a generator rank's peak memory; {} in this process."""

    def close(self) -> None:
        """The run is over: an engine of another process stops."""


def timed_share(engine: Engine, prompt_ids: list[list[int]], sampling: Sampling, seeds: list[int],
                rows: list[dict] | None) -> Callable[[], tuple[Rollouts, float]]:
    """`start_generate` of an engine of this process: the call samples its share and times it."""
    import time

    def sample() -> tuple[Rollouts, float]:
        tick = time.time()
        return engine.generate_share(prompt_ids, sampling, seeds, rows), time.time() - tick

    return sample


class LeafEngine:
    """The protocol's share methods for an engine that wraps none (vLLM, transformers, a split job's generator):
    its share is all it is given, its gathered shares are its own, and, in this process, `start_generate`
    samples when the caller asks for the result."""

    def generate_share(self, prompt_ids: list[list[int]], sampling: Sampling, seeds: list[int],
                       rows: list[dict] | None = None) -> Rollouts:
        return self.generate(prompt_ids, sampling, seeds, rows)  # type: ignore[attr-defined]

    def gather_shares(self, part: Rollouts) -> Rollouts:
        return part

    def start_generate(self, prompt_ids: list[list[int]], sampling: Sampling, seeds: list[int],
                       rows: list[dict] | None = None) -> Callable[[], tuple[Rollouts, float]]:
        return timed_share(self, prompt_ids, sampling, seeds, rows)  # type: ignore[arg-type]

    def step_metrics(self) -> dict[str, float]:
        return {}


class DelegatingEngine:
    """An engine around another (a rank's share of a job, the tool loop): every method of the protocol is the
    inner engine's unless the wrapper defines its own."""

    def __init__(self, engine: Engine) -> None:
        self.engine, self.tokenizer = engine, engine.tokenizer

    @property
    def adapters(self) -> str:
        return self.engine.adapters

    @property
    def in_process(self) -> bool:
        return self.engine.in_process

    def generate(self, prompt_ids: list[list[int]], sampling: Sampling, seeds: list[int],
                 rows: list[dict] | None = None) -> Rollouts:
        return self.engine.generate(prompt_ids, sampling, seeds, rows)

    def generate_share(self, prompt_ids: list[list[int]], sampling: Sampling, seeds: list[int],
                       rows: list[dict] | None = None) -> Rollouts:
        """This wrapper's own `generate`: only a ShardedEngine splits prompts between ranks, and it wraps the rest."""
        return self.generate(prompt_ids, sampling, seeds, rows)

    def gather_shares(self, part: Rollouts) -> Rollouts:
        return self.engine.gather_shares(part)

    def start_generate(self, prompt_ids: list[list[int]], sampling: Sampling, seeds: list[int],
                       rows: list[dict] | None = None) -> Callable[[], tuple[Rollouts, float]]:
        """In this process, this wrapper's share (its own `generate_share`); else the inner engine's, started."""
        if self.in_process:
            return timed_share(self, prompt_ids, sampling, seeds, rows)
        return self.engine.start_generate(prompt_ids, sampling, seeds, rows)

    def generate_each(self, requests: list[Request], on_finish: Callable[[Any, Completion], Request | None],
                      replies: Replies | None = None) -> None:
        self.engine.generate_each(requests, on_finish, replies)

    def push_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        self.engine.push_weights(named_tensors)

    def push_adapter(self, tensors: dict[str, Any], config: dict[str, Any]) -> None:
        self.engine.push_adapter(tensors, config)

    def load_adapter(self, directory: str | Path | None) -> None:
        self.engine.load_adapter(directory)

    def read_weights(self, names: Iterable[str]) -> dict[str, Any]:
        return self.engine.read_weights(names)

    def read_adapter(self, modules: Iterable[str]) -> dict[str, tuple[Any, Any]]:
        return self.engine.read_adapter(modules)

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        return self.engine.score(sequences)

    def sleep(self) -> None:
        self.engine.sleep()

    def wake_weights(self) -> None:
        self.engine.wake_weights()

    def wake_kv_cache(self) -> None:
        self.engine.wake_kv_cache()

    def step_metrics(self) -> dict[str, float]:
        return self.engine.step_metrics()

    def close(self) -> None:
        self.engine.close()
