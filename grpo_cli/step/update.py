"""The update stage: logprobs of a model without grad, then `ppo_epochs x minibatches` optimizer steps.

Every pass shares the train batch's padding and runs each prompt of a minibatch once
(`passes.prompt_states`); the completions of every micro-batch attend to it. In an optimizer
step the prompts' gradient builds up on detached leaves over the micro-batches and goes
back through the prompt pass once, after the last one.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from grpo_cli.algorithm import grpo, passes
from grpo_cli.algorithm.grpo import LossParams
from grpo_cli.config import TrainConfig
from grpo_cli.dist import Dist
from grpo_cli.dist.shard import grad_norm_tensor, reshard_all, run_pass
from grpo_cli.rewards.teacher import ServedTeacher
from grpo_cli.step.batch import Minibatch, TrainBatch, minibatch_normalizer
from grpo_cli.step.collect import Groups
from grpo_cli.step.state import RunState
from grpo_cli.weights.lora import adapters_off

if TYPE_CHECKING:
    import torch



def loss_params(cfg: TrainConfig) -> LossParams:
    """The recipe's loss choices as `grpo.LossParams` (the KL leaves the loss when it goes into the reward)."""
    t = cfg.trainer
    return grpo.LossParams(
        clip_eps=t.clip_eps, clip_eps_high=t.clip_eps_high, kl_coef=0.0 if t.kl_in_reward else t.kl_coef,
        policy_loss=t.policy_loss, clip_ratio_c=t.clip_ratio_c, kl_estimator=t.kl_estimator,
        correction=t.mismatch_correction, tis_cap=t.tis_cap, seq_mask_low=t.seq_mask_low,
        seq_mask_high=t.seq_mask_high, entropy_coef=t.entropy_coef,
        max_new_tokens=cfg.rollout.trajectory_tokens,  # dr_grpo's constant: the most tokens a completion holds
        objective=cfg.distill.loss_objective, distill_coef=cfg.distill.coef)


def needs_old_logprobs(cfg: TrainConfig) -> bool:
    """Whether the policy's logprobs are taken once, before the first update: when the policy can move
    before a sample is used (more than one optimizer step per batch), when the KL goes into the reward,
    or when seq_mask must know the rejected samples before the normalizers are fixed."""
    t = cfg.trainer
    return t.ppo_epochs > 1 or t.minibatches > 1 or t.kl_in_reward or t.mismatch_correction == "seq_mask"


def batch_logprobs(model: torch.nn.Module | None, batch: TrainBatch, chunk_tokens: int, temperature: float,
                   autocast: Callable[[], AbstractContextManager] | None = None) -> list[torch.Tensor | None]:
    """A model's logprobs of every micro-batch's completions, without grad: `[b, Tc]` each, in the
    order of `batch.micro_batches`; all None when there is no model (no reference when kl_coef = 0).
    `autocast` is the compute context (bf16 on CUDA); the logprobs themselves are float32."""
    if model is None or not batch.micro_batches:
        return [None] * len(batch.micro_batches)
    import contextlib

    import torch

    out = []
    with torch.no_grad(), (autocast or contextlib.nullcontext)():
        for part in batch.minibatches:
            prompts = run_pass(model, passes.prompt_states, part.prompt_ids, part.prompt_mask,
                               part.prompt_pixels)  # each prompt once
            out += [run_pass(model, passes.completion_logprobs, prompts, mb.prompt_index, mb.ids, mb.attended,
                             chunk_tokens, temperature=temperature) for mb in part.micro_batches]  # [b, Tc] each
            reshard_all(model)  # FSDP (world size > 1): back to this rank's shards
    return out


def fill_logprobs(state: RunState, batch: TrainBatch, groups: Groups, cfg: TrainConfig) -> dict[str, float]:
    """Fill in every micro-batch's reference logprobs, a distillation teacher's, and, when the policy can move
    before a sample is used, its old logprobs; with seq_mask, leave the rejected samples out of the normalizers; with
    trainer.kl_in_reward, fold the KL into the advantages. Returns the KL penalty's stats
    ({"reward/kl_penalty": ...}; {} without kl_in_reward)."""
    dist, chunk, temperature = state.dist, cfg.trainer.logprob_chunk_tokens, cfg.rollout.temperature
    autocast = lambda: dist.autocast(cfg.model.dtype)  # noqa: E731
    old = batch_logprobs(state.policy if needs_old_logprobs(cfg) else None, batch, chunk, temperature, autocast)
    ref = reference_logprobs(state, batch, cfg, autocast)
    teacher = teacher_logprobs(state, batch, cfg, autocast)
    for mb, old_lp, ref_lp, teacher_lp in zip(batch.micro_batches, old, ref, teacher):
        mb.old_logprobs, mb.ref_logprobs, mb.teacher_logprobs = old_lp, ref_lp, teacher_lp  # [b, Tc] each (or None)
    if cfg.trainer.mismatch_correction == "seq_mask" and batch.micro_batches:
        renormalize_without_rejected(batch, cfg, dist)
    return kl_into_advantages(batch, groups, cfg, dist) if cfg.trainer.kl_in_reward and batch.micro_batches else {}


