"""Keeping the rollout engine in step with the trainer: the weight push and the push check.

After every optimizer step the policy's weights go into the engine (`push`). Every
`rollout.push_check_every` steps the engine re-scores a few of the step's sequences and
the run stops if its logprobs differ from the trainer's: it would be sampling from stale
weights, which no other metric shows.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from grpo_cli.algorithm import passes
from grpo_cli.config import RolloutConfig, TrainerConfig
from grpo_cli.dist.shard import full_parameters, full_tensors, gathered, run_pass, unwrap
from grpo_cli.engines.base import Engine
from grpo_cli.errors import RunFailure
from grpo_cli.step.batch import TrainBatch
from grpo_cli.step.optim import move_optimizer_state
from grpo_cli.step.state import RunState
from grpo_cli.step.timer import StepTimer
from grpo_cli.weights.lora import adapter_config, adapter_tensors, is_adapter_model, merged_tensors
from grpo_cli.weights.model_files import is_vision_language

if TYPE_CHECKING:
    import torch


PROBE_SEQUENCES = 4  # sequences re-scored by the engine in a push check


def push(engine: Engine, policy: torch.nn.Module) -> None:
    """Every checkpoint-format tensor of the policy into this rank's engine; a sharded policy's are
    gathered one at a time as the engine reads them (never the whole model in extra memory). With LoRA
    (docs/lora.md) the adapters alone where the engine takes them (`push_mode`), else the base weights
    with the adapters merged in."""
    if not is_adapter_model(policy):
        engine.push_weights(full_tensors(policy))
    elif engine.adapters == "request":
        engine.push_adapter(adapter_tensors(policy), adapter_config(policy))
    elif engine.adapters == "merged":
        engine.push_weights(merged_tensors(policy))
    # "shared": the engine samples from the policy module itself, adapters included


def can_stand_in(engine: Engine, policy: torch.nn.Module, model: torch.nn.Module) -> bool:
    """Whether `model` (a distillation teacher) can take the policy's place in `engine` for a while
    (`standing_in`): the same tensors by name and shape, and an engine of this process that holds whole
    weights (not a base under the policy's adapters, which pushing the policy back would leave replaced)."""
    if is_adapter_model(policy) or engine.adapters == "shared" or not engine.in_process:
        return False
    shapes = [{name: tuple(t.shape) for name, t in m.state_dict().items()} for m in (policy, model)]
    return shapes[0] == shapes[1]


@contextlib.contextmanager
def standing_in(engine: Engine, policy: torch.nn.Module, model: torch.nn.Module) -> Iterator[None]:
    """`model`'s weights in `engine` for the block, the policy's pushed back after it, whatever happens inside."""
    push(engine, model)
    try:
        yield
    finally:
        push(engine, policy)


def push_mode(engine: Engine) -> str:
    """The console's words for how a LoRA policy reaches `engine` (`Engine.adapters`)."""
    return {"request": "the adapters alone, as a vLLM LoRA request",
            "merged": "the base weights with the adapters merged in (rollout.lora_push; vLLM's LoRA is off)",
            "shared": "nothing: the transformers engine samples from the policy itself"}[engine.adapters]


def release_engine(state: RunState, cfg: TrainerConfig, timings: StepTimer) -> None:
    """After generation: the engine sleeps (with sleep mode on) and an offloaded optimizer state
    comes back to the trainer's device for the update."""
    with timings("sleep"):
        state.engine.sleep()
        if cfg.offload_optimizer:
            move_optimizer_state(state.optimizer, state.dist.device)


def push_to_engine(state: RunState, cfg: TrainerConfig, timings: StepTimer) -> None:
    """After the update: the optimizer state leaves the device (trainer.offload_optimizer), the engine
    wakes its weights, takes the new ones, then wakes its KV cache, so the next generate and the
    push check both run on woken, updated weights (trl #5312: a push before the wake-up was lost)."""
    with timings("sleep"):
        if cfg.offload_optimizer:
            move_optimizer_state(state.optimizer, "cpu")
        state.engine.wake_weights()
    with timings("push"):
        push(state.engine, state.policy)
    with timings("sleep"):
        state.engine.wake_kv_cache()


def push_check(engine: Engine, policy: torch.nn.Module, sequences: list[list[int]], prompt_lens: list[int],
               device: Any = "cpu", autocast: Callable[[], AbstractContextManager] | None = None) -> float:
    """Re-score a probe batch in the engine and compare with the trainer: the worst mean |logprob difference|
    over the probes (maybe_push_check stops the run when it is over the tolerance)."""
    import contextlib

    import torch

    engine_lp = engine.score(sequences)
    worst = 0.0
    with gathered(policy), torch.no_grad(), (autocast or contextlib.nullcontext)():
        for seq, n, elp in zip(sequences, prompt_lens, engine_lp):
            ids = torch.tensor([seq], device=device)  # [1, T]
            trainer_lp = run_pass(policy, passes.token_logprobs_reference, ids, torch.ones_like(ids))[0]  # [T-1]
            diff = (trainer_lp[n - 1:] - torch.tensor(elp[n - 1:], device=device)).abs()  # [T-n] completion tokens
            worst = max(worst, float(diff.mean()) if diff.numel() else 0.0)
    return worst


# Pushed tensors compared element for element (sync.exact_push_check): the embedding and two norms, which every
# backend keeps as loaded (vLLM's CPU backend repacks the linear layers), and which every update moves.
EXACT_TENSORS = ("model.embed_tokens.weight", "model.norm.weight", "model.layers.0.input_layernorm.weight")
# A vision-language model's (Idefics3, SmolVLM: the text model under model.text_model), with its vision tower's last
# norm: moved by an update that trains the tower (model.freeze_vision=false), equal to the loaded one otherwise.
VISION_EXACT_TENSORS = ("model.text_model.embed_tokens.weight", "model.text_model.norm.weight",
                        "model.text_model.layers.0.input_layernorm.weight", "model.vision_model.post_layernorm.weight")


def exact_tensors(policy: torch.nn.Module) -> tuple[str, ...]:
    """The tensors the exact push check compares, as the policy's architecture names them."""
    return VISION_EXACT_TENSORS if is_vision_language(unwrap(policy).config) else EXACT_TENSORS


def mismatched_elements(engine_tensor: torch.Tensor, trainer_tensor: torch.Tensor) -> int:
    """Elements where the engine's tensor differs from the trainer's cast to the engine's dtype, as a push
    casts it: 0 after a push, at any dtype. A bf16 engine that missed a small step differs on the few percent
    of its values that the step moved past a rounding boundary, which a logprob tolerance cannot see."""
    return int((engine_tensor != trainer_tensor.detach().to("cpu", engine_tensor.dtype)).sum())


def exact_push_check(engine: Engine, policy: torch.nn.Module) -> tuple[int, int] | None:
    """(elements that differ, elements compared) over EXACT_TENSORS between this rank's engine and the policy;
    None when the engine cannot show its tensors (the transformers engine shares the policy's). Under tensor
    parallelism a tensor the rank holds a shard of is compared when the shard is the whole tensor. With LoRA the
    base's EXACT_TENSORS, and where the engine serves the adapters, EXACT_ADAPTERS' A and B as it holds them."""
    prefix = "base_model.model." if is_adapter_model(policy) else ""  # a peft model's names of the base's tensors
    names = exact_tensors(policy)
    engine_tensors = engine.read_weights(names)  # {} where the engine shares the policy's tensors
    differ = compared = 0
    for name, tensor in full_tensors(policy, [prefix + n for n in names]):  # every rank: the same, in order
        mine = engine_tensors.get(name.removeprefix(prefix))
        if mine is not None and mine.shape == tensor.shape:
            differ += mismatched_elements(mine, tensor)
            compared += tensor.numel()
    if prefix and engine.adapters == "request":
        adapter_differ, adapter_compared = exact_adapter_check(engine, policy)
        differ, compared = differ + adapter_differ, compared + adapter_compared
    return (differ, compared) if compared else None


# LoRA modules whose A and B the exact push check compares: vLLM packs q/k/v and gate/up, not these
EXACT_ADAPTERS = ("model.layers.0.self_attn.o_proj", "model.layers.0.mlp.down_proj")


def exact_adapter_check(engine: Engine, policy: torch.nn.Module) -> tuple[int, int]:
    """(elements that differ, elements compared) between the adapters the engine serves and the policy's, over
    EXACT_ADAPTERS: A as pushed, B with the alpha/r scale vLLM folds into it, in the engine's LoRA dtype."""
    served = engine.read_adapter(EXACT_ADAPTERS)
    config = adapter_config(policy)
    scale = config["lora_alpha"] / config["r"]
    names = [f"base_model.model.{m}.lora_{x}.default.weight" for m in EXACT_ADAPTERS for x in "AB"]
    trainer = dict(full_parameters(policy, names))  # every rank gathers these four, in one order
    differ = compared = 0
    for module, (a, b) in served.items():
        want_a = trainer.get(f"base_model.model.{module}.lora_A.default.weight")
        want_b = trainer.get(f"base_model.model.{module}.lora_B.default.weight")
        if want_a is None or want_a.shape != a.shape or want_b.shape != b.shape:
            continue
        differ += mismatched_elements(a, want_a) + mismatched_elements(b, want_b.to("cpu", b.dtype) * scale)
        compared += a.numel() + b.numel()
    return differ, compared


def stale_weights_error(worst: float, tol: float, where: str = "") -> Exception:
    return RunFailure(f"the rollout engine{where} holds stale weights: its logprobs differ from the trainer's by "
                        f"{worst:.2e} (> rollout.push_check_tol={tol:g}) after a weight push")


def maybe_push_check(state: RunState, batch: TrainBatch, step: int, cfg: RolloutConfig,
                     dtype: str) -> dict[str, float]:
    """The push checks when due: the exact one at the first step this process runs (a new run's, or a resume's)
    and every rollout.push_check_every steps, the logprob one on the step's first sequences every
    push_check_every steps. {"push_check/tensors_mismatched": ..., "push_check/max_abs_diff": ...} or {}."""
    if not cfg.push_check_every:
        return {}
    due = step % cfg.push_check_every == 0 and batch.micro_batches
    if not (due or step == state.start.step + 1):
        return {}
    dist = state.dist
    exact = exact_push_check(state.engine, state.policy)
    out: dict[str, float] = {}
    if exact is not None:
        per_rank = dist.gather(exact)
        worst = max(range(len(per_rank)), key=lambda r: per_rank[r][0])
        differ, compared = per_rank[worst]
        if differ:
            where = f" of rank {worst}" if dist.world_size > 1 else ""

            raise RunFailure(f"the rollout engine{where} holds stale weights: {differ} of {compared} elements of "
                             f"{', '.join(exact_tensors(state.policy))} (with LoRA, and of {', '.join(EXACT_ADAPTERS)}'s adapters) "
                             "differ from the trainer's after a weight push (cast to the engine's dtype they must be "
                             "equal)")
        out["push_check/tensors_mismatched"] = float(differ)
    if not due:
        return out
    rows = range(min(PROBE_SEQUENCES, len(batch.completions)))
    prompts = [batch.prompt_tokens[batch.prompt_index[j]] for j in rows]
    worst = push_check(state.engine, state.policy, [ids + batch.completions[j] for j, ids in zip(rows, prompts)],
                       [len(ids) for ids in prompts], dist.device, lambda: dist.autocast(dtype))
    per_rank = dist.gather(worst)  # every rank checked its own engine; all stop together, naming the worst
    stale = max(range(len(per_rank)), key=per_rank.__getitem__)
    if per_rank[stale] > cfg.push_check_tol:
        raise stale_weights_error(per_rank[stale], cfg.push_check_tol, f" of rank {stale}" if dist.world_size > 1 else "")
    return {**out, "push_check/max_abs_diff": per_rank[stale]}
