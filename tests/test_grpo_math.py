"""The GRPO math (grpo.py) and the model passes (passes.py) against hand-computed values and plain
forward passes (tier 1: CPU, seconds)."""

import math

import pytest
import torch

from grpo_cli.algorithm.grpo import (
    LOSSES,
    NORMALIZERS,
    LossInputs,
    LossParams,
    clipped_surrogate,
    group_advantages,
    grpo_loss,
    kl_k3,
    round_rewards,
    token_mean_loss,
    zero_variance_groups,
)
from grpo_cli.algorithm.passes import (
    completion_logprobs,
    logprobs_from_hidden,
    prompt_backward,
    prompt_leaves,
    prompt_states,
    shared_prompt_unsupported,
    token_logprobs,
    token_logprobs_reference,
)

# ---------------------------------------------------------------------------- advantages


def test_advantages_hand_computed():
    adv = group_advantages(torch.tensor([[1.0, 0, 0, 1, 0, 0, 0, 1]]))
    # mean 3/8, population std sqrt(3/8 * 5/8) = 0.4841
    assert adv[0, 0].item() == pytest.approx(0.625 / math.sqrt(0.375 * 0.625), abs=1e-6)
    assert [round(v, 2) for v in adv[0].tolist()] == [1.29, -0.77, -0.77, 1.29, -0.77, -0.77, -0.77, 1.29]
    assert adv.sum().item() == pytest.approx(0.0, abs=1e-6)


def test_all_equal_group_gives_exact_zeros():
    for value in (0.0, 1.0, 0.1, 0.7):
        for g in (3, 7, 8):
            rewards = torch.full((1, g), value)
            assert torch.equal(group_advantages(rewards), torch.zeros(1, g))
            assert torch.equal(group_advantages(rewards, scale_by_std=False), torch.zeros(1, g))


def test_std_scaling_is_scale_free_and_no_std_is_r_minus_mean():
    a10 = group_advantages(torch.tensor([[10.0, 0, 0, 0]]))
    a1 = group_advantages(torch.tensor([[1.0, 0, 0, 0]]))
    torch.testing.assert_close(a10, a1)
    assert a1[0, 0].item() == pytest.approx(math.sqrt(3), abs=1e-6)  # 0.75 / sqrt(3/16)
    raw = group_advantages(torch.tensor([[10.0, 0, 0, 0]]), scale_by_std=False)
    torch.testing.assert_close(raw, torch.tensor([[7.5, -2.5, -2.5, -2.5]]))


def test_several_groups_at_once_and_int_rewards():
    rewards = torch.tensor([[1, 0, 0, 1], [1, 1, 1, 1], [0, 0, 0, 1]])  # [P=3, G=4], ints
    adv = group_advantages(rewards)
    assert adv.shape == (3, 4) and adv.dtype == torch.float32
    torch.testing.assert_close(adv[0], torch.tensor([1.0, -1, -1, 1]), atol=1e-6, rtol=0)
    assert torch.equal(adv[1], torch.zeros(4))
    torch.testing.assert_close(adv[2], torch.tensor([-1, -1, -1, 3]) / math.sqrt(3), atol=1e-6, rtol=0)
    for p in range(3):  # each row is exactly its own group
        torch.testing.assert_close(adv[p:p + 1], group_advantages(rewards[p:p + 1]))


def test_graded_noise_and_rounding():
    noisy = torch.tensor([[0.51, 0.5, 0.5, 0.5]])
    assert group_advantages(noisy)[0, 0].item() == pytest.approx(1.73, abs=0.01)  # noise blown up to +1.73
    rounded = round_rewards(noisy, 1)
    assert torch.equal(group_advantages(rounded), torch.zeros(1, 4))
    assert round_rewards(noisy, None) is noisy


def test_zero_variance_groups():
    rewards = torch.tensor([[1.0, 1, 1], [0, 0, 0], [1, 0, 1], [0.5, 0.5, 0.5], [-1, -1, -1]])
    all_correct, all_wrong = zero_variance_groups(rewards)
    assert all_correct.tolist() == [True, False, False, True, False]
    assert all_wrong.tolist() == [False, True, False, False, True]


# ---------------------------------------------------------------------------- surrogate and KL


