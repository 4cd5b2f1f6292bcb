"""The loss's axes against hand-computed values and gradients: policy terms (ppo_clip, gspo, dual clip),
aggregations (grpo, token_mean, dr_grpo), KL estimators, advantages, mismatch corrections, entropy,
distillation objectives;
and the update stage with several epochs and minibatches (tier 1: CPU, seconds)."""

from __future__ import annotations

import math

import pytest
import torch

from grpo_cli import config as schema
from grpo_cli.algorithm import grpo, passes
from grpo_cli.algorithm.grpo import LOSSES, LossInputs, LossParams


def test_config_names_are_the_tables():
    assert schema.LOSS_NAMES == tuple(grpo.LOSSES) == tuple(grpo.NORMALIZERS)
    assert schema.POLICY_LOSS_NAMES == tuple(grpo.POLICY_TERMS)
    assert schema.KL_ESTIMATOR_NAMES == tuple(grpo.KL_ESTIMATORS)
    assert schema.ADVANTAGE_NAMES == tuple(grpo.ADVANTAGES)
    assert schema.CORRECTION_NAMES == tuple(grpo.CORRECTIONS)
    assert schema.OBJECTIVE_NAMES == tuple(grpo.OBJECTIVES)
    with pytest.raises(schema.ConfigError, match=r"^trainer.policy_loss: 'ppo' is not one of ppo_clip, gspo"):
        schema.TrainerConfig(policy_loss="ppo")


# ---------------------------------------------------------------------------- advantages


def test_batch_std_and_rloo_advantages_by_hand():
    rewards = torch.tensor([[1.0, 0.0], [1.0, 1.0]])  # [P=2, G=2]
    std = math.sqrt(0.1875)  # population std of [1, 0, 1, 1]
    torch.testing.assert_close(grpo.batch_std_advantages(rewards), torch.tensor([[0.5 / std, -0.5 / std], [0, 0]]))
    rloo = grpo.rloo_advantages(torch.tensor([[1.0, 0.0, 0.0, 0.0]]))  # r_i - mean of the other three
    torch.testing.assert_close(rloo, torch.tensor([[1.0, -1 / 3, -1 / 3, -1 / 3]]))
    torch.testing.assert_close(grpo.group_mean_advantages(torch.tensor([[3.0, 1.0]])), torch.tensor([[1.0, -1.0]]))


def test_batch_std_and_reinforce_pp_baseline_divide_by_different_stds():
    """Both centre each group on its mean; batch_std divides by the std of the RAW rewards over the batch
    (TRL's scale_rewards="batch"), reinforce_pp_baseline by the std of the GROUP-CENTRED rewards (REINFORCE++-
    baseline). On these rewards the two stds are 0.471 and 0.354."""
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])  # [P=3, G=4]
    centred = rewards - rewards.mean(-1, keepdim=True)  # [P, G]
    raw_std, centred_std = math.sqrt(2 / 9), math.sqrt(0.125)  # 0.471, 0.354
    assert rewards.std(correction=0).item() == pytest.approx(raw_std)
    assert centred.std(correction=0).item() == pytest.approx(centred_std)
    torch.testing.assert_close(grpo.ADVANTAGES["batch_std"](rewards), centred / raw_std)
    torch.testing.assert_close(grpo.ADVANTAGES["reinforce_pp_baseline"](rewards), centred / centred_std)


@pytest.mark.parametrize("name", list(grpo.ADVANTAGES))
def test_every_advantage_gives_exact_zeros_to_equal_groups_and_to_a_group_of_one(name):
    fn = grpo.ADVANTAGES[name]
    assert torch.equal(fn(torch.full((3, 4), 0.7)), torch.zeros(3, 4))
    assert torch.equal(fn(torch.tensor([[0.3], [0.9]])), torch.zeros(2, 1))  # one sample left after filtering


# ---------------------------------------------------------------------------- KL estimators


