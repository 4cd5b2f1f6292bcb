"""FSDP2 for the policy and the reference at world size > 1, and reading full tensors back out of the shards.

`shard_model` puts each decoder layer in its own FSDP2 group (`fully_shard`), and the body
with the lm_head in one more (the embedding and lm_head share a tensor when tied, so they
must be in one group). Two things differ from a stock FSDP2 set-up, both because of how the
loop calls the model:

- The loss reads `lm_head.weight` directly (chunked logprobs, passes.logprobs_from_hidden), and
  the shared prompt pass runs the body once and backpropagates into it after every
  micro-batch (passes.prompt_backward). So parameters stay gathered from the first forward of
  an optimizer step until `reshard_all` after its last backward (reshard_after_forward and
  reshard_after_backward off). At rest (while the engine generates, in the optimizer step)
  every parameter, gradient and AdamW moment is sharded.
- FSDP2 averages gradients over ranks; every rank's loss is already divided by the global
  normalizer (batch.py), so the ranks' gradients must add up: the divide factor is 1.

At world size 1 every function here hands the model back as it is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from grpo_cli.dist.ranks import Dist


def fsdp_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


class ShardedLM(torch.nn.Module):
    """The FSDP2 root: every pass on the model goes through its forward, `sharded(fn, *args)` =
    `fn(model, *args)`, so FSDP2's root hooks (gather the embedding, norm and lm_head; reduce
    their gradients after the backward) run around the loop's own model calls
    (passes.prompt_states, passes.completion_logprobs), which reach into the body and lm_head."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return fn(self.module, *args, **kwargs)


def shard_model(model: torch.nn.Module, dist: Dist) -> torch.nn.Module:
    """`model` at world size 1; else the model in FSDP2 groups (one per decoder layer, the rest in
    the root) inside a `ShardedLM` root. Call it through `run_pass`."""
    if dist.world_size == 1:
        return model
    import warnings

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from grpo_cli.passes import body_and_head

    # FSDP2 warns when a root's output is a view (an in-place op on it would skip its pre-backward hook).
    # The passes return logprobs built out of place (torch.cat, reshape) and nothing writes into them.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPShardedLM\) returned a view tensor")
    # the mesh on the run's device type: without it FSDP2 picks CUDA whenever CUDA exists (trainer.device=cpu too)
    mesh = init_device_mesh(torch.device(dist.device).type, (dist.world_size,))
    body, _ = body_and_head(model)
    for layer in body.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=False)
    root = fully_shard(ShardedLM(model), mesh=mesh, reshard_after_forward=False)
    for module in fsdp_modules(root):
        module.set_reshard_after_backward(False)
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


def gather_all(model: torch.nn.Module) -> None:
    """Gather every group's parameters now (a collective: every rank calls it), so the passes that follow
    need no communication however many each rank runs (generation, a rank's own probes)."""
    for module in fsdp_modules(model):
        module.unshard()


def full_tensors(model: torch.nn.Module, names: Iterable[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) for every checkpoint-format tensor of `model` (or those in `names`), one at a
    time: a sharded one is gathered from the ranks when it is reached (every rank must iterate, in the
    same order), so at most one extra full tensor exists at once."""
    from torch.distributed.tensor import DTensor

    wanted = None if names is None else set(names)
    for name, tensor in unwrap(model).state_dict().items():
        if wanted is None or name in wanted:
            yield name, (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach()


def grad_norm_tensor(norm: torch.Tensor) -> torch.Tensor:
    """clip_grad_norm_'s result as a plain tensor on this rank's device (a DTensor over sharded gradients:
    its full value, a collective every rank runs); reading it as a float is the caller's one sync."""
    from torch.distributed.tensor import DTensor

    return norm.full_tensor() if isinstance(norm, DTensor) else norm