@pytest.mark.parametrize("ratio, adv, expected", [
    (1.1, 1.0, 1.1),    # inside the range: unclipped
    (1.5, 1.0, 1.2),    # above 1+eps with A > 0: clipped (no extra reward for moving further)
    (0.5, 1.0, 0.5),    # below 1-eps with A > 0: the min keeps the (worse) unclipped term
    (0.9, -1.0, -0.9),  # inside the range
    (0.5, -1.0, -0.8),  # below 1-eps with A < 0: clipped
    (1.5, -1.0, -1.5),  # above 1+eps with A < 0: unclipped (pessimistic)
    (1.3, 2.0, 2.4),    # scales with A
])
def test_clipped_surrogate_values(ratio, adv, expected):
    out = clipped_surrogate(torch.tensor([ratio]), torch.tensor([adv]), clip_eps=0.2)
    assert out.item() == pytest.approx(expected, abs=1e-6)


def test_clipped_surrogate_asymmetric_and_broadcast():
    ratio = torch.tensor([[1.5, 0.5, 1.1], [1.5, 0.5, 0.75]])  # [B=2, T=3]
    adv = torch.tensor([[1.0], [-1.0]])  # [B, 1]
    out = clipped_surrogate(ratio, adv, clip_eps=0.2, clip_eps_high=0.28)
    torch.testing.assert_close(out, torch.tensor([[1.28, 0.5, 1.1], [-1.5, -0.8, -0.8]]))
    symmetric = clipped_surrogate(ratio, adv, clip_eps=0.2)
    assert symmetric[0, 0].item() == pytest.approx(1.2)


def test_kl_k3():
    assert kl_k3(torch.tensor([-1.0]), torch.tensor([-2.0])).item() == pytest.approx(math.exp(-1), abs=1e-6)
    assert kl_k3(torch.tensor([-2.0]), torch.tensor([-1.0])).item() == pytest.approx(math.e - 2, abs=1e-6)
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(64, 32, generator=g) * 5
    ref = -torch.rand(64, 32, generator=g) * 5
    kl = kl_k3(logp, ref)
    assert (kl >= 0).all()
    d = ref - logp
    torch.testing.assert_close(kl, torch.exp(d) - d - 1)
    assert torch.equal(kl_k3(logp, logp), torch.zeros_like(logp))
    near = kl_k3(logp, logp + 1e-7)  # round-off must not go negative
    assert (near >= 0).all()


# ---------------------------------------------------------------------------- the loss


def _logits_policy(B=2, T=4, V=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g).requires_grad_(True)  # the "model": a tensor of logits
    targets = torch.randint(0, V, (B, T), generator=g)
    return logits, targets


def _logp(logits, targets):
    return torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("name", ["grpo", "token_mean"])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_gradient_step_moves_logprob_with_advantage(name, sign):
    logits, targets = _logits_policy()
    mask = torch.tensor([[0, 1, 1, 1], [0, 0, 1, 1]])
    adv = torch.tensor([sign, 0.0])  # only sequence 0 has signal
    before = _logp(logits, targets).detach()
    logp = _logp(logits, targets)
    loss, stats = LOSSES[name](LossInputs(logp, mask, adv, ref_logprobs=logp.detach()), LossParams(kl_coef=0.1))
    assert stats["ratio"] == pytest.approx(1.0) and stats["clip_frac"] == 0.0 and stats["kl"] == 0.0
    loss.backward()
    with torch.no_grad():
        logits -= 0.1 * logits.grad  # one SGD step
    after = _logp(logits, targets).detach()
    moved = (after - before)[0, 1:]  # sequence 0's completion tokens
    assert (torch.sign(moved) == sign).all()
    assert torch.equal(logits.grad[1], torch.zeros_like(logits.grad[1]))  # zero advantage, ref = policy: no grad


@pytest.mark.parametrize("name", ["grpo", "token_mean"])
def test_masked_positions_change_nothing(name):
    g = torch.Generator().manual_seed(1)
    mask = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    logp = -torch.rand(3, 5, generator=g)
    old = logp - 0.3 * torch.randn(3, 5, generator=g)
    ref = -torch.rand(3, 5, generator=g)
    adv = torch.tensor([1.0, -0.5, 2.0])

    def run(lp, o, r):
        lp = lp.clone().requires_grad_(True)
        loss, _ = LOSSES[name](LossInputs(lp, mask, adv, old_logprobs=o, ref_logprobs=r),
                               LossParams(clip_eps=0.2, kl_coef=0.05))
        loss.backward()
        return loss.detach(), lp.grad

    loss1, grad1 = run(logp, old, ref)
    junk = torch.where(mask.bool(), 0.0, 3.0 * torch.randn(3, 5, generator=g) - 5.0)
    loss2, grad2 = run(logp + junk, old - junk, ref + 2 * junk)
    torch.testing.assert_close(loss1, loss2)
    torch.testing.assert_close(grad1, grad2)
    assert torch.equal(grad1[~mask.bool()], torch.zeros(int((~mask.bool()).sum())))


