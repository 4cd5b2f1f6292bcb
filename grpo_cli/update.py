"""The update stage: logprobs of a frozen model, then the loss over micro-batches and one optimizer step.

Both passes share the train batch's padding and run each kept prompt once
(`grpo.prompt_states`); the completions of every micro-batch attend to it. In the update
the prompts' gradient builds up on detached leaves over the micro-batches and goes back
through the prompt pass once, after the last one.
"""

from __future__ import annotations

import math
from typing import Any

from grpo_cli.batch import TrainBatch
from grpo_cli.config import TrainConfig


def score_logprobs(model: Any, batch: TrainBatch, chunk_tokens: int, temperature: float) -> list[Any]:
    """A frozen model's logprobs of every micro-batch's completions (no grad): `[b, Tc]` each;
    all None when there is no model (the reference is not loaded when kl_coef = 0)."""
    if model is None or not batch.micro_batches:
        return [None] * len(batch.micro_batches)
    import torch

    from grpo_cli import grpo

    with torch.no_grad():
        prompts = grpo.prompt_states(model, batch.prompt_ids, batch.prompt_mask)  # each kept prompt once
        return [grpo.completion_logprobs(model, prompts, mb.prompt_index, mb.ids, mb.mask, chunk_tokens,
                                         temperature=temperature) for mb in batch.micro_batches]  # [b, Tc] each


def merge_token_means(total: dict[str, float], stats: dict[str, float]) -> None:
    """Add one micro-batch's loss stats (token means, weighted by their `tokens`) into `total` (sums)."""
    for key, value in stats.items():
        if key != "tokens":
            total[key] = total.get(key, 0.0) + value * stats["tokens"]
    total["tokens"] = total.get("tokens", 0.0) + stats["tokens"]


def update(policy: Any, optimizer: Any, scheduler: Any, batch: TrainBatch, cfg: TrainConfig,
           dist: Any) -> dict[str, Any]:
    """One optimizer step on the batch: the loss (trainer.loss) summed over micro-batches, clipped
    gradient, AdamW, lr schedule. A non-finite loss or gradient (on any rank) skips the step.

    Returns the step's stats: loss; the loss's own stats as token means over the batch (kl,
    clip_frac, ...); the train/inference mismatch; grad_norm (None when skipped) and
    skipped_nonfinite.
    """
    import torch

    from grpo_cli import grpo

    t_cfg = cfg.trainer
    loss_fn = grpo.LOSSES[t_cfg.loss]
    params = grpo.LossParams(t_cfg.clip_eps, t_cfg.clip_eps_high, t_cfg.kl_coef)
    optimizer.zero_grad(set_to_none=True)
    loss_total, sums = 0.0, {}  # sums: each loss stat x tokens, and tokens
    mismatch_sum, mismatch_tokens = 0.0, 0
    if batch.micro_batches:
        prompts = grpo.prompt_states(policy, batch.prompt_ids, batch.prompt_mask)  # with autograd: backward at the end
        leaves = grpo.prompt_leaves(prompts)  # collect the prompts' gradient over the micro-batches
    for mb in batch.micro_batches:
        logps = grpo.completion_logprobs(policy, leaves, mb.prompt_index, mb.ids, mb.mask, t_cfg.logprob_chunk_tokens,
                                         temperature=cfg.rollout.temperature)  # [b, Tc]
        inputs = grpo.LossInputs(logps, mb.mask, mb.advantages, ref_logprobs=mb.ref_logprobs,
                                 sampling_logprobs=mb.sampling_logprobs, normalizer=batch.normalizer)
        loss, stats = loss_fn(inputs, params)
        loss.backward()
        loss_total += float(loss.detach())
        merge_token_means(sums, stats)
        # train/inference mismatch: the engine's sampling logprobs vs the trainer's, same tokens
        mismatch_sum += float(((logps.detach() - mb.sampling_logprobs).abs() * mb.mask).sum())
        mismatch_tokens += int(mb.mask.sum())
    if batch.micro_batches:
        grpo.prompt_backward(prompts, leaves)  # the prompts' share of the gradient
    tokens = sums.pop("tokens", 0.0)
    means = {key: value / max(tokens, 1.0) for key, value in sums.items()}
    grad_norm = float(torch.nn.utils.clip_grad_norm_(policy.parameters(), t_cfg.max_grad_norm))
    finite = dist.all(math.isfinite(grad_norm) and math.isfinite(loss_total))
    if finite and batch.micro_batches:  # skip a non-finite update: one bad batch must not poison the weights
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    return {"loss": loss_total, **means, "grad_norm": grad_norm if finite else None,
            "skipped_nonfinite": int(not finite),
            "mismatch/mean_abs_logprob": mismatch_sum / max(mismatch_tokens, 1)}


class NonFiniteGuard:
    """Counts updates skipped in a row for a non-finite loss or gradient; too many stop the run."""

    def __init__(self, max_bad_steps: int) -> None:
        self.max_bad_steps = max_bad_steps  # trainer.max_bad_steps
        self.in_a_row = 0

    def check(self, stats: dict[str, Any], step: int, warn: Any) -> None:
        from grpo_cli.errors import UsageError

        if not stats["skipped_nonfinite"]:
            self.in_a_row = 0
            return
        self.in_a_row += 1
        warn(f"step {step}: non-finite loss or gradient, update skipped ({self.in_a_row} in a row)")
        if self.in_a_row >= self.max_bad_steps:
            raise UsageError(f"{self.in_a_row} steps in a row had a non-finite loss or gradient (trainer."
                             f"max_bad_steps={self.max_bad_steps}); lower trainer.lr or check the rewards")
