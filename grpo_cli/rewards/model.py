"""A learned reward: a reward model (a Hugging Face sequence classifier) scoring each sample's prompt and
completion, as one more reward function of a recipe's weighted list (docs/rewards.md).

`RewardModel` is checked when the recipe's rewards load (before any model does): its files, that it is a
sequence classifier, which logit is the score (its only one, or `rewards[i].label`), its input template, and
a server given by URL answers. It is called like any reward, once per prompt's group, and scores in batches of
`rewards[i].batch_size`, either in this process (its weights load on the first call, or where the run puts them:
`place`, the trainer's device in model.dtype; no gradient) or on a vLLM pooling server (`rewards[i].server`: a
URL, or `start`, a server grpo runs on the model for the run: served.ServerLink), `requests_in_flight` batches at
a time, each request bounded by `timeout_s` and tried REQUEST_TRIES times; a batch that still fails fails its
samples, which follow `on_failure` like any reward's. The text is rendered here either way, so both read the same tokens.

A policy is pushed toward whatever the model pays for, which is not always what is right: log the task's own
checker beside it (weight 0) to see the proxy and the gold score apart.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from grpo_cli.engines.served import ServerLink
from grpo_cli.errors import UsageError
from grpo_cli.rewards.fit import cut_to_fit
from grpo_cli.weights.model_files import checked_model_path

SERVED_NAME = "reward_model"  # the model name a server started here answers to
CUT_MARKER = "\n[... {count} tokens cut to fit the reward model's context ...]\n"  # where a long completion lost its middle

if TYPE_CHECKING:
    import torch

# rewards[i].transform: the classifier's logit -> the reward
TRANSFORMS = {
    "raw": lambda logit: logit,
    "sigmoid": lambda logit: 1.0 / (1.0 + math.exp(-logit)) if logit >= 0 else math.exp(logit) / (1.0 + math.exp(logit)),
}


def render_plain(prompt: str, completion: str, tokenizer: Any) -> str:
    """The prompt, a newline, the completion: for a reward model without a chat template."""
    return f"{prompt}\n{completion}"


def render_chat(prompt: str, completion: str, tokenizer: Any) -> str:
    """The reward model's own chat template: the prompt as the user's turn, the completion as the assistant's."""
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt},
                                          {"role": "assistant", "content": completion}], tokenize=False)


RENDERERS = {"plain": render_plain, "chat": render_chat}  # rewards[i].template (auto picks one per model)