@pytest.mark.parametrize("name", ["grpo", "token_mean"])
def test_zero_length_completion_gives_no_nan(name):
    logp = (-torch.rand(2, 4)).requires_grad_(True)
    mask = torch.tensor([[0, 0, 0, 0], [0, 1, 1, 0]])
    loss, stats = LOSSES[name](LossInputs(logp, mask, torch.tensor([1.0, 1.0]), ref_logprobs=logp.detach() - 0.1),
                                 LossParams(kl_coef=0.1))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    assert all(math.isfinite(v) for v in stats.values())
    empty, empty_stats = LOSSES[name](LossInputs(logp.detach(), torch.zeros(2, 4), torch.tensor([1.0, 1.0])))
    assert empty.item() == 0.0 and empty_stats["tokens"] == 0.0 and empty_stats["kl"] == 0.0


def test_aggregations_differ_on_unequal_lengths():
    # seq 0: 1 completion token with A=+1; seq 1: 3 completion tokens with A=-1; ratio = 1, no KL.
    logp = torch.zeros(2, 3, requires_grad=True)
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]])
    adv = torch.tensor([1.0, -1.0])
    per_seq, _ = grpo_loss(LossInputs(logp, mask, adv))
    per_tok, _ = token_mean_loss(LossInputs(logp, mask, adv))
    assert per_seq.item() == pytest.approx(0.0)  # -(1/1 * 1 + 1/3 * 3 * -1) / 2: each answer weighs the same
    assert per_tok.item() == pytest.approx(0.5)  # -(1 - 3) / 4: each token weighs the same
    (g_seq,) = torch.autograd.grad(per_seq, logp)
    (g_tok,) = torch.autograd.grad(per_tok, logp)
    torch.testing.assert_close(g_seq, torch.tensor([[-0.5, 0, 0], [1 / 6, 1 / 6, 1 / 6]]))
    torch.testing.assert_close(g_tok, torch.tensor([[-0.25, 0, 0], [0.25, 0.25, 0.25]]))


def test_stats_clip_fraction_ratio_and_kl():
    old = torch.zeros(2, 3)
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.0], [1.5, 0.5, 1.0]]))  # ratio = [1.5, 0.5, 1.0]
    mask = torch.ones(2, 3)
    adv = torch.tensor([1.0, -1.0])
    _, stats = grpo_loss(LossInputs(logp, mask, adv, old_logprobs=old, ref_logprobs=old), LossParams(clip_eps=0.2))
    assert stats["clip_frac"] == pytest.approx(2 / 6)  # 1.5 with A>0 and 0.5 with A<0
    assert stats["ratio"] == pytest.approx(1.0)
    assert stats["surrogate"] == pytest.approx((1.2 + 0.5 + 1.0 - 1.5 - 0.8 - 1.0) / 6)
    expected_kl = sum(math.exp(-d) + d - 1 for d in (math.log(1.5), math.log(0.5), 0.0)) / 3
    assert stats["kl"] == pytest.approx(expected_kl, rel=1e-5)
    assert stats["tokens"] == 6.0
    _, wide = grpo_loss(LossInputs(logp, mask, adv, old_logprobs=old), LossParams(clip_eps=0.2, clip_eps_high=0.6))
    assert wide["clip_frac"] == pytest.approx(1 / 6)  # clip-higher lets 1.5 through
    with pytest.raises(ValueError, match="ref_logprobs"):
        grpo_loss(LossInputs(logp, mask, adv, old_logprobs=old), LossParams(kl_coef=0.1))


