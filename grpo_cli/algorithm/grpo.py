"""The GRPO math: small pure tensor functions, the part a reader compares with the papers.

Shapes: P prompts, G completions per prompt (the group), B = P*G rows (row p*G + g is
completion g of prompt p, so `advantages.reshape(-1)` lines up with the batch), T token
positions. Nothing here runs a model: the logprobs come from grpo_cli/algorithm/passes.py.

One training step, in these functions:

    rewards = round_rewards(rewards, decimals)                    # [P, G]
    all_correct, all_wrong = zero_variance_groups(rewards)        # [P], [P]
    advantages = ADVANTAGES[name](rewards)                        # [P, G]
    norm = NORMALIZERS[name](completion_mask, params)             # full batch, once
    loss, stats = LOSSES[name](LossInputs(logprobs, completion_mask, advantages.reshape(-1),
                                          ref_logprobs=ref_logprobs, normalizer=norm),
                               LossParams(clip_eps, clip_eps_high, kl_coef))
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import NamedTuple

import torch

# ---------------------------------------------------------------------------- rewards -> advantages


def round_rewards(rewards: torch.Tensor, decimals: int | None) -> torch.Tensor:
    """Round graded rewards before normalising, so 0.51 vs 0.50 stops being a signal; None = unchanged."""
    if decimals is None:
        return rewards  # [P, G] unchanged
    return torch.round(rewards.float(), decimals=decimals)  # [P, G]


def group_advantages(rewards: torch.Tensor, scale_by_std: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """Group-relative advantages: `(r - mean) / (std + eps)` over the last dim (the group).

    `rewards` is `[P, G]` (any `[..., G]` works). The std is the population std
    (correction=0), as in the GRPO paper. `scale_by_std=False` is Dr. GRPO: `r - mean`.
    A group whose rewards are all equal gets exact zeros (no float residue from the mean).
    """
    r = rewards if rewards.is_floating_point() else rewards.float()  # [P, G]
    mean = r.mean(dim=-1, keepdim=True)  # [P, 1]
    all_equal = r.amax(dim=-1, keepdim=True) == r.amin(dim=-1, keepdim=True)  # [P, 1]
    centered = torch.where(all_equal, torch.zeros_like(r), r - mean)  # [P, G]
    if not scale_by_std:
        return centered  # [P, G]
    std = r.std(dim=-1, keepdim=True, correction=0)  # [P, 1]
    return centered / (std + eps)  # [P, G]


def group_std_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """GRPO (Shao et al. 2024): `A_i = (r_i - mean(r)) / (std(r) + eps)` within each group `[P, G]`."""
    return group_advantages(rewards, scale_by_std=True)  # [P, G]


def group_mean_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """Dr. GRPO (Liu et al. 2025): `A_i = r_i - mean(r)`, no std, so easy and hard groups keep their scale."""
    return group_advantages(rewards, scale_by_std=False)  # [P, G]


def batch_std_advantages(rewards: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Group mean as the baseline, the std of the RAW rewards over the whole batch as the scale:
    `A_i = (r_i - mean_group(r)) / (std_batch(r) + eps)`, TRL's `scale_rewards="batch"` (TRL takes the
    sample std, n - 1; this is the population std, as in `group_std`). One scale for every group, so a
    nearly-solved group's tiny spread is not blown up to unit size."""
    centered = group_advantages(rewards, scale_by_std=False)  # [P, G]
    std = rewards.float().std(correction=0) if rewards.numel() > 1 else rewards.new_zeros(())  # scalar, all P*G
    return centered / (std + eps)  # [P, G]


