"""model.*: the policy, and LoRA on it."""

from __future__ import annotations

from dataclasses import dataclass, field

from grpo_cli.config.errors import require

BUILTIN_MODEL = "builtin:bike_base"  # the small model shipped inside the package

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
        require(self.rank is None or self.rank >= 1, "model.lora.rank",
                f"is {self.rank}; it must be >= 1 (or null, the default, to train every weight)")
        require(self.alpha > 0, "model.lora.alpha", "must be > 0")
        require(0 <= self.dropout < 1, "model.lora.dropout", "must be in [0, 1)")
        require(bool(self.target_modules), "model.lora.target_modules", "is empty; name at least one module")
        require(self.lr is None or self.lr > 0, "model.lora.lr", "must be > 0 (or null: trainer.lr)")

    @property
    def enabled(self) -> bool:
        return self.rank is not None


@dataclass
class ModelConfig:
    name_or_path: str = BUILTIN_MODEL  # local HF directory, hub id, or "builtin:NAME" for a model shipped in grpo_cli/models
    dtype: str = "float32"  # compute dtype: float32 | bfloat16 | float16; on CUDA the trainer keeps fp32 master weights and autocasts
    max_context_tokens: int | None = None  # cap on prompt+completion tokens; None = the model's max_position_embeddings
    lora: LoraConfig = field(default_factory=LoraConfig)  # train LoRA adapters instead of every weight (model.lora.rank=16)
    freeze_vision: bool = True  # a vision-language model: keep the vision tower and its connector as they are (docs/vision.md); False trains them too

    def __post_init__(self) -> None:
        require(self.dtype in ("float32", "bfloat16", "float16"), "model.dtype",
                f"'{self.dtype}' is not one of float32, bfloat16, float16")