def reference_logprobs(state: RunState, batch: TrainBatch, cfg: TrainConfig,
                       autocast: Callable[[], AbstractContextManager]) -> list[torch.Tensor | None]:
    """The frozen reference's logprobs of every micro-batch (all None without a KL term): its own model, or with
    LoRA the policy with its adapters off, which is the base model exactly (docs/lora.md)."""
    chunk, temperature = cfg.trainer.logprob_chunk_tokens, cfg.rollout.temperature
    if cfg.model.lora.enabled and cfg.trainer.kl_coef > 0:
        with adapters_off(state.policy):
            return batch_logprobs(state.policy, batch, chunk, temperature, autocast)
    return batch_logprobs(state.reference, batch, chunk, temperature, autocast)


def teacher_logprobs(state: RunState, batch: TrainBatch, cfg: TrainConfig,
                     autocast: Callable[[], AbstractContextManager]) -> list[torch.Tensor | None]:
    """A distillation teacher's logprobs of every micro-batch (all None without one): at rollout.temperature from
    the teacher in this process, as the engine's are; from a served teacher's server (its temperature is 1, which
    config.py requires of the run)."""
    if isinstance(state.teacher, ServedTeacher):
        return state.teacher.grades(batch) if batch.micro_batches else []
    return batch_logprobs(state.teacher, batch, cfg.trainer.logprob_chunk_tokens, cfg.rollout.temperature, autocast)


def renormalize_without_rejected(batch: TrainBatch, cfg: TrainConfig, dist: Dist) -> None:
    """seq_mask: the samples it rejects leave the loss entirely, the normalizer included. The loss makes the
    same decision from the same old logprobs (grpo.seq_mask_keep); here each minibatch's normalizer is
    recomputed over the samples every rank keeps."""
    params = loss_params(cfg)
    rejected = []
    for mb in batch.micro_batches:
        kept = grpo.seq_mask_keep(mb.old_logprobs, mb.sampling_logprobs, mb.mask, params)[:, 0].tolist()  # [b]
        rejected += [j for j, keep in zip(mb.rows, kept) if not keep]
    rejected_everywhere = {j for part in dist.gather(rejected) for j in part}
    for part in batch.minibatches:
        part.normalizer = minibatch_normalizer([batch.loss_masks[j] for j in part.rows
                                                if j not in rejected_everywhere], cfg.trainer.loss, params)


def kl_into_advantages(batch: TrainBatch, groups: Groups, cfg: TrainConfig, dist: Dist) -> dict[str, float]:
    """`trainer.kl_in_reward`: r_i <- r_i - kl_coef * sum_t KL_it (the policy before the update vs the
    reference, `trainer.kl_estimator`), then the advantages of the kept groups again. A completion
    left out of the loss (mask_truncated) keeps its reward. Returns the mean penalty."""
    import torch

    kept = groups.kept()
    penalty = torch.zeros(len(kept), groups.group_size)  # [P', G]
    for mb in batch.micro_batches:
        kl = grpo.KL_ESTIMATORS[cfg.trainer.kl_estimator](mb.old_logprobs, mb.ref_logprobs)  # [b, Tc]
        per_seq = (kl * mb.mask).sum(-1).cpu()  # [b]
        for i, j in enumerate(mb.rows):
            penalty[batch.group_of[j]] = per_seq[i]
    if dist.world_size > 1:  # each rank filled in its share of the groups: the sum is every penalty
        penalty = torch.tensor(dist.sum(penalty.flatten().tolist()), dtype=penalty.dtype).view(penalty.shape)
    reward = groups.reward[kept].cpu() - cfg.trainer.kl_coef * penalty  # [P', G]
    advantage_fn = grpo.ADVANTAGES[cfg.trainer.advantage]
    dropped = groups.dropped[kept].cpu()  # [P', G]
    if bool(dropped.any()):  # as in collect.score_groups: out of the group statistics
        advantages = grpo.masked_advantages(advantage_fn, reward, ~dropped)  # [P', G]
    else:
        advantages = advantage_fn(reward)  # [P', G]
    for mb in batch.micro_batches:
        if not mb.rows:  # an empty pass (a rank with fewer groups, batch.py): nothing to re-weigh
            continue
        rows = torch.tensor([list(batch.group_of[j]) for j in mb.rows])  # [b, 2]
        mb.advantages = advantages[rows[:, 0], rows[:, 1]].to(mb.mask.device)[:, None]  # [b, 1]
    return {"reward/kl_penalty": float(cfg.trainer.kl_coef * penalty.mean())}