def reinforce_pp_baseline_advantages(rewards: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """REINFORCE++-baseline (Hu et al. 2025, arXiv 2501.03262): the group mean as the baseline, then the
    batch std of the GROUP-CENTRED rewards as the scale: `c_i = r_i - mean_group(r)`, `A_i = c_i /
    (std_batch(c) + eps)`. The c_i of a batch have mean 0, so this is whitening over the batch's samples.
    verl whitens over tokens instead (each sample weighs by its length); this weighs every sample once."""
    centered = group_advantages(rewards, scale_by_std=False)  # [P, G]
    std = centered.std(correction=0) if centered.numel() > 1 else centered.new_zeros(())  # scalar, all P*G
    return centered / (std + eps)  # [P, G]


def rloo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024): each sample's baseline is the mean of the OTHER G-1 samples,
    `A_i = r_i - 1/(G-1) sum_{j != i} r_j = G/(G-1) (r_i - mean(r))`. A group of one has no baseline: zeros."""
    G = rewards.shape[-1]
    centered = group_advantages(rewards, scale_by_std=False)  # [P, G]
    return centered * (G / (G - 1)) if G > 1 else torch.zeros_like(centered)  # [P, G]


# trainer.advantage picks one by name. Every one gives exact zeros to a group whose rewards are all equal.
ADVANTAGES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "group_std": group_std_advantages, "group_mean": group_mean_advantages,
    "batch_std": batch_std_advantages, "reinforce_pp_baseline": reinforce_pp_baseline_advantages,
    "rloo": rloo_advantages}


def masked_advantages(advantage_fn: Callable[[torch.Tensor], torch.Tensor], rewards: torch.Tensor,
                      valid: torch.Tensor) -> torch.Tensor:
    """Advantages when some samples have no reward (`valid` False: a reward with on_failure=drop failed on
    them): a group with such samples is the group of its valid samples alone (its mean, std, G), and
    the invalid samples get exactly 0. Groups without any are as `advantage_fn` gives them, with the
    invalid samples' rewards filled by their group's valid mean first (so batch-level statistics see
    no made-up spread); a group whose every sample is invalid gets zeros."""
    r = rewards.float()  # [P, G]
    v = valid.float()  # [P, G]
    count = v.sum(-1, keepdim=True)  # [P, 1]
    group_mean = (r * v).sum(-1, keepdim=True) / count.clamp(min=1)  # [P, 1]
    out = advantage_fn(torch.where(valid, r, group_mean))  # [P, G]
    for p in (~valid).any(-1).nonzero().flatten().tolist():
        out[p] = 0.0
        if valid[p].sum() > 0:
            out[p, valid[p]] = advantage_fn(r[p, valid[p]][None, :])[0]  # [G_valid]
    return out  # [P, G]


def zero_variance_groups(rewards: torch.Tensor, correct: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Groups with no learning signal (every reward equal), split in two.

    Returns `(all_correct, all_wrong)`, bool masks `[P]`. A zero-variance group is
    "all_correct" when its samples are correct and "all_wrong" otherwise. Correct
    means `correct > 0` for every sample when the correctness scores `[P, G]` are
    given (a summed reward mixes in e.g. a format bonus: every answer wrong but
    well formatted still scores > 0), else a common reward > 0.
    Equality is exact: round graded rewards first (`round_rewards`) if needed.
    """
    all_equal = rewards.amax(dim=-1) == rewards.amin(dim=-1)  # [P]
    basis = rewards if correct is None else correct  # [P, G]
    positive = basis.amin(dim=-1) > 0  # [P]
    return all_equal & positive, all_equal & ~positive  # [P], [P]


# ---------------------------------------------------------------------------- per-token terms


def clipped_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, clip_eps: float = 0.2, clip_eps_high: float | None = None
) -> torch.Tensor:
    """PPO's clipped objective, elementwise: `min(ratio*A, clip(ratio, 1-clip_eps, 1+clip_eps_high)*A)`.

    `clip_eps_high=None` means `clip_eps` (symmetric); a larger value is DAPO's clip-higher.
    `advantages` broadcasts: `[B, 1]` against a `[B, T]` ratio.
    """
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    unclipped = ratio * advantages  # [B, T]
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + eps_high) * advantages  # [B, T]
    return torch.minimum(unclipped, clipped)  # [B, T]


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(policy || ref) per token: `exp(d) - d - 1`, d = ref - logp.

    Unbiased for samples drawn from the policy and never negative (`e^d >= 1 + d`); the
    clamp only removes float round-off below zero.
    """
    d = ref_logprobs - logprobs  # [B, T]
    return torch.clamp(torch.exp(d) - d - 1.0, min=0.0)  # [B, T]


def kl_k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k1 per token: `logp - ref` (Schulman 2020). Unbiased for KL(policy || ref), but one sample can be
    negative; its gradient in the loss is that of the policy's log-likelihood, not of the KL."""
    return logprobs - ref_logprobs  # [B, T]