def test_kl_estimators_by_hand():
    logp, ref = torch.log(torch.tensor([0.5])), torch.log(torch.tensor([0.25]))
    assert grpo.kl_k1(logp, ref).item() == pytest.approx(math.log(2))
    assert grpo.kl_k2(logp, ref).item() == pytest.approx(0.5 * math.log(2) ** 2)
    assert grpo.kl_k3(logp, ref).item() == pytest.approx(0.5 + math.log(2) - 1)  # e^d - d - 1, d = -log 2
    assert grpo.kl_k1(ref, logp).item() < 0 <= grpo.kl_k2(ref, logp).item()  # k1 can go negative, k2 cannot


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_the_loss_uses_the_chosen_estimator(estimator):
    logp = torch.log(torch.tensor([[0.5, 0.4]])).requires_grad_(True)
    ref = torch.log(torch.tensor([[0.25, 0.5]]))
    mask = torch.ones(1, 2)
    loss, stats = grpo.token_mean_loss(LossInputs(logp, mask, torch.zeros(1), ref_logprobs=ref),
                                       LossParams(kl_coef=0.5, kl_estimator=estimator))
    expected = grpo.KL_ESTIMATORS[estimator](logp.detach(), ref)  # [1, 2]
    assert loss.item() == pytest.approx(0.5 * expected.mean().item(), rel=1e-6)  # A = 0: only the KL term
    assert stats["kl"] == pytest.approx(expected.mean().item(), rel=1e-6)


# ---------------------------------------------------------------------------- policy terms


