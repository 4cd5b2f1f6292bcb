"""trainer.* and distill.*: the update, its loss variants and the teacher."""

from __future__ import annotations

from dataclasses import dataclass, field

from grpo_cli.algorithm.schedules import LR_SCHEDULES  # pure: math only
from grpo_cli.config.errors import require

# Names of the loss axes' tables in grpo_cli/algorithm/grpo.py (LOSSES, POLICY_TERMS, KL_ESTIMATORS, ADVANTAGES,
# CORRECTIONS, OBJECTIVES), spelled out so validation imports no torch; tests/test_loss_variants.py ties each to
# its table.
LOSS_NAMES = ("grpo", "token_mean", "dr_grpo")
POLICY_LOSS_NAMES = ("ppo_clip", "gspo")
KL_ESTIMATOR_NAMES = ("k1", "k2", "k3")
ADVANTAGE_NAMES = ("group_std", "group_mean", "batch_std", "reinforce_pp_baseline", "rloo")
CORRECTION_NAMES = ("none", "tis", "seq_mask")
OBJECTIVE_NAMES = ("grpo", "distill", "grpo+distill")



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
        require(self.steps >= 1, "trainer.steps", "must be >= 1")
        require(self.lr > 0, "trainer.lr", "must be > 0")
        require(0 < self.clip_eps < 1, "trainer.clip_eps", "must be in (0, 1)")
        require(self.clip_eps_high is None or self.clip_eps_high > 0, "trainer.clip_eps_high", "must be > 0 or null")
        require(self.kl_coef >= 0, "trainer.kl_coef", "must be >= 0")
        require(self.micro_batch_size >= 1, "trainer.micro_batch_size", "must be >= 1")
        require(self.micro_batch_tokens >= 0, "trainer.micro_batch_tokens", "must be >= 0 (0 = no token cap)")
        require(self.logprob_chunk_tokens >= 1, "trainer.logprob_chunk_tokens", "must be >= 1")
        require(self.lr_schedule in LR_SCHEDULES, "trainer.lr_schedule",
                f"'{self.lr_schedule}' is not one of {', '.join(LR_SCHEDULES)}")
        require(self.norm_lr_scale > 0, "trainer.norm_lr_scale", "must be > 0")
        # The names of grpo_cli.algorithm.grpo's tables, spelled out: that module imports torch (tests/test_config.py ties them).
        for key, value, names in (("loss", self.loss, LOSS_NAMES), ("policy_loss", self.policy_loss, POLICY_LOSS_NAMES),
                                  ("kl_estimator", self.kl_estimator, KL_ESTIMATOR_NAMES),
                                  ("advantage", self.advantage, ADVANTAGE_NAMES),
                                  ("mismatch_correction", self.mismatch_correction, (*CORRECTION_NAMES, "auto"))):
            require(value in names, f"trainer.{key}", f"'{value}' is not one of {', '.join(names)}")
        require(self.clip_ratio_c is None or self.clip_ratio_c > 1, "trainer.clip_ratio_c", "must be > 1 or null")
        require(self.tis_cap > 0, "trainer.tis_cap", "must be > 0")
        require(0 <= self.seq_mask_low < 1 < self.seq_mask_high, "trainer.seq_mask_low",
                f"the band [{self.seq_mask_low}, {self.seq_mask_high}] must hold 1 (seq_mask_low < 1 < seq_mask_high)")
        require(self.entropy_coef >= 0, "trainer.entropy_coef", "must be >= 0")
        require(self.ppo_epochs >= 1, "trainer.ppo_epochs", "must be >= 1")
        require(self.minibatches >= 1, "trainer.minibatches", "must be >= 1")
        require(not (self.kl_in_reward and self.kl_coef == 0), "trainer.kl_in_reward",
                "needs trainer.kl_coef > 0 (the penalty's weight)")
        require(len(self.betas) == 2, "trainer.betas", "must be two numbers, e.g. [0.9,0.99]")
        require(self.max_grad_norm > 0, "trainer.max_grad_norm", "must be > 0")
        require(self.threads >= 0, "trainer.threads", "must be >= 0 (0 = all cores)")
        require(self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:"), "trainer.device",
                f"'{self.device}' is not one of auto, cpu, cuda, cuda:N")
        require(self.max_bad_steps >= 1, "trainer.max_bad_steps", "must be >= 1")


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
        require(self.objective in OBJECTIVE_NAMES[1:], "distill.objective",
                f"'{self.objective}' is not one of {', '.join(OBJECTIVE_NAMES[1:])}")
        require(self.coef > 0, "distill.coef", "must be > 0")
        require(self.server is None or bool(self.teacher), "distill.server",
                "needs distill.teacher too: the model it serves, whose tokenizer is checked against the student's")
        require(self.server is None or self.server == "start" or self.server.startswith(("http://", "https://")),
                "distill.server", f"'{self.server}' is neither start nor an http(s) URL")
        require(self.requests_in_flight >= 1, "distill.requests_in_flight", "must be >= 1")
        require(self.request_timeout_s > 0, "distill.request_timeout_s", "must be > 0 seconds")
        require(self.server_start_timeout_s > 0, "distill.server_start_timeout_s", "must be > 0 seconds")
        require(self.server_kv_cache_gib > 0, "distill.server_kv_cache_gib", "must be > 0 GiB")

    @property
    def loss_objective(self) -> str:
        """The name in grpo.OBJECTIVES the loss uses: plain GRPO without a teacher."""
        return self.objective if self.teacher else "grpo"