def kl_k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k2 per token: `(logp - ref)^2 / 2`. Biased, never negative; its gradient is the true KL's
    gradient in expectation (the estimator verl calls `mse`)."""
    return 0.5 * (logprobs - ref_logprobs) ** 2  # [B, T]


# trainer.kl_estimator picks one by name: (logprobs [B, T], ref_logprobs [B, T]) -> per-token KL [B, T].
KL_ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


# ---------------------------------------------------------------------------- the loss
#
# A loss is four independent choices, each a small table of named functions:
#   POLICY_TERMS   the ratio and its clipped objective per token (ppo_clip, gspo), with an optional dual clip
#   KL_ESTIMATORS  the per-token KL to the reference (k1, k2, k3)
#   CORRECTIONS    weights for the gap between the rollout engine and the trainer (none, tis, seq_mask)
#   OBJECTIVES     a token's advantage: the group's, a teacher's per-token grade, or both (grpo, distill, grpo+distill)
#   LOSSES         how per-token terms become one number (grpo, token_mean, dr_grpo), with NORMALIZERS
# `_per_token_terms` looks each one up by the name in `LossParams`; nothing branches on combinations.


class LossInputs(NamedTuple):
    """What a loss reads for one (micro-)batch of b completions; a new term adds a field here,
    not a parameter to every loss. Fields a loss does not use may be None."""

    logprobs: torch.Tensor  # [b, T] the policy's, with autograd
    mask: torch.Tensor  # [b, T] 1 on completion tokens, 0 on padding
    advantages: torch.Tensor  # [b] or [b, 1] one per sequence, shared by its tokens
    old_logprobs: torch.Tensor | None = None  # [b, T] the policy that sampled the batch; None = logprobs.detach()
    ref_logprobs: torch.Tensor | None = None  # [b, T] the frozen reference's; None only when kl_coef == 0
    sampling_logprobs: torch.Tensor | None = None  # [b, T] the rollout engine's at sampling time (corrections)
    normalizer: float | None = None  # what the summed loss is divided by: the FULL batch's NORMALIZERS[name]
    #   when this is a micro-batch; None = this batch's own
    entropy: torch.Tensor | None = None  # [b, T] the policy's token entropy (from the same chunked logits)
    teacher_logprobs: torch.Tensor | None = None  # [b, T] a distillation teacher's (OBJECTIVES other than grpo)


class LossParams(NamedTuple):
    """The loss's choices and hyperparameters (trainer.* keys of the same names)."""

    clip_eps: float = 0.2  # ratio >= 1 - clip_eps
    clip_eps_high: float | None = None  # ratio <= 1 + clip_eps_high; None = clip_eps (symmetric)
    kl_coef: float = 0.0  # weight of the KL to the reference in the loss
    policy_loss: str = "ppo_clip"  # POLICY_TERMS: ppo_clip | gspo
    clip_ratio_c: float | None = None  # dual clip: bound -A * ratio at -A * c for A < 0 (c > 1); None = off
    kl_estimator: str = "k3"  # KL_ESTIMATORS: k1 | k2 | k3
    correction: str = "none"  # CORRECTIONS: none | tis | seq_mask
    tis_cap: float = 2.0  # tis: importance weights are capped at this C
    seq_mask_low: float = 0.5  # seq_mask: sequences whose geometric-mean ratio falls below this leave the loss...
    seq_mask_high: float = 2.0  # ...or rises above this
    entropy_coef: float = 0.0  # weight of an entropy bonus (needs LossInputs.entropy when > 0)
    max_new_tokens: int | None = None  # dr_grpo: the constant each sequence's token sum is divided by (required there)
    objective: str = "grpo"  # OBJECTIVES: grpo | distill | grpo+distill
    distill_coef: float = 1.0  # distill, grpo+distill: weight of the per-token reverse KL to the teacher


DEFAULT_PARAMS = LossParams()  # symmetric clip at 0.2, no KL


# -- policy terms: (logprobs, old, advantages [B, 1], mask, params) -> ratio [B, T], objective [B, T], clipped [B, T]