def test_gspo_clips_the_sequence_ratio_by_hand():
    old = torch.zeros(1, 3)
    logp = torch.tensor([[0.3, -0.1, 5.0]], requires_grad=True)  # the third position is padding
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    params = LossParams(clip_eps=0.05, policy_loss="gspo")
    s = math.exp(0.1)  # geometric mean of the token ratios: exp((0.3 - 0.1) / 2)
    loss, stats = grpo.grpo_loss(LossInputs(logp, mask, torch.tensor([1.0]), old_logprobs=old), params)
    assert loss.item() == pytest.approx(-1.05)  # min(s, 1.05) * A with s = 1.105 > 1 + eps: clipped
    assert stats["ratio"] == pytest.approx(s) and stats["clip_frac"] == 1.0
    (grad,) = torch.autograd.grad(loss, logp)
    assert torch.equal(grad, torch.zeros(1, 3))
    loss, stats = grpo.grpo_loss(LossInputs(logp, mask, torch.tensor([-1.0]), old_logprobs=old), params)
    assert loss.item() == pytest.approx(s)  # min(-s, -1.05): the unclipped side, with its gradient
    (grad,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(grad, torch.tensor([[s / 2, s / 2, 0.0]]))  # d s / d logp_t = s / |o|


def test_gspo_matches_the_sequence_objective_in_value_and_gradient():
    g = torch.Generator().manual_seed(3)
    B, T = 4, 6
    logp0 = -torch.rand(B, T, generator=g)
    old = logp0 + 0.2 * torch.randn(B, T, generator=g)
    lengths = torch.tensor([6, 2, 4, 1])
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    adv = torch.tensor([1.0, -0.5, 2.0, -1.0])
    params = LossParams(clip_eps=0.1, clip_eps_high=0.15, policy_loss="gspo")

    lp = logp0.clone().requires_grad_(True)
    ours, _ = grpo.grpo_loss(LossInputs(lp, mask, adv, old_logprobs=old), params)
    (ours_grad,) = torch.autograd.grad(ours, lp)
    lp = logp0.clone().requires_grad_(True)
    s = torch.exp(((lp - old) * mask).sum(-1) / mask.sum(-1))  # [B] sequence ratios
    objective = torch.minimum(s * adv, torch.clamp(s, 0.9, 1.15) * adv)  # [B]
    direct = -objective.mean()
    (direct_grad,) = torch.autograd.grad(direct, lp)
    torch.testing.assert_close(ours, direct)
    torch.testing.assert_close(ours_grad, direct_grad)


def test_dual_clip_bounds_a_negative_advantage_with_a_large_ratio():
    old = torch.zeros(1, 2)
    logp = torch.log(torch.tensor([[5.0, 1.1]])).requires_grad_(True)  # ratios 5 and 1.1
    mask, adv = torch.ones(1, 2), torch.tensor([-1.0])
    plain, _ = grpo.token_mean_loss(LossInputs(logp, mask, adv, old_logprobs=old), LossParams())
    assert plain.item() == pytest.approx((5.0 + 1.1) / 2)  # -min(-r, -clip(r)) per token
    dual, _ = grpo.token_mean_loss(LossInputs(logp, mask, adv, old_logprobs=old), LossParams(clip_ratio_c=3.0))
    assert dual.item() == pytest.approx((3.0 + 1.1) / 2)  # the first token is bounded at -c * A = 3
    (grad,) = torch.autograd.grad(dual, logp)
    assert grad[0, 0] == 0.0 and grad[0, 1] == pytest.approx(1.1 / 2)
    positive, _ = grpo.token_mean_loss(LossInputs(logp, mask, -adv, old_logprobs=old), LossParams(clip_ratio_c=3.0))
    assert positive.item() == pytest.approx(-(1.2 + 1.1) / 2)  # A > 0: unchanged by the dual clip


# ---------------------------------------------------------------------------- aggregations


def test_dr_grpo_divides_token_sums_by_a_constant():
    logp = torch.zeros(2, 3, requires_grad=True)  # ratio 1, no KL
    mask = torch.tensor([[1.0, 0, 0], [1, 1, 1]])
    adv = torch.tensor([1.0, -1.0])
    params = LossParams(max_new_tokens=4)
    loss, _ = grpo.dr_grpo_loss(LossInputs(logp, mask, adv), params)
    assert loss.item() == pytest.approx((-1 + 3) / (2 * 4))
    (grad,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(grad, torch.tensor([[-1 / 8, 0, 0], [1 / 8, 1 / 8, 1 / 8]]))
    assert grpo.NORMALIZERS["dr_grpo"](mask, params) == 8.0


@pytest.mark.parametrize("name", list(LOSSES))
@pytest.mark.parametrize("policy", list(grpo.POLICY_TERMS))
@pytest.mark.parametrize("correction", list(grpo.CORRECTIONS))
def test_every_combination_handles_empty_rows_and_far_ratios(name, policy, correction):
    logp = torch.tensor([[0.0, 0.0], [-9.0, 9.0]], requires_grad=True)  # row 1: ratios e^-9 and e^9
    mask = torch.tensor([[0.0, 0.0], [1.0, 1.0]])  # row 0 has no completion tokens
    inputs = LossInputs(logp, mask, torch.tensor([1.0, -1.0]), old_logprobs=torch.zeros(2, 2),
                        ref_logprobs=torch.zeros(2, 2), sampling_logprobs=torch.zeros(2, 2))
    params = LossParams(kl_coef=0.1, policy_loss=policy, correction=correction, clip_ratio_c=3.0, max_new_tokens=4)
    loss, stats = LOSSES[name](inputs, params)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    assert torch.equal(logp.grad[0], torch.zeros(2))  # the empty row gets no gradient
    assert all(math.isfinite(v) for v in stats.values()) and stats["tokens"] == 2.0


# ---------------------------------------------------------------------------- mismatch corrections


def test_tis_weights_are_capped_importance_ratios():
    old = torch.log(torch.tensor([[0.6, 0.1]]))
    sampling = torch.log(torch.tensor([[0.2, 0.2]]))  # ratios 3 and 0.5
    weights, kept = grpo.tis_correction(old, sampling, torch.ones(1, 2), LossParams(tis_cap=2.0))
    torch.testing.assert_close(weights, torch.tensor([[2.0, 0.5]]))
    assert kept is None  # tis reweighs tokens and removes no sample
    logp = old.clone().requires_grad_(True)
    loss, stats = grpo.token_mean_loss(LossInputs(logp, torch.ones(1, 2), torch.tensor([1.0]),
                                                  sampling_logprobs=sampling), LossParams(correction="tis"))
    assert loss.item() == pytest.approx(-(2.0 + 0.5) / 2)  # ratio 1, each token's term times its weight
    assert stats["correction/weight"] == pytest.approx(1.25) and "correction/masked_frac" not in stats


def test_seq_mask_drops_whole_sequences_outside_the_band():
    old = torch.zeros(3, 2)
    sampling = torch.tensor([[0.1, -0.1], [-1.0, -1.0], [0.0, 2.0]])  # geometric-mean ratios 1, e, e^-1 (row 2: 1 token)
    mask = torch.tensor([[1.0, 1.0], [1.0, 1.0], [0.0, 1.0]])
    params = LossParams(correction="seq_mask", seq_mask_low=0.5, seq_mask_high=2.0)
    weights, kept = grpo.seq_mask_correction(old, sampling, mask, params)
    assert weights is None and kept.tolist() == [[True], [False], [False]]
    _, stats = grpo.grpo_loss(LossInputs(torch.zeros(3, 2, requires_grad=True), mask, torch.ones(3),
                                         sampling_logprobs=sampling), params)
    assert stats["correction/masked_frac"] == pytest.approx(3 / 5)  # tokens of the two rejected samples


@pytest.mark.parametrize("name", list(LOSSES))
def test_seq_mask_removes_a_rejected_sample_from_the_whole_loss(name):
    """A rejected sample leaves the loss entirely: its policy term, its KL and entropy terms, and the
    normalizer. The loss equals the same loss over the accepted samples alone, and the rejected row gets
    no gradient."""
    logp = torch.log(torch.tensor([[0.5, 0.4, 0.3], [0.2, 0.6, 0.5]]))  # [B=2, T=3]
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    ref = logp - 0.3  # a KL term on every token
    sampling = torch.stack([logp[0], logp[1] - 2.0])  # row 1's geometric-mean ratio e^2 > seq_mask_high
    entropy = torch.full((2, 3), 0.7)
    params = LossParams(kl_coef=0.1, entropy_coef=0.01, correction="seq_mask", max_new_tokens=3)
    x = logp.clone().requires_grad_(True)
    loss, stats = LOSSES[name](LossInputs(x, mask, torch.tensor([1.0, -1.0]), ref_logprobs=ref,
                                          sampling_logprobs=sampling, entropy=entropy), params)
    alone, _ = LOSSES[name](LossInputs(logp[:1].clone(), mask[:1], torch.tensor([1.0]), ref_logprobs=ref[:1],
                                       entropy=entropy[:1]), params._replace(correction="none"))
    assert loss.item() == pytest.approx(alone.item())
    loss.backward()
    assert torch.equal(x.grad[1], torch.zeros(3)) and x.grad[0].abs().sum() > 0
    assert stats["correction/masked_frac"] == pytest.approx(3 / 5)  # the rejected sample's 3 of 5 tokens


def test_dr_grpo_without_max_new_tokens_fails_loudly():
    """The horizon has no default: dr_grpo without it would divide by the batch size alone."""
    logp, mask = torch.zeros(2, 3, requires_grad=True), torch.ones(2, 3)
    with pytest.raises(ValueError, match="max_new_tokens"):
        grpo.dr_grpo_loss(LossInputs(logp, mask, torch.ones(2)))
    with pytest.raises(ValueError, match="max_new_tokens"):
        grpo.NORMALIZERS["dr_grpo"](mask, LossParams())


def test_a_correction_without_sampling_logprobs_is_an_error():
    with pytest.raises(ValueError, match="sampling_logprobs"):
        grpo.grpo_loss(LossInputs(torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1)), LossParams(correction="tis"))


# ---------------------------------------------------------------------------- distillation objectives


@pytest.mark.parametrize("name", list(LOSSES))
def test_distillation_gives_each_token_minus_its_reverse_kl_to_the_teacher_as_its_advantage(name):
    """distill: A_t = -coef * (old_t - teacher_t), the group advantages ignored; grpo+distill adds the group's.
    With one update (ratio 1) the loss is minus the aggregated advantages, and a token the teacher likes more
    than the student is pushed up, one it likes less pushed down."""
    logp = torch.log(torch.tensor([[0.5, 0.4, 0.3], [0.2, 0.6, 0.5]]))  # [B=2, T=3] the student's
    teacher = torch.log(torch.tensor([[0.9, 0.1, 0.3], [0.2, 0.9, 0.7]]))  # [B, T]
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    group = torch.tensor([1.0, -1.0])
    reverse_kl = logp - teacher  # [B, T]
    for objective, adv in (("distill", -0.5 * reverse_kl), ("grpo+distill", group[:, None] - 0.5 * reverse_kl)):
        x = logp.clone().requires_grad_(True)
        params = LossParams(objective=objective, distill_coef=0.5, max_new_tokens=3)
        loss, stats = LOSSES[name](LossInputs(x, mask, group, teacher_logprobs=teacher), params)
        by_hand, _ = LOSSES[name](LossInputs(logp.clone(), mask, torch.zeros(2)), params._replace(objective="grpo"))
        expected = {"grpo": -((adv * mask).sum(-1) / mask.sum(-1)).mean(),
                    "token_mean": -(adv * mask).sum() / mask.sum(),
                    "dr_grpo": -(adv * mask).sum() / (2 * 3)}[name]
        assert loss.item() == pytest.approx(expected.item(), rel=1e-6) and by_hand.item() == 0.0
        assert stats["distill/reverse_kl"] == pytest.approx(((reverse_kl * mask).sum() / mask.sum()).item(), rel=1e-6)
        loss.backward()
        if objective == "distill":  # the sign of each token's gradient step follows the teacher
            assert x.grad[0, 0] < 0 < x.grad[0, 1] and x.grad[0, 2] == 0.0 and x.grad[1, 0] == 0.0


def test_a_distillation_objective_without_teacher_logprobs_is_an_error():
    with pytest.raises(ValueError, match="teacher_logprobs"):
        grpo.grpo_loss(LossInputs(torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1)), LossParams(objective="distill"))


