"""The one seam for ranks and devices: who this process is, where its tensors live, and the
few collectives the training loop needs.

At world size 1 (a plain `grpo train`) every collective returns its input, so the loop never
branches on "is this distributed"; the device is trainer.device (the CPU on a machine without CUDA). Under a launcher that sets
`WORLD_SIZE` > 1 (torchrun), `Dist.init` joins the process group and the same calls become
real all-reduces and broadcasts over it.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from grpo_cli.dist.launch import join_job

if TYPE_CHECKING:
    import torch

COLLECTIVE_SECONDS = [0.0]  # time this process has spent in Dist's collectives (the `dist/collective_s` metric)


@contextlib.contextmanager
def _timed() -> Iterator[None]:
    tick = time.perf_counter()
    try:
        yield
    finally:
        COLLECTIVE_SECONDS[0] += time.perf_counter() - tick


def contiguous_share(count: int, index: int, parts: int) -> range:
    """Part `index` of 0..count-1 cut into `parts` contiguous pieces (the first ones one longer when it does
    not divide; the last ones empty when count < parts): ranks' prompts, an engine's prompts, a rank's groups."""
    size, extra = divmod(count, parts)
    start = index * size + min(index, extra)
    return range(start, start + size + (index < extra))


def split_roles(trainers: int, world_size: int) -> str:
    """Which ranks of a split job (rollout.placement=split) do what, in words: "3 processes: ranks 0-1 train (FSDP2),
    rank 2 generates". The trainers are the first ranks, the generators the last (config.TrainConfig.trainer_ranks)."""

    def ranks(first: int, last: int) -> str:
        return f"rank {first}" if first == last else f"ranks {first}-{last}"

    train = f"{ranks(0, trainers - 1)} train{'s' if trainers == 1 else ' (FSDP2)'}"
    generate = f"{ranks(trainers, world_size - 1)} generate{'s' if world_size - trainers == 1 else ''}"
    return f"{world_size} processes: {train}, {generate}"


def gpu_roles(trainers: int, nproc_per_node: int, nnodes: int) -> str:
    """Which GPU of which node each rank of a split job holds (each rank takes its node's LOCAL_RANK-th GPU: a
    trainer through trainer.device=auto, a generator shown only that one, launch.bind_generator_gpu)."""
    nodes = []
    for node in range(nnodes):
        kinds = [("trains" if node * nproc_per_node + local < trainers else "generates") for local in range(nproc_per_node)]
        parts = []
        for kind in ("trains", "generates"):
            gpus = [i for i, k in enumerate(kinds) if k == kind]
            if gpus:
                held = f"GPU {gpus[0]}" if len(gpus) == 1 else f"GPUs {gpus[0]}-{gpus[-1]}"
                parts.append(f"{held} {kind if len(gpus) == 1 else kind.removesuffix('s')}")
        nodes.append((f"node {node}: " if nnodes > 1 else "") + ", ".join(parts))
    return "; ".join(nodes)


@dataclass(frozen=True)
class Dist:
    rank: int = 0  # this process's index in the job, 0..world_size-1
    world_size: int = 1  # processes in the job
    local_rank: int = 0  # index among the processes on this node (picks the GPU on a CUDA node)
    device: torch.device | str = "cpu"  # the device every tensor of the loop is made on

    @classmethod
    def init(cls, device: str = "cpu", trainers: int | None = None) -> Dist:
        """This process's place in the job, from the launcher's environment (none: one process). `trainers`: a
        split job's trainer ranks (rollout.placement=split), which train among themselves, in a group of their own
        (dist/channel.py); None: every rank of the job trains.

        `device` is trainer.device: "auto" is cuda:LOCAL_RANK when CUDA is present, else the CPU.
        """
        import torch

        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if device == "auto":
            device = f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"
        elif device == "cuda":
            device = f"cuda:{local_rank}"
        chosen = torch.device(device)
        if chosen.type == "cuda":
            torch.cuda.set_device(chosen)
        world_size = trainers or int(os.environ.get("WORLD_SIZE", "1"))
        if world_size == 1:
            return cls(device=chosen)
        import torch.distributed as torch_dist

        if not torch_dist.is_initialized():  # the CLI joins the job first (launch.join_job); scripts land here

            join_job(600)
        return cls(rank=torch_dist.get_rank(), world_size=world_size, local_rank=local_rank, device=chosen)

    def autocast(self, dtype: str) -> contextlib.AbstractContextManager:
        """The forward passes' compute context: bf16/fp16 autocast over fp32 master weights on CUDA;
        nothing on the CPU, where the weights themselves are in `dtype` (float32 by default)."""
        import contextlib

        import torch

        if torch.device(self.device).type != "cuda" or dtype == "float32":
            return contextlib.nullcontext()
        return torch.autocast("cuda", dtype=getattr(torch, dtype))  # "bfloat16" | "float16"

    def master_dtype(self, dtype: str) -> str:
        """The dtype the trainable weights are loaded in: float32 on CUDA (autocast computes in `dtype`),
        `dtype` itself on the CPU, as before."""
        import torch

        return "float32" if torch.device(self.device).type == "cuda" else dtype

    @property
    def is_main(self) -> bool:
        """Rank 0 writes logs, metrics and checkpoints."""
        return self.rank == 0

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sum of `values` over ranks (float64, so counts and token sums stay exact)."""
        if self.world_size == 1:
            return list(values)
        import torch
        import torch.distributed as torch_dist

        buffer = torch.tensor(values, dtype=torch.float64)  # [n]
        with _timed():
            torch_dist.all_reduce(buffer, op=torch_dist.ReduceOp.SUM)
        return buffer.tolist()

    def any(self, flag: bool) -> bool:
        """True if `flag` is true on some rank (e.g. a Ctrl-C that reached one rank stops them all)."""
        if self.world_size == 1:
            return flag
        return self.sum([1.0 if flag else 0.0])[0] > 0.0

    def share(self, count: int) -> range:
        """This rank's contiguous part of `count` items (the first ranks take one more when it does not divide)."""
        return contiguous_share(count, self.rank, self.world_size)

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj` (picklable), in rank order, on every rank."""
        if self.world_size == 1:
            return [obj]
        import torch.distributed as torch_dist

        out: list[Any] = [None] * self.world_size
        with _timed():
            torch_dist.all_gather_object(out, obj)
        return out

    def all(self, flag: bool) -> bool:
        """True only if `flag` is true on every rank: one decision (e.g. skip a non-finite step) for all."""
        if self.world_size == 1:
            return flag
        return self.sum([0.0 if flag else 1.0])[0] == 0.0

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank (picklable objects: a stop request, a resume decision)."""
        if self.world_size == 1:
            return obj
        import torch.distributed as torch_dist

        box = [obj]
        with _timed():
            torch_dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.world_size > 1:
            import torch.distributed as torch_dist

            torch_dist.barrier()