def _clip_stats(ratio: torch.Tensor, adv: torch.Tensor, params: LossParams) -> torch.Tensor:
    eps_high = params.clip_eps if params.clip_eps_high is None else params.clip_eps_high
    with torch.no_grad():
        return ((ratio > 1 + eps_high) & (adv > 0)) | ((ratio < 1 - params.clip_eps) & (adv < 0))  # [B, T]


def ppo_clip_term(logprobs, old, adv, mask, params):
    """PPO's token-level ratio `r_t = exp(logp_t - old_t)` and `min(r_t A, clip(r_t, 1-eps, 1+eps_high) A)`."""
    ratio = torch.exp(logprobs - old)  # [B, T]
    objective = clipped_surrogate(ratio, adv, params.clip_eps, params.clip_eps_high)  # [B, T]
    return ratio, objective, _clip_stats(ratio, adv, params)


def gspo_term(logprobs, old, adv, mask, params):
    """GSPO (Zheng et al. 2025): one ratio per sequence, the geometric mean of its token ratios,

        s_i = exp(1/|o_i| sum_t (logp_it - old_it)),   objective_i = min(s_i A_i, clip(s_i, 1-eps, 1+eps_high) A_i),

    clipped per sequence. Written per token as `s_it = sg[s_i] * exp(logp_it - sg[logp_it])`: every
    token's value is s_i and the token mean of the objective has the gradient of the sequence's. The
    paper's clip range is far smaller than PPO's (3e-4 / 4e-4): set trainer.clip_eps accordingly.
    """
    m = mask.to(logprobs.dtype)  # [B, T]
    log_seq = ((logprobs - old) * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1)  # [B, 1]
    ratio = torch.exp(log_seq.detach() + logprobs - logprobs.detach())  # [B, T]: value s_i, gradient per token
    objective = clipped_surrogate(ratio, adv, params.clip_eps, params.clip_eps_high)  # [B, T]
    return ratio, objective, _clip_stats(ratio, adv, params)


# trainer.policy_loss picks one by name.
POLICY_TERMS = {"ppo_clip": ppo_clip_term, "gspo": gspo_term}


def dual_clip(objective: torch.Tensor, ratio: torch.Tensor, adv: torch.Tensor, clip_ratio_c: float) -> torch.Tensor:
    """Dual-clip PPO (Ye et al. 2020): for A < 0 the clipped objective `min(rA, clip(r)A)` falls without
    bound as r grows; bound it below at `c * A` (c > 1): `max(min(rA, clip(r)A), cA)`."""
    return torch.where(adv < 0, torch.maximum(objective, clip_ratio_c * adv), objective)  # [B, T]


# -- mismatch corrections: (old [B, T], sampling [B, T], mask, params) -> (policy weights [B, T] | None,
#    kept samples [B, 1] | None), both detached. A weight scales a token's policy term; a sample that is
#    not kept leaves the loss entirely (its policy, KL and entropy terms, and the normalizer).


def no_correction(old, sampling, mask, params):
    """Trust the engine's samples as the trainer's own: no weights, every sample kept."""
    return None, None


def tis_correction(old, sampling, mask, params):
    """Truncated importance sampling (Yao et al. 2025) against the rollout engine: each token's policy
    term weighs `min(exp(old_t - sampling_t), C)`, the trainer's probability of the sampled token over
    the engine's, capped at C = tis_cap. The KL and entropy terms are not reweighted."""
    with torch.no_grad():
        return torch.clamp(torch.exp(old - sampling), max=params.tis_cap), None  # [B, T], None


def seq_mask_keep(old: torch.Tensor, sampling: torch.Tensor, mask: torch.Tensor, params: LossParams) -> torch.Tensor:
    """Which samples a sequence-level rejection keeps: those whose geometric-mean ratio trainer/engine
    `exp(1/|o| sum_t (old_t - sampling_t))` lies in [seq_mask_low, seq_mask_high]. The loop calls it
    before the update too, to leave the rejected samples out of the minibatch's normalizer."""
    with torch.no_grad():
        m = mask.to(old.dtype)  # [B, T]
        log_ratio = ((old - sampling) * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1)  # [B, 1]
        ratio = torch.exp(log_ratio)  # [B, 1]
        return (ratio >= params.seq_mask_low) & (ratio <= params.seq_mask_high)  # [B, 1]