class DeviceSums:
    """The update's running sums, kept on the device in float64 so that the loop never waits for the device
    inside a step (one read in `update`, at its end): each loss stat (a token mean) x its tokens and the
    tokens, added in micro-batch order as the Python sums before them did (so the totals are the same
    floats), and the train/inference mismatch of the first epoch with its token count."""

    def __init__(self) -> None:
        self.names: tuple[str, ...] | None = None
        self.stats: torch.Tensor | None = None  # [n] each stat x tokens, then tokens
        self.mismatch: torch.Tensor | None = None  # [2] |logprob difference| summed, and its tokens

    def add_stats(self, stats: grpo.LossStats) -> None:
        import torch

        values = stats.tensor.detach().double()  # [n] token means, then tokens
        weighted = torch.cat([values[:-1] * values[-1], values[-1:]])  # [n]
        self.names = stats.names
        self.stats = weighted if self.stats is None else self.stats + weighted

    def add_mismatch(self, abs_diff_sum: torch.Tensor, tokens: torch.Tensor) -> None:
        import torch

        pair = torch.stack([abs_diff_sum.detach().double(), tokens.detach().double()])  # [2]
        self.mismatch = pair if self.mismatch is None else self.mismatch + pair

    def read(self) -> tuple[dict[str, float], float, float]:
        """(stat sums by name with "tokens", mismatch sum, mismatch tokens), read from the device once."""
        import torch

        parts = [t for t in (self.stats, self.mismatch) if t is not None]
        values = torch.cat(parts).tolist() if parts else []
        n = len(self.names) if self.stats is not None else 0
        mismatch = values[n:] if self.mismatch is not None else [0.0, 0.0]
        return dict(zip(self.names or (), values[:n])), mismatch[0], mismatch[1]


def minibatch_step(state: RunState, part: Minibatch, params: LossParams, cfg: TrainConfig,
                   sums: DeviceSums, first_epoch: bool) -> tuple[float, float, bool]:
    """One optimizer step on one minibatch: the loss summed over its micro-batches, clipped gradient,
    AdamW (skipped when the loss or gradient is not finite on some rank), lr schedule. Adds the loss's
    stats (and in the first epoch the train/inference mismatch) into `sums` on the device; returns loss,
    grad norm and finite, read from the device once (the step's only wait for it)."""
    import torch

    t_cfg, policy, optimizer, dist = cfg.trainer, state.policy, state.optimizer, state.dist
    loss_fn = grpo.LOSSES[t_cfg.loss]
    optimizer.zero_grad(set_to_none=True)
    loss_total = torch.zeros((), dtype=torch.float64, device=dist.device)  # on the device: no sync per micro-batch
    with dist.autocast(cfg.model.dtype):  # forward passes in the compute dtype; logprobs and loss in float32
        prompts = run_pass(policy, passes.prompt_states, part.prompt_ids, part.prompt_mask,
                           part.prompt_pixels)  # autograd: backward at the end
    leaves = passes.prompt_leaves(prompts)  # collect the prompts' gradient over the micro-batches
    for mb in part.micro_batches:
        with dist.autocast(cfg.model.dtype):
            logps, entropy = run_pass(
                policy, passes.completion_logprobs, leaves, mb.prompt_index, mb.ids, mb.attended, t_cfg.logprob_chunk_tokens,
                temperature=cfg.rollout.temperature,
                entropy="grad" if params.entropy_coef > 0 else "detached")  # [b, Tc] x 2
        inputs = grpo.LossInputs(logps, mb.mask, mb.advantages, old_logprobs=mb.old_logprobs,
                                 ref_logprobs=mb.ref_logprobs, sampling_logprobs=mb.sampling_logprobs,
                                 normalizer=part.normalizer, entropy=entropy, teacher_logprobs=mb.teacher_logprobs)
        loss, stats = loss_fn(inputs, params)
        loss.backward()
        loss_total = loss_total + loss.detach().double()
        sums.add_stats(stats)
        if first_epoch:  # train/inference mismatch: the engine's sampling logprobs vs the trainer's, same tokens, on
            # the samples that brought them back (the others' are NaN: rollout.training_sampling)
            known = mb.mask.bool() & ~mb.sampling_logprobs.isnan()  # [b, Tc]
            diff = torch.where(known, logps.detach() - mb.sampling_logprobs, 0.0).abs()  # [b, Tc]
            sums.add_mismatch(diff.sum(), known.sum())
    passes.prompt_backward(prompts, leaves)  # the prompts' share of the gradient
    reshard_all(policy)  # FSDP (world size > 1): sharded parameters and gradients for the clip and the step
    norm = grad_norm_tensor(torch.nn.utils.clip_grad_norm_(policy.parameters(), t_cfg.max_grad_norm))
    loss_value, grad_norm = torch.stack([loss_total, norm.double().to(loss_total.device)]).tolist()  # one sync
    finite = dist.all(math.isfinite(grad_norm) and math.isfinite(loss_value))
    if finite:  # skip a non-finite update: one bad batch must not poison the weights
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    state.scheduler.step()
    return loss_value, grad_norm, finite


