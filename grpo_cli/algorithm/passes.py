"""Model passes: log-probabilities of tokens under a Hugging Face causal LM, the prompt once per group.

These run the model (the body for hidden states, the lm_head in chunks), unlike grpo.py's pure loss
math. Shapes: P prompts, B (or b) sequences, T token positions, Tp prompt and Tc completion
positions, H hidden size, V vocabulary.

    prompts = prompt_states(policy, prompt_ids, prompt_mask)          # each prompt once: keys/values
    logprobs = completion_logprobs(policy, prompts, prompt_index,
                                   completion_ids, completion_mask)  # [b, Tc], chunked over tokens

`token_logprobs` does the same on whole sequences `[B, T]` (the push check, tests, benchmarks).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

# ---------------------------------------------------------------------------- token log-probabilities


def _chunk_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    targets: torch.Tensor, temperature: float) -> torch.Tensor:
    logits = F.linear(hidden, weight, bias).float() / temperature  # [n, V] float32
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # [n]


def _chunk_logprobs_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                            targets: torch.Tensor, temperature: float,
                            entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    logits = F.linear(hidden, weight, bias).float() / temperature  # [n, V] float32
    logp = torch.log_softmax(logits, dim=-1)  # [n, V]
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = -(logp.exp() * logp).sum(-1)  # [n] H of the token distribution
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), entropy  # [n], [n]


def logprobs_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    chunk_tokens: int = 1024,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`log_softmax(hidden @ weight.T + bias)[targets]`, never holding more than `chunk_tokens` rows of logits.

    `hidden` `[B, T, H]`, `weight` `[V, H]` (the lm_head; tied or not, it is the same tensor
    the model uses), `targets` `[B, T]` -> float32 `[B, T]`. With autograd on, each chunk is
    checkpointed: the forward keeps only the chunk's input, and the backward recomputes
    that chunk's logits, so the backward too holds one `[chunk_tokens, V]` block at a time.

    `with_entropy=True` also returns each position's entropy `-sum_v p_v log p_v` `[B, T]`, from
    the same chunk of logits (no second pass); it carries a gradient only with `entropy_grad`.
    """
    B, T, H = hidden.shape
    flat_hidden = hidden.reshape(B * T, H)  # [B*T, H]
    flat_targets = targets.reshape(B * T)  # [B*T]
    needs_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    fn, extra = (_chunk_logprobs_entropy, (entropy_grad,)) if with_entropy else (_chunk_logprobs, ())
    pieces = []
    for start in range(0, B * T, chunk_tokens):
        h = flat_hidden[start:start + chunk_tokens]  # [n, H]
        y = flat_targets[start:start + chunk_tokens]  # [n]
        if needs_grad:
            pieces.append(checkpoint(fn, h, weight, bias, y, temperature, *extra,
                                     use_reentrant=False, preserve_rng_state=False))  # [n] (or [n], [n])
        else:
            pieces.append(fn(h, weight, bias, y, temperature, *extra))  # [n] (or [n], [n])
    if not with_entropy:
        if not pieces:
            return hidden.new_zeros(B, T, dtype=torch.float32)  # [B, T]
        return torch.cat(pieces).reshape(B, T)  # [B, T]
    if not pieces:
        return hidden.new_zeros(B, T, dtype=torch.float32), hidden.new_zeros(B, T, dtype=torch.float32)
    return (torch.cat([lp for lp, _ in pieces]).reshape(B, T),  # [B, T]
            torch.cat([ent for _, ent in pieces]).reshape(B, T))  # [B, T]


def body_and_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The transformer body (-> hidden states) and the lm_head of a Hugging Face causal LM."""
    if getattr(model.config, "final_logit_softcapping", None):
        raise NotImplementedError(f"{type(model).__name__} soft-caps its logits; token_logprobs does not model that")
    body = model.get_decoder()  # e.g. Qwen2Model, LlamaModel
    head = model.get_output_embeddings()  # nn.Linear; with tie_word_embeddings its weight IS embed_tokens.weight
    return body, head


def _positions(attention_mask: torch.Tensor) -> torch.Tensor:
    # Count positions over real tokens only, as generate()/vLLM do, so left padding does not shift them.
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # [B, T]


def token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    chunk_tokens: int = 1024,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Log-probability of each NEXT token under `model`: `[B, T]` ids -> float32 `[B, T-1]`.

    Entry t is `log p(input_ids[:, t+1] | input_ids[:, :t+1])`. Runs the body once for
    hidden states `[B, T, H]`, then the lm_head in chunks of `chunk_tokens` positions
    (`logprobs_from_hidden`), so the `[B, T, V]` logits tensor never exists, in the forward
    or the backward. Padding positions get finite values; mask them out downstream.
    `temperature` divides the logits (match the sampler's when comparing with vLLM).
    """
    body, head = body_and_head(model)
    hidden = body(input_ids=input_ids, attention_mask=attention_mask,
                  position_ids=_positions(attention_mask), use_cache=False).last_hidden_state  # [B, T, H]
    return logprobs_from_hidden(hidden[:, :-1], head.weight, input_ids[:, 1:], bias=head.bias,
                                chunk_tokens=chunk_tokens, temperature=temperature)  # [B, T-1]


# ---------------------------------------------------------------------------- the prompt once per group
#
# Every completion of a group continues the same prompt, so the trainer runs the P prompts
# through the body once and lets the P*G completions attend to their keys/values, instead
# of running each prompt G times: on the default workload ~30% fewer tokens in the reference
# pass and the update. In the update the completions' gradient reaches the prompt
# pass through detached leaves (`prompt_leaves`) that collect it over every micro-batch; one
# backward through the prompt pass (`prompt_backward`) then adds the prompts' share. Exact up
# to float summation order (tests/test_grpo_math.py checks values and gradients).