def seq_mask_correction(old, sampling, mask, params):
    """Sequence-level rejection sampling (verl's rollout rejection at the sequence level): a sample whose
    geometric-mean ratio leaves [seq_mask_low, seq_mask_high] leaves the loss; the rest weigh 1."""
    return None, seq_mask_keep(old, sampling, mask, params)  # None, [B, 1]


# trainer.mismatch_correction picks one by name.
CORRECTIONS = {"none": no_correction, "tis": tis_correction, "seq_mask": seq_mask_correction}


# -- objectives: (group advantages [B, 1], reverse KL to the teacher [B, T] or None, params) -> advantages [B, 1 or T].
# On-policy distillation (Agarwal et al. 2024, "On-Policy Distillation of Language Models"; Thinking Machines,
# "On-Policy Distillation", 2025): the student samples, a frozen teacher scores each sampled token, and the
# token's advantage is minus the reverse KL's per-token sample, -(log pi_student(x_t) - log pi_teacher(x_t)),
# taken under the policy that sampled (no gradient through it) and not discounted.


def grpo_objective(adv: torch.Tensor, reverse_kl: torch.Tensor | None, params: LossParams) -> torch.Tensor:
    """GRPO alone: every token of a sample shares its group-relative advantage."""
    return adv  # [B, 1]


def distill_objective(adv: torch.Tensor, reverse_kl: torch.Tensor | None, params: LossParams) -> torch.Tensor:
    """Pure distillation: `A_t = -coef * (log pi_student(x_t) - log pi_teacher(x_t))`; the rewards do not train."""
    return -params.distill_coef * reverse_kl  # [B, T]


def grpo_distill_objective(adv: torch.Tensor, reverse_kl: torch.Tensor | None, params: LossParams) -> torch.Tensor:
    """GRPO + distillation: the group advantage plus the teacher's per-token one, `A_i - coef * KL_t`."""
    return adv - params.distill_coef * reverse_kl  # [B, T]


# distill.objective picks one by name (plain grpo without a teacher).
OBJECTIVES = {"grpo": grpo_objective, "distill": distill_objective, "grpo+distill": grpo_distill_objective}


def _per_token_terms(batch: LossInputs, params: LossParams):
    """Shared by every aggregation: the per-token loss, the mask of the tokens in the loss, and the
    statistics of one (micro-)batch.

    per token: `-(w * policy_objective - kl_coef * KL + entropy_coef * H)`, w the correction's weight,
    on the completion tokens of the samples the correction keeps. The statistics are token means over
    every completion token of the batch, rejected samples included (they measure the batch).
    """
    logprobs, ref_logprobs, kl_coef = batch.logprobs, batch.ref_logprobs, params.kl_coef
    if ref_logprobs is None and kl_coef != 0:
        raise ValueError(f"kl_coef={kl_coef} needs ref_logprobs; pass them or set kl_coef=0")
    completion = batch.mask.bool()  # [B, T]
    old = logprobs.detach() if batch.old_logprobs is None else batch.old_logprobs  # [B, T]
    reverse_kl = None if batch.teacher_logprobs is None else old - batch.teacher_logprobs  # [B, T] under the sampler
    if params.objective != "grpo" and reverse_kl is None:
        raise ValueError(f"objective={params.objective} needs teacher_logprobs")
    adv = OBJECTIVES[params.objective](batch.advantages.reshape(-1, 1).to(logprobs.dtype), reverse_kl, params)  # [B, 1|T]
    ratio, objective, is_clipped = POLICY_TERMS[params.policy_loss](logprobs, old, adv, completion, params)  # [B, T] x 3
    if params.clip_ratio_c is not None:
        objective = dual_clip(objective, ratio, adv, params.clip_ratio_c)  # [B, T]
    if params.correction != "none" and batch.sampling_logprobs is None:
        raise ValueError(f"correction={params.correction} needs sampling_logprobs")
    weight, kept = CORRECTIONS[params.correction](old, batch.sampling_logprobs, completion, params)  # [B, T], [B, 1]
    if weight is not None:
        objective = weight * objective  # [B, T]
    mask = completion if kept is None else completion & kept  # [B, T] the tokens in the loss
    kl = KL_ESTIMATORS[params.kl_estimator](logprobs, ref_logprobs) if ref_logprobs is not None \
        else torch.zeros_like(logprobs)  # [B, T]
    inner = objective - kl_coef * kl  # [B, T]
    if params.entropy_coef:
        if batch.entropy is None:
            raise ValueError(f"entropy_coef={params.entropy_coef} needs LossInputs.entropy")
        inner = inner + params.entropy_coef * batch.entropy  # [B, T]
    per_token = torch.where(mask, -inner, 0.0)  # [B, T]

    names, terms = ["kl", "clip_frac", "ratio", "surrogate"], [kl, is_clipped.to(kl.dtype), ratio, objective]
    if batch.entropy is not None:
        names, terms = names + ["entropy"], terms + [batch.entropy]
    if weight is not None:
        names, terms = names + ["correction/weight"], terms + [weight]
    if kept is not None:
        names, terms = names + ["correction/masked_frac"], terms + [(~kept).to(kl.dtype).expand_as(kl)]
    if reverse_kl is not None:
        names, terms = names + ["distill/reverse_kl"], terms + [reverse_kl]
    with torch.no_grad():
        tokens = completion.sum()  # scalar: completion tokens in this batch
        stacked = torch.stack([t.detach() for t in terms])  # [n, B, T]
        means = torch.where(completion, stacked, 0.0).sum(dim=(1, 2)) / tokens.clamp(min=1)  # [n]
        values = torch.cat([means, tokens.reshape(1).to(means.dtype)])  # [n + 1], left on the device
    return per_token, mask, LossStats((*names, "tokens"), values)  # [B, T], [B, T]