@pytest.mark.parametrize("name", ["grpo", "token_mean"])
def test_micro_batches_add_up_to_the_full_batch(name):
    g = torch.Generator().manual_seed(2)
    B, T = 6, 7
    logp_full = -torch.rand(B, T, generator=g)
    old = logp_full + 0.3 * torch.randn(B, T, generator=g)  # ratios away from 1: some clipped
    ref = -torch.rand(B, T, generator=g)
    lengths = torch.tensor([1, 7, 3, 0, 5, 2])
    mask = (torch.arange(T)[None] < lengths[:, None]).long()  # [B, T]
    adv = torch.randn(B, generator=g)
    params = LossParams(clip_eps=0.2, clip_eps_high=0.28, kl_coef=0.05)

    lp = logp_full.clone().requires_grad_(True)
    full, _ = LOSSES[name](LossInputs(lp, mask, adv, old, ref), params)
    (full_grad,) = torch.autograd.grad(full, lp)

    norm = NORMALIZERS[name](mask)  # from the FULL batch, passed to every micro-batch
    lp = logp_full.clone().requires_grad_(True)
    total, scaled_total = 0.0, 0.0
    for rows in (slice(0, 2), slice(2, 6)):
        micro, _ = LOSSES[name](LossInputs(lp[rows], mask[rows], adv[rows], old[rows], ref[rows], normalizer=norm),
                                params)
        micro.backward()
        total = total + micro.detach()
        plain, _ = LOSSES[name](LossInputs(lp[rows].detach(), mask[rows], adv[rows], old[rows], ref[rows]), params)
        scaled_total = scaled_total + plain * NORMALIZERS[name](mask[rows]) / norm  # the equivalent scaling
    torch.testing.assert_close(total, full.detach())
    torch.testing.assert_close(scaled_total, full.detach())
    torch.testing.assert_close(lp.grad, full_grad)
    if name == "grpo":
        assert norm == 5.0  # the sequences in the loss: the empty row 3 is in no term
    else:
        assert norm == 18.0  # micro_tokens / total_tokens


# ---------------------------------------------------------------------------- chunked token log-probabilities


def _tiny_model(tie: bool):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.Qwen2Config(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=64, tie_word_embeddings=tie)
    return transformers.Qwen2ForCausalLM(config).float()


def _batch():
    g = torch.Generator().manual_seed(3)
    input_ids = torch.randint(0, 97, (3, 11), generator=g)
    attention_mask = torch.ones(3, 11, dtype=torch.long)
    attention_mask[0, :3] = 0  # left padding
    attention_mask[1, 8:] = 0  # right padding
    return input_ids, attention_mask


@pytest.mark.parametrize("tie", [False, True])
def test_chunked_token_logprobs_match_reference(tie):
    model = _tiny_model(tie)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tie
    input_ids, attention_mask = _batch()
    weights = torch.randn(3, 10, generator=torch.Generator().manual_seed(4)) * attention_mask[:, 1:]

    ref = token_logprobs_reference(model, input_ids, attention_mask)  # [3, 10]
    (ref * weights).sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert ref.shape == (3, 10) and torch.isfinite(ref).all()

    for chunk in (1, 4, 7, 30, 1024):  # 30 = B*(T-1): one chunk
        model.zero_grad()
        out = token_logprobs(model, input_ids, attention_mask, chunk_tokens=chunk)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        (out * weights).sum().backward()
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad, ref_grads[n], atol=1e-5, rtol=1e-4, msg=f"{n}, chunk {chunk}")

    with torch.no_grad():
        torch.testing.assert_close(token_logprobs(model, input_ids, attention_mask, chunk_tokens=4), ref.detach(),
                                   atol=1e-5, rtol=1e-5)
    hot = token_logprobs(model, input_ids, attention_mask, chunk_tokens=4, temperature=0.7)
    torch.testing.assert_close(hot, token_logprobs_reference(model, input_ids, attention_mask, temperature=0.7),
                               atol=1e-5, rtol=1e-5)


def test_left_padding_does_not_shift_positions():
    model = _tiny_model(False)
    input_ids, attention_mask = _batch()
    padded = token_logprobs(model, input_ids, attention_mask, chunk_tokens=4)
    alone = token_logprobs(model, input_ids[:1, 3:], attention_mask[:1, 3:], chunk_tokens=4)
    torch.testing.assert_close(padded[:1, 3:], alone, atol=1e-5, rtol=1e-5)


def test_chunked_forward_keeps_no_full_logits_for_backward():
    B, T, H, V, chunk = 2, 16, 8, 50, 4
    hidden = torch.randn(B, T, H, requires_grad=True)
    weight = torch.randn(V, H, requires_grad=True)
    targets = torch.randint(0, V, (B, T))
    saved = []

    def pack(t):
        if t.untyped_storage().data_ptr() != weight.untyped_storage().data_ptr():  # the lm_head itself is no copy
            saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = logprobs_from_hidden(hidden, weight, targets, chunk_tokens=chunk)
    assert max(saved) < chunk * V  # no [chunk, V] logits, let alone [B*T, V], kept alive for backward
    out.sum().backward()
    ref = torch.log_softmax(hidden.detach() @ weight.detach().T, -1).gather(-1, targets[..., None])[..., 0]
    torch.testing.assert_close(out, ref)

    saved.clear()  # the hook does catch an unchunked computation
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        torch.log_softmax(hidden @ weight.T, -1)
    assert max(saved) >= B * T * V