# ---------------------------------------------------------------------------- entropy


def test_entropy_comes_from_the_same_chunks_and_its_bonus_has_the_right_gradient():
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(2, 3, 8, generator=g, requires_grad=True)
    weight = torch.randn(11, 8, generator=g)
    targets = torch.randint(0, 11, (2, 3), generator=g)
    logp, entropy = passes.logprobs_from_hidden(hidden, weight, targets, chunk_tokens=4, with_entropy=True,
                                              entropy_grad=True)  # [2, 3] x 2
    logits = hidden @ weight.T  # [2, 3, 11]
    torch.testing.assert_close(entropy, torch.distributions.Categorical(logits=logits).entropy())
    torch.testing.assert_close(logp, passes.logprobs_from_hidden(hidden, weight, targets, chunk_tokens=4))
    mask = torch.ones(2, 3)
    loss, stats = grpo.token_mean_loss(LossInputs(logp, mask, torch.zeros(2), entropy=entropy),
                                       LossParams(entropy_coef=0.1))
    assert loss.item() == pytest.approx(-0.1 * entropy.mean().item(), rel=1e-6)
    assert stats["entropy"] == pytest.approx(entropy.mean().item(), rel=1e-6)
    (ours,) = torch.autograd.grad(loss, hidden)
    (direct,) = torch.autograd.grad(-0.1 * torch.distributions.Categorical(logits=hidden @ weight.T).entropy().mean(),
                                    hidden)
    torch.testing.assert_close(ours, direct)
    with pytest.raises(ValueError, match="entropy"):
        grpo.grpo_loss(LossInputs(logp, mask, torch.zeros(2)), LossParams(entropy_coef=0.1))
