"""The line between the trainer rank and the generator rank of a split job (rollout.placement=split,
docs/async.md): picklable objects and tensors, one way or the other, in order.

It is a gloo process group of the job's two ranks built on the launcher's store, never torch.distributed's
default group: a vLLM engine started in a process that has joined a default group takes that group for its own
world and builds its groups over every rank of it, so the generator must not join one (docs/async.md).
"""

from __future__ import annotations

import datetime
import pickle
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

_CHANNEL: Channel | None = None
# How long the generator's side waits on the trainer: without bound in practice. It is idle whenever the trainer
# works (loading a 7B before "start"; with max_staleness=0 through the rewards, the update and a checkpoint; its
# answer to a generate waits until the trainer takes it), so dist.timeout_s there would take a healthy job down
# (issue 39). A trainer that dies still ends the wait at once: its socket closes ("closed by peer"), and the
# launcher stops the other rank. The trainer keeps dist.timeout_s, naming a generator that stops answering.
# (timedelta.max overflows gloo's milliseconds into a negative wait that fails at once; ten years does not.)
GENERATOR_WAIT = datetime.timedelta(days=3650)


class Channel:
    """Messages between this rank and `peer` over a two-rank gloo group (tag 0, in order)."""

    def __init__(self, rank: int, peer: int, timeout_s: float, wait: datetime.timedelta | None = None) -> None:
        """`timeout_s` bounds the rendezvous, and every send and receive of this side unless `wait` is given (a
        gloo group's timeout is each process's own: it bounds only that process's waits)."""
        import torch.distributed as torch_dist

        store, rank_, world = next(torch_dist.rendezvous("env://", timeout=datetime.timedelta(seconds=timeout_s)))
        assert (rank_, world) == (rank, 2), (rank_, world)
        store = torch_dist.PrefixStore("grpo_split/", store)
        self.group = torch_dist.ProcessGroupGloo(store, rank, world, wait or datetime.timedelta(seconds=timeout_s))
        self.rank, self.peer, self.timeout_s = rank, peer, timeout_s

    def send(self, obj: Any) -> None:
        """A picklable object to the peer."""
        import torch

        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)  # [n]
        self.group.send([torch.tensor([payload.numel()], dtype=torch.int64)], self.peer, 0).wait()
        self.group.send([payload], self.peer, 0).wait()

    def recv(self) -> Any:
        """The peer's next object (waits up to this side's timeout; a peer that died raises "closed by peer")."""
        import torch

        size = torch.zeros(1, dtype=torch.int64)
        self.group.recv([size], self.peer, 0).wait()
        payload = torch.empty(int(size), dtype=torch.uint8)
        self.group.recv([payload], self.peer, 0).wait()
        return pickle.loads(payload.numpy().tobytes())

    def send_tensor(self, tensor: torch.Tensor) -> None:
        """A tensor's data; the peer knows its shape and dtype (sent before as an object)."""
        self.group.send([tensor.detach().to("cpu").contiguous()], self.peer, 0).wait()

    def recv_tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        import torch

        out = torch.empty(shape, dtype=dtype)
        self.group.recv([out], self.peer, 0).wait()
        return out


def connect(rank: int, timeout_s: float) -> Channel:
    """This split-job rank's channel to the other (rank 0 trains, rank 1 generates); kept for `current`. The
    trainer's waits are bounded by `timeout_s` (dist.timeout_s), the generator's by GENERATOR_WAIT."""
    global _CHANNEL
    _CHANNEL = Channel(rank, 1 - rank, timeout_s, None if rank == 0 else GENERATOR_WAIT)
    return _CHANNEL


def current() -> Channel:
    """The channel `connect` opened in this process."""
    assert _CHANNEL is not None, "no split-job channel: the CLI opens it (dist.channel.connect)"
    return _CHANNEL