def _groups():
    """P=3 prompts of different lengths, G=4 completions each (lengths 1..9), as token lists."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, 97, (n,), generator=g).tolist() for n in (4, 9, 6)]
    lengths = torch.randint(1, 10, (3, 4), generator=g).tolist()
    completions = [[torch.randint(2, 97, (n,), generator=g).tolist() for n in row] for row in lengths]
    return prompts, completions


def _right_padded(rows):
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])  # [n, T]
    mask = torch.tensor([[1.0] * len(r) + [0.0] * (width - len(r)) for r in rows])  # [n, T]
    return ids, mask


@pytest.mark.parametrize("tie", [False, True])
def test_shared_prompt_pass_matches_whole_sequences(tie):
    """Each prompt run once, its completions in two micro-batches: the same logprobs and the same
    gradient as every whole sequence through token_logprobs."""
    model = _tiny_model(tie)
    prompts, completions = _groups()
    flat = [c for row in completions for c in row]  # [B] completions, row p*G + g
    index = torch.arange(3).repeat_interleave(4)  # [B] prompt of each completion
    weights = torch.randn(12, 9, generator=torch.Generator().manual_seed(6))  # [B, Tc_max] any per-token weights

    # whole sequences, right-padded: completion token j of row i sits at position prompt_len - 1 + j
    full_ids, full_mask = _right_padded([prompts[p] + c for p, row in enumerate(completions) for c in row])
    whole = token_logprobs(model, full_ids, full_mask.long(), chunk_tokens=7, temperature=0.8)  # [B, T-1]
    expected = torch.zeros(12, 9)  # [B, Tc_max]
    for i, c in enumerate(flat):
        start = len(prompts[index[i]]) - 1
        expected[i, :len(c)] = whole[i, start:start + len(c)]
    loss = sum((whole[i, len(prompts[index[i]]) - 1:][:len(c)] * weights[i, :len(c)]).sum()
               for i, c in enumerate(flat))
    loss.backward()
    expected_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    prompt_ids, prompt_mask = _right_padded(prompts)
    states = prompt_states(model, prompt_ids, prompt_mask)
    leaves = prompt_leaves(states)
    got = torch.zeros(12, 9)
    for rows in ([0, 5, 9, 2, 11], [1, 3, 4, 6, 7, 8, 10]):  # two micro-batches mixing the groups
        ids, mask = _right_padded([flat[i] for i in rows])
        out = completion_logprobs(model, leaves, index[rows], ids, mask, chunk_tokens=7, temperature=0.8)  # [b, Tc]
        assert out.shape == ids.shape
        (out * mask * weights[rows, :ids.shape[1]]).sum().backward()
        for k, i in enumerate(rows):
            got[i, :len(flat[i])] = out[k, :len(flat[i])].detach()
    prompt_backward(states, leaves)

    torch.testing.assert_close(got, expected.detach(), atol=1e-5, rtol=1e-5)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected_grads[n], atol=1e-5, rtol=1e-4, msg=n)

    with torch.no_grad():  # the reference pass: no leaves, no backward
        frozen = prompt_states(model, prompt_ids, prompt_mask)
        ids, mask = _right_padded(flat)
        out = completion_logprobs(model, frozen, index, ids, mask, temperature=0.8)  # [B, Tc]
    torch.testing.assert_close(out * mask, expected.detach() * mask, atol=1e-5, rtol=1e-5)


def test_shared_prompt_pass_refuses_sliding_window_layers():
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen2Config(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=64, use_sliding_window=True,
                                      sliding_window=4, max_window_layers=1)
    model = transformers.Qwen2ForCausalLM(config)
    assert "sliding_attention" in model.config.layer_types
    ids, mask = _right_padded([[5, 6, 7]])
    with pytest.raises(NotImplementedError, match="sliding-window"):
        prompt_states(model, ids, mask)
    assert "sliding-window" in shared_prompt_unsupported(config)
    assert shared_prompt_unsupported(_tiny_model(False).config) is None


def test_zero_variance_split_uses_correctness_when_given():
    # every answer wrong but well formatted: summed reward 0.1 each, zero variance, yet all wrong
    reward = torch.tensor([[0.1, 0.1, 0.1], [1.1, 1.1, 1.1], [0.0, 1.1, 0.1]])  # [P, G]
    correct = torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.0, 1.0, 0.0]])  # [P, G]
    all_correct, all_wrong = zero_variance_groups(reward, correct)
    assert all_correct.tolist() == [False, True, False]
    assert all_wrong.tolist() == [True, False, False]