class RewardModel:
    """A reward function backed by a sequence classifier: (completions, prompt=[...]) -> one score each."""

    def __init__(self, key: str, spec: Any) -> None:
        """`spec` is the recipe's RewardSpec; `key` its place in the recipe (rewards[i]), for the errors."""
        from transformers import AutoConfig, AutoTokenizer

        self.key, self.name_or_path = key, spec.model
        self.path = checked_model_path(f"{key}.model", spec.model)
        config = AutoConfig.from_pretrained(self.path)
        architectures = config.architectures or []
        if not any(a.endswith("ForSequenceClassification") for a in architectures):
            raise UsageError(f"{key}.model: {spec.model} is not a sequence classifier ({', '.join(architectures) or config.model_type}); "
                             "a reward model gives each text a logit (e.g. Qwen2ForSequenceClassification with one label)")
        self.index = logit_index(key, config, spec.label)
        self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        self.tokenizer.truncation_side = "left"  # a text past the model's length keeps its end: the answer
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        has_template = bool(getattr(self.tokenizer, "chat_template", None))
        template = ("chat" if has_template else "plain") if spec.template == "auto" else spec.template
        if template == "chat" and not has_template:
            raise UsageError(f"{key}.template: chat, and {spec.model}'s tokenizer has no chat template; set "
                             f"{key}.template=plain (the prompt, a newline, the completion)")
        self.template, self.render = template, RENDERERS[template]
        self.max_tokens = int(getattr(config, "max_position_embeddings", 0) or self.tokenizer.model_max_length)
        self.transform, self.clip, self.batch_size = TRANSFORMS[spec.transform], spec.clip, spec.batch_size
        self.device, self.dtype = "cpu", "float32"
        self.model: torch.nn.Module | None = None
        # served (rewards[i].server): a URL, checked now, or a pooling server started when the run places it
        self.server = None if spec.server is None else ServerLink(
            spec.server, self.path, key, ["--runner", "pooling", "--max-model-len", str(self.max_tokens),
                                          "--enforce-eager"], spec.server_start_timeout_s, spec.timeout_s or 60.0,
            SERVED_NAME, spec.server_kv_cache_gib)
        self.in_flight = spec.requests_in_flight

    def place(self, device: Any, dtype: str, log_dir: Any = None) -> None:
        """Ready to score: in this process, the weights loaded now, frozen, on `device` in `dtype` (the trainer's
        device and model.dtype); with server=start, the server started now in `dtype`, its log in `log_dir`."""
        self.device, self.dtype = device, dtype
        if self.server is None:
            self.model = None
            self._load()
        else:
            self.server.ready(dtype, log_dir, device)

    def close(self) -> None:
        """Stop the server this process started (none in process, or given by URL)."""
        if self.server is not None:
            self.server.close()

    def _load(self) -> torch.nn.Module:
        if self.model is None:
            import torch
            from transformers import AutoModelForSequenceClassification

            model = AutoModelForSequenceClassification.from_pretrained(self.path, dtype=getattr(torch, self.dtype),
                                                                       use_safetensors=True)
            self.model = model.to(self.device).eval().requires_grad_(False)
        return self.model

    def texts(self, completions: list[str], prompts: list[str]) -> list[str]:
        """What the reward model reads for each sample: the rendered prompt and completion, the completion's middle
        cut where the whole would pass the model's context (rewards/fit.py). Where the prompt alone does not fit,
        the text keeps its end (the tokenizer truncates on the left)."""
        return [self.fitted(p, c) for p, c in zip(prompts, completions, strict=True)]

    def fitted(self, prompt: str, completion: str) -> str:
        tokenizer = self.tokenizer
        return cut_to_fit(lambda c: self.render(prompt, c, tokenizer),
                          lambda text: len(tokenizer(text)["input_ids"]) - self.max_tokens,  # as the forward pass reads it
                          lambda text: tokenizer(text, add_special_tokens=False)["input_ids"], tokenizer.decode,
                          completion, CUT_MARKER) or self.render(prompt, completion, tokenizer)

    def logits(self, texts: list[str]) -> list[float]:
        """The chosen logit of each text, `batch_size` texts a forward pass (or a request, when served)."""
        if self.server is not None:
            return self.served_logits(texts)
        import torch

        model, out = self._load(), []
        for first in range(0, len(texts), self.batch_size):
            batch = self.tokenizer(texts[first:first + self.batch_size], padding=True, truncation=True,
                                   max_length=self.max_tokens, return_tensors="pt").to(self.device)
            with torch.no_grad():
                out += model(**batch).logits[:, self.index].float().tolist()  # [B]
        return out

    def served_logits(self, texts: list[str]) -> list[float]:
        """The same logits from the server's `/classify` (raw: no activation; the transform is applied here),
        `requests_in_flight` batches at a time."""
        batches = [texts[first:first + self.batch_size] for first in range(0, len(texts), self.batch_size)]
        return self.server.ask_all(self.classify, batches, self.in_flight, self.dtype)

    def classify(self, texts: list[str]) -> list[float]:
        """One request: each text's chosen logit."""
        answer = self.server.post("/classify", {"input": texts, "use_activation": False,
                                                "truncate_prompt_tokens": self.max_tokens, "truncation_side": "left"})
        data = sorted(answer["data"], key=lambda d: d["index"])
        if len(data) != len(texts):
            raise ValueError(f"{self.key}.server gave {len(data)} results for {len(texts)} texts")
        return [float(d["probs"][self.index]) for d in data]

    def scores(self, logits: list[float]) -> list[float]:
        """The transform, then the clip: the rewards of these logits."""
        scored = [self.transform(x) for x in logits]
        return scored if self.clip is None else [min(max(x, -self.clip), self.clip) for x in scored]

    def __call__(self, completions: list[str], prompt: list[str] | None = None, **_: Any) -> list[float]:
        if prompt is None:
            raise ValueError("a reward model scores the prompt with the completion, and no prompt was given")
        return self.scores(self.logits(self.texts(completions, prompt)))

    def __repr__(self) -> str:
        return f"RewardModel({self.name_or_path})"


def logit_index(key: str, config: Any, label: str | None) -> int:
    """Which of the classifier's logits is the reward: `label` by name, or the only one."""
    names = [config.id2label[i] for i in sorted(config.id2label)] if getattr(config, "id2label", None) else []
    count = int(getattr(config, "num_labels", len(names)) or len(names))
    if label is None:
        if count != 1:
            raise UsageError(f"{key}.label: the reward model has {count} labels ({', '.join(map(str, names))}); "
                             f"choose the one whose logit is the reward, e.g. {key}.label={names[-1] if names else 0}")
        return 0
    if label not in names:
        raise UsageError(f"{key}.label: '{label}' is not one of the reward model's labels ({', '.join(map(str, names))})")
    return names.index(label)
