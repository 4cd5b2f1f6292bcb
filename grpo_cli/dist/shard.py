"""FSDP2 for the policy and the reference at world size > 1, and reading full tensors back out of the shards.

`shard_model` puts each decoder layer in its own FSDP2 group (`fully_shard`), and the body
with the lm_head in one more (the root: the embedding and lm_head share a tensor when tied, so
they must be in one group). What a rank holds (docs/distributed.md, "Memory"):

- Layer by layer (`dist.reshard_layers`, the default): a decoder layer's parameters are gathered
  for its forward and freed after it, and gathered again for its backward, so during the update a
  rank holds its shard of everything, the root group, and one or two whole layers (the one running
  and the one prefetched). A model larger than one device trains. The shared prompt pass still works:
  its keys/values are made inside each layer, but every layer's output also feeds the next layer, so
  autograd reaches a layer's pre-backward hook (on that output) before any of the layer's own nodes,
  and FSDP2 gathers the layer before its backward needs it.
- Without it, parameters stay gathered from the first forward of an optimizer step to `reshard_all`
  after its last backward: one all-gather per step instead of one per layer and pass, for a model that
  fits on one device with room to spare.

The root group stays gathered from the first forward to the end of each backward either way: the loss
reads `lm_head.weight` directly (chunked logprobs, passes.logprobs_from_hidden). At rest (while the
engine generates, in the optimizer step) every parameter, gradient and AdamW moment is sharded.

FSDP2 averages gradients over ranks; every rank's loss is already divided by the global normalizer
(batch.py), so the ranks' gradients must add up: the divide factor is 1. On CUDA with fp32 master
weights and a bf16 `model.dtype`, the gathers carry the compute dtype and the gradient reductions
stay float32 (`mixed_precision`).

At world size 1 every function here hands the model back as it is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from grpo_cli.algorithm.passes import body_and_head
from grpo_cli.dist.ranks import Dist

def fsdp_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


class ShardedLM(torch.nn.Module):
    """The FSDP2 root: every pass on the model goes through its forward, `sharded(fn, *args)` =
    `fn(model, *args)`, so FSDP2's root hooks (gather the embedding, norm and lm_head; reduce
    their gradients after the backward) run around the loop's own model calls
    (passes.prompt_states, passes.completion_logprobs), which reach into the body and lm_head."""

    def __init__(self, module: torch.nn.Module, reshard_layers: bool = True) -> None:
        super().__init__()
        self.module = module
        self.reshard_layers = reshard_layers  # shard_model's choice, which `gathered` restores

    def forward(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return fn(self.module, *args, **kwargs)


def mixed_precision(master_dtype: str, compute_dtype: str) -> Any:
    """FSDP2's mixed-precision policy: gathers in the compute dtype and float32 gradient reductions where the
    master weights are float32 and the passes compute in bf16 (on CUDA: Dist.master_dtype); None (gather what is
    stored) where the weights are stored in the compute dtype itself (the CPU, a frozen reference)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if master_dtype == compute_dtype:
        return None
    return MixedPrecisionPolicy(param_dtype=getattr(torch, compute_dtype), reduce_dtype=torch.float32)


def shard_model(model: torch.nn.Module, dist: Dist, reshard_layers: bool = True,
                compute_dtype: str | None = None) -> torch.nn.Module:
    """`model` at world size 1; else the model in FSDP2 groups (one per decoder layer, the rest in
    the root) inside a `ShardedLM` root. Call it through `run_pass`. `reshard_layers` frees each layer's
    gathered parameters after its forward and backward (see the module's docstring); `compute_dtype`
    (default: the weights' own dtype) is what the gathers carry."""
    if dist.world_size == 1:
        return model
    import warnings

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    # FSDP2 warns when a root's output is a view (an in-place op on it would skip its pre-backward hook).
    # The passes return logprobs built out of place (torch.cat, reshape) and nothing writes into them.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPShardedLM\) returned a view tensor")
    # the mesh on the run's device type: without it FSDP2 picks CUDA whenever CUDA exists (trainer.device=cpu too)
    mesh = init_device_mesh(torch.device(dist.device).type, (dist.world_size,))
    stored = str(next(model.parameters()).dtype).removeprefix("torch.")
    policy = mixed_precision(stored, compute_dtype or stored)
    precision = {"mp_policy": policy} if policy is not None else {}
    body, _ = body_and_head(model)
    for layer in body.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_layers, **precision)
    root = fully_shard(ShardedLM(model, reshard_layers), mesh=mesh, reshard_after_forward=False, **precision)
    for module in fsdp_modules(root):
        module.set_reshard_after_backward(reshard_layers)
        module.set_force_sum_reduction_for_comms(True)  # plain SUM collectives (gloo has no PREMUL_SUM)
        module.set_gradient_divide_factor(1.0)  # sum the ranks' gradients: each loss has the global normalizer
    return root


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face model itself (inside its FSDP2 root at world size > 1)."""
    return model.module if isinstance(model, ShardedLM) else model


def run_pass(model: torch.nn.Module, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`fn(hf_model, *args)`, through the FSDP2 root's forward when the model is sharded."""
    if isinstance(model, ShardedLM):
        return model(fn, *args, **kwargs)
    return fn(model, *args, **kwargs)


def reshard_all(model: torch.nn.Module) -> None:
    """Free the gathered parameters of every group (after an optimizer step's last backward, or a
    no-grad pass): back to this rank's shard only."""
    for module in fsdp_modules(model):
        module.reshard()


@contextlib.contextmanager
def gathered(model: torch.nn.Module) -> Iterator[None]:
    """Every group's parameters gathered for the block (a collective: every rank enters it) and kept gathered
    across its passes, then back to shards: passes that differ in number between ranks (generation, a rank's
    own probes) need no communication. Costs the whole model on each rank while it lasts."""
    modules = fsdp_modules(model)
    layers = [m for m in modules if m is not model]
    for module in layers:
        module.set_reshard_after_forward(False, recurse=False)
    for module in modules:
        module.unshard()
    try:
        yield
    finally:
        for module in layers:
            module.set_reshard_after_forward(model.reshard_layers, recurse=False)
        reshard_all(model)


def full_tensors(model: torch.nn.Module, names: Iterable[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) for every checkpoint-format tensor of `model` (or those in `names`), one at a
    time: a sharded one is gathered from the ranks when it is reached (every rank must iterate, in the
    same order), so at most one extra full tensor exists at once."""
    from torch.distributed.tensor import DTensor

    wanted = None if names is None else set(names)
    for name, tensor in unwrap(model).state_dict().items():
        if wanted is None or name in wanted:
            yield name, (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach()


def full_parameters(model: torch.nn.Module, names: Iterable[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) for the parameters named `names`, in `named_parameters` order: `full_tensors` without
    building the whole state_dict (a LoRA push reads a few small tensors every step). Every rank must iterate."""
    from torch.distributed.tensor import DTensor

    wanted = set(names)
    for name, param in unwrap(model).named_parameters():
        if name in wanted:
            yield name, (param.full_tensor() if isinstance(param, DTensor) else param).detach()


def grad_norm_tensor(norm: torch.Tensor) -> torch.Tensor:
    """clip_grad_norm_'s result as a plain tensor on this rank's device (a DTensor over sharded gradients:
    its full value, a collective every rank runs); reading it as a float is the caller's one sync."""
    from torch.distributed.tensor import DTensor

    return norm.full_tensor() if isinstance(norm, DTensor) else norm