def update(state: RunState, batch: TrainBatch, params: LossParams, cfg: TrainConfig) -> dict[str, Any]:
    """`trainer.ppo_epochs` passes over the batch, each `trainer.minibatches` optimizer steps.

    Returns the step's stats: loss (mean over optimizer steps); the loss's own stats as token
    means over every pass (kl, clip_frac, ratio, entropy, ...); the train/inference mismatch of
    the first pass; grad_norm (mean over the steps taken, None when all were skipped) and
    skipped_nonfinite (optimizer steps skipped).
    """
    device_sums = DeviceSums()  # each loss stat x tokens, tokens, and the mismatch: read once, below
    losses, norms, skipped = [], [], 0
    for epoch in range(cfg.trainer.ppo_epochs):
        for part in batch.minibatches:
            loss, grad_norm, finite = minibatch_step(state, part, params, cfg, device_sums, first_epoch=epoch == 0)
            losses.append(loss)
            norms += [grad_norm] if finite else []
            skipped += int(not finite)
    sums, mismatch_sum, mismatch_tokens = device_sums.read()
    # the passes' completions (every epoch's): a token-mean stat x tokens / this is its mean per sequence
    sums["sequences"] = float(cfg.trainer.ppo_epochs * sum(len(mb.rows) for mb in batch.micro_batches))
    if not batch.minibatches:  # nothing kept: the schedule still advances by the steps it would have taken
        state.optimizer.zero_grad(set_to_none=True)
        for _ in range(cfg.trainer.ppo_epochs * cfg.trainer.minibatches):
            state.scheduler.step()
    dist = state.dist
    if dist.world_size > 1:  # this rank's share of each sum -> the step's (every rank ran the same passes)
        keys = sorted(sums)
        totals = dist.sum([*losses, mismatch_sum, mismatch_tokens, *(sums[k] for k in keys)])
        losses, (mismatch_sum, mismatch_tokens) = totals[:len(losses)], totals[len(losses):len(losses) + 2]
        sums = dict(zip(keys, totals[len(losses) + 2:]))
    tokens, sequences = sums.pop("tokens", 0.0), sums.pop("sequences")
    means = {key: value / max(tokens, 1.0) for key, value in sums.items()}
    if "distill/reverse_kl" in sums:  # summed over each sequence's tokens, then averaged over the sequences
        means["distill/reverse_kl_per_seq"] = sums["distill/reverse_kl"] / max(sequences, 1.0)
    return {"loss": sum(losses) / len(losses) if losses else 0.0, **means,
            "grad_norm": sum(norms) / len(norms) if norms else None,
            "skipped_nonfinite": skipped, "mismatch/mean_abs_logprob": mismatch_sum / mismatch_tokens if mismatch_tokens else None,
            # how many tokens the metric read: 0 when every group that brought logprobs back left the loss
            "mismatch/tokens": int(mismatch_tokens)}