class LossStats(Mapping):
    """A loss's stats by name, held as one device tensor `tensor` [n] (no host sync when the loss runs: the
    update adds them up on the device and reads them once per step); reading one by name syncs."""

    def __init__(self, names: tuple[str, ...], tensor: torch.Tensor) -> None:
        self.names, self.tensor = names, tensor

    def __getitem__(self, name: str) -> float:
        if name not in self.names:
            raise KeyError(name)
        return float(self.tensor[self.names.index(name)])

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


# -- aggregations: how the per-token loss [B, T] becomes one number


def grpo_loss(batch: LossInputs, params: LossParams = DEFAULT_PARAMS) -> tuple[torch.Tensor, LossStats]:
    """GRPO's aggregation: the per-token loss averaged over each sequence's completion tokens, then
    over sequences:

        L = -1/N sum_i 1/|o_i| sum_t [min(r_it A_i, clip(r_it, 1-eps, 1+eps_high) A_i) - kl_coef KL_it]

    with `r = exp(logprobs - old_logprobs)` (for ppo_clip); `old_logprobs=None` means
    `logprobs.detach()` (one update per rollout batch: the ratio is 1 but carries the gradient of logp).

    Why this aggregation: it is the GRPO paper's `1/G sum_i 1/|o_i| sum_t`, so every
    answer weighs the same whatever its length. The known side effect: a token of a short
    answer weighs more than one of a long answer, so wrong answers are pushed down less
    per token when they are long (a length bias). `token_mean_loss` (DAPO) weighs every
    token equally; `dr_grpo_loss` divides by a constant instead.

    N is `batch.normalizer`; default: the sequences here that are in the loss (with at least one
    completion token and not rejected by the correction). For micro-batches pass the FULL batch's
    `NORMALIZERS["grpo"](full_mask, params)` (its number of sequences in the loss) to each
    micro-batch and sum (backward) the micro-batch losses as they are; equivalently, with the
    default, scale each micro-batch loss by `micro_seqs / total_seqs`.

    Returns the scalar loss and its `LossStats`: every key but `tokens` is a token mean over this
    batch's completion tokens (kl, clip_frac, ratio, surrogate; entropy and correction/* when
    present; rejected samples included); `tokens` is their count, the weight that merges micro-batches'
    means into the batch's.
    """
    per_token, mask, stats = _per_token_terms(batch, params)  # [B, T], [B, T]
    per_sequence = per_token.sum(-1) / mask.sum(-1).clamp(min=1)  # [B]
    denom = grpo_normalizer(mask, params) if batch.normalizer is None else batch.normalizer
    return per_sequence.sum() / denom, stats  # scalar


