"""rewards[i]: one reward function, model or judge of a recipe's list."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from grpo_cli.config.errors import require


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
    require(spec.name is not None, f"{key}.name", "missing: give a reward function (a built-in name or "
            "package.module:function), a reward model as model=DIR_OR_HUB_ID, or a judge as judge=TEMPLATE")
    if spec.model is None and spec.judge is None:
        learned = [k for k in ("label", "clip", "server") if getattr(spec, k) is not None]
        learned += [k for k, default in (("transform", "raw"), ("template", "auto"), ("batch_size", 32),
                                         ("requests_in_flight", 4), ("server_start_timeout_s", 300.0),
                                         ("server_kv_cache_gib", 1.0), ("parser", "score_10"), ("max_tokens", 32))
                    if getattr(spec, k) != default]
        require(not learned, f"{key}.{learned[0] if learned else ''}", "is a learned reward's setting; this reward "
                f"is the function '{spec.name}' (set {key}.model for a reward model, {key}.judge for a judge)")
        return
    require(spec.transform in REWARD_TRANSFORMS, f"{key}.transform",
            f"'{spec.transform}' is not one of {', '.join(REWARD_TRANSFORMS)}")
    require(spec.template in REWARD_TEMPLATES, f"{key}.template",
            f"'{spec.template}' is not one of {', '.join(REWARD_TEMPLATES)}")
    require(spec.clip is None or spec.clip > 0, f"{key}.clip", f"{spec.clip} must be > 0 (or null for none)")
    require(spec.batch_size >= 1, f"{key}.batch_size", "must be >= 1")
    require(spec.requests_in_flight >= 1, f"{key}.requests_in_flight", "must be >= 1")
    require(spec.max_tokens >= 1, f"{key}.max_tokens", "must be >= 1")
    require(spec.server_start_timeout_s > 0, f"{key}.server_start_timeout_s", "must be > 0")
    require(spec.server_kv_cache_gib > 0, f"{key}.server_kv_cache_gib", "must be > 0 GiB")
    require(spec.server is None or spec.server == "start" or spec.server.startswith(("http://", "https://")),
            f"{key}.server", f"'{spec.server}' is not start or an http(s):// URL")