class PromptStates(NamedTuple):
    """The P prompts of a step after one pass of the body."""

    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values [P, kv_heads, Tp, d]
    final: torch.Tensor  # [P, H] hidden state of each prompt's last real token: predicts a completion's 1st token
    mask: torch.Tensor  # [P, Tp] 1 on real prompt tokens (right-padded)


def shared_prompt_unsupported(config: object) -> str | None:
    """Why a model (by its transformers config) cannot take the shared prompt pass, or None if it can."""
    if "sliding_attention" in (getattr(config, "layer_types", None) or []):
        return (f"{getattr(config, 'model_type', 'this model')} has sliding-window layers; the shared prompt pass "
                "(passes.prompt_states) assumes every layer keeps the whole prompt")
    return None


def vision_body(model: torch.nn.Module) -> torch.nn.Module:
    """A vision-language model's body that takes pixel values beside the ids (Idefics3Model: the vision tower,
    the connector, the text model), where `body_and_head`'s is the text model alone; through a peft wrapper."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return inner.model


def prompt_states(model: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                  pixels: dict[str, torch.Tensor] | None = None) -> PromptStates:
    """Run the right-padded prompts `[P, Tp]` through the body once (with autograd if it is on). With `pixels`
    (a vision-language model's image tensors, pixel_values `[P, N, C, H, W]`, one prompt's images a row) the
    images are encoded here, once per prompt, and their tokens' states join the prompt's keys and values; the
    completions then need no pixels."""
    if reason := shared_prompt_unsupported(model.config):
        raise NotImplementedError(reason)
    body = vision_body(model) if pixels else body_and_head(model)[0]
    out = body(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=_positions(prompt_mask),
               use_cache=True, **(pixels or {}))
    kv = [(layer.keys, layer.values) for layer in out.past_key_values.layers]  # each [P, kv_heads, Tp, d]
    last = prompt_mask.long().sum(-1) - 1  # [P] index of each prompt's last real token
    final = out.last_hidden_state[torch.arange(len(last)), last]  # [P, H]
    return PromptStates(kv, final, prompt_mask)


def prompt_leaves(states: PromptStates) -> PromptStates:
    """Detached float32 copies of `states` that require grad: each micro-batch's backward adds its share
    of the prompts' gradient into their `.grad` instead of re-running the prompt pass's backward. Under
    bf16 autocast the states are bf16, and a bf16 `.grad` would round the sum at every micro-batch; in
    float32 (a no-op for float32 states) it rounds once, in `prompt_backward`."""
    kv = [(k.detach().float().requires_grad_(), v.detach().float().requires_grad_()) for k, v in states.kv]
    return PromptStates(kv, states.final.detach().float().requires_grad_(), states.mask)


def prompt_backward(states: PromptStates, leaves: PromptStates) -> None:
    """After the last micro-batch: backward through the prompt pass with what the leaves collected (each
    sum cast to its state's dtype)."""
    outputs = [t for pair in states.kv for t in pair] + [states.final]
    grads = [t.grad for pair in leaves.kv for t in pair] + [leaves.final.grad]
    pairs = [(out, grad.to(out.dtype)) for out, grad in zip(outputs, grads) if grad is not None]
    if pairs:
        torch.autograd.backward([out for out, _ in pairs], [grad for _, grad in pairs])


def completion_logprobs(
    model: torch.nn.Module,
    prompts: PromptStates,
    prompt_index: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    chunk_tokens: int = 1024,
    temperature: float = 1.0,
    entropy: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of each completion token given its prompt's `PromptStates`: float32 `[b, Tc]`
    (and the entropy at each position `[b, Tc]` with `entropy` "detached" or "grad", the latter carrying a
    gradient: see `logprobs_from_hidden`).

    Row i continues prompt `prompt_index[i]` (`[b]`); `completion_ids`/`completion_mask` are
    right-padded `[b, Tc]`. Entry j is `log p(completion[j] | prompt, completion[:j])`: what
    `token_logprobs` gives on the whole sequence at position `prompt_len - 1 + j`.
    """
    from transformers import DynamicCache

    body, head = body_and_head(model)
    cache = DynamicCache([(k.index_select(0, prompt_index), v.index_select(0, prompt_index))
                          for k, v in prompts.kv])  # each [b, kv_heads, Tp, d]
    row_prompt_mask = prompts.mask.index_select(0, prompt_index)  # [b, Tp]
    mask = torch.cat([row_prompt_mask, completion_mask], dim=1)  # [b, Tp + Tc]: the prompt's padding stays masked
    positions = row_prompt_mask.long().sum(-1, keepdim=True) + _positions(completion_mask)  # [b, Tc]
    hidden = body(input_ids=completion_ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                  use_cache=True).last_hidden_state  # [b, Tc, H]
    states = torch.cat([prompts.final.index_select(0, prompt_index)[:, None], hidden[:, :-1]], dim=1)  # [b, Tc, H]
    return logprobs_from_hidden(states, head.weight, completion_ids, bias=head.bias, chunk_tokens=chunk_tokens,
                                temperature=temperature, with_entropy=entropy is not None,
                                entropy_grad=entropy == "grad")  # [b, Tc] (, [b, Tc])


def token_logprobs_reference(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """The plain, unchunked version of `token_logprobs` (full `[B, T, V]` logits), for tests."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask,
                   position_ids=_positions(attention_mask), use_cache=False).logits  # [B, T, V]
    logp = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)  # [B, T-1, V]
    return logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)  # [B, T-1]