def token_mean_loss(batch: LossInputs, params: LossParams = DEFAULT_PARAMS) -> tuple[torch.Tensor, LossStats]:
    """DAPO's token-level aggregation (Yu et al. 2025): the same per-token terms as `grpo_loss`,
    averaged over all completion tokens of the batch, so long answers weigh in proportion to their length:

        L = -1/N sum_i sum_t [min(r_it A_i, clip(r_it, 1-eps, 1+eps_high) A_i) - kl_coef KL_it]

    N is `batch.normalizer`; default: the completion tokens in the loss here. For micro-batches pass
    the FULL batch's `NORMALIZERS["token_mean"](full_mask, params)` (its number of completion tokens)
    and sum the micro-batch losses. Stats as in `grpo_loss`.
    """
    per_token, mask, stats = _per_token_terms(batch, params)  # [B, T], [B, T]
    denom = token_mean_normalizer(mask, params) if batch.normalizer is None else batch.normalizer
    return per_token.sum() / denom, stats  # scalar


def dr_grpo_loss(batch: LossInputs, params: LossParams = DEFAULT_PARAMS) -> tuple[torch.Tensor, LossStats]:
    """Dr. GRPO's aggregation (Liu et al. 2025): each sequence's token SUM divided by one constant
    (`params.max_new_tokens`, the rollout's length cap), then the mean over sequences:

        L = -1/(N L_max) sum_i sum_t [min(r_it A_i, clip(r_it, 1-eps, 1+eps_high) A_i) - kl_coef KL_it]

    No length normalisation per answer, so a long wrong answer is pushed down as hard per token as
    a short one. N L_max is `batch.normalizer` (the FULL batch's for a micro-batch). Stats as in `grpo_loss`.
    """
    per_token, mask, stats = _per_token_terms(batch, params)  # [B, T], [B, T]
    denom = dr_grpo_normalizer(mask, params) if batch.normalizer is None else batch.normalizer
    return per_token.sum() / denom, stats  # scalar


def _sequences(completion_mask: torch.Tensor) -> int:
    """Sequences with at least one token in the loss (at least 1): a rejected sample is not one."""
    return max(int(completion_mask.bool().any(-1).sum().item()), 1)


def grpo_normalizer(completion_mask: torch.Tensor, params: LossParams = DEFAULT_PARAMS) -> float:
    """What `grpo_loss` divides by for this batch: its sequences in the loss."""
    return float(_sequences(completion_mask))


def token_mean_normalizer(completion_mask: torch.Tensor, params: LossParams = DEFAULT_PARAMS) -> float:
    """What `token_mean_loss` divides by for this batch: its completion tokens in the loss (at least 1)."""
    return float(max(int(completion_mask.bool().sum().item()), 1))


def dr_grpo_normalizer(completion_mask: torch.Tensor, params: LossParams = DEFAULT_PARAMS) -> float:
    """What `dr_grpo_loss` divides by for this batch: its sequences in the loss times the constant
    `params.max_new_tokens`, which has no default (a silent 1 would change the loss's scale)."""
    if params.max_new_tokens is None:
        raise ValueError("dr_grpo divides by LossParams.max_new_tokens, the rollout's length cap; pass it")
    return float(_sequences(completion_mask) * params.max_new_tokens)


LossFn = Callable[[LossInputs, LossParams], tuple[torch.Tensor, LossStats]]

# trainer.loss picks one aggregation by name; variants are separate functions, not branches.
LOSSES: dict[str, LossFn] = {"grpo": grpo_loss, "token_mean": token_mean_loss, "dr_grpo": dr_grpo_loss}
# Full-batch normalizer of each loss, computed once from the full batch's completion mask and
# passed to every micro-batch, so the micro-batch losses simply add up to the full-batch loss.
NORMALIZERS: dict[str, Callable[[torch.Tensor, LossParams], float]] = {
    "grpo": grpo_normalizer, "token_mean": token_mean_normalizer, "dr_grpo": dr_grpo_normalizer}
