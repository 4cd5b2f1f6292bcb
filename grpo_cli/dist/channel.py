"""The lines between a split job's trainer ranks and its generator ranks (rollout.placement=split, docs/async.md).

A split job of W processes has T = W - N trainer ranks (0 .. T-1) and N generator ranks (T .. W-1). Over the
launcher's store (never torch.distributed's default group for a generator: a vLLM engine started in a process
that has joined a default group takes that group for its own world and builds its groups over every rank of it):
- the trainers' group, the trainer ranks' default group (FSDP2, the loop's collectives), when T > 1;
- a `Channel` from trainer rank 0 to each generator: engine calls and their answers, in order;
- a `Fanout` from trainer rank 0 to every generator at once: the weights after each optimizer step, broadcast
  once rather than sent N times.
"""

from __future__ import annotations

import datetime
import pickle
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from grpo_cli.dist.launch import join_job

if TYPE_CHECKING:
    import torch

_LINKS: Links | None = None
# How long a generator waits on the trainer: without bound in practice. It is idle whenever the trainer works
# (loading a 7B before "start"; with max_staleness=0 through the rewards, the update and a checkpoint; its answer
# to a generate waits until the trainer takes it), so dist.timeout_s there would take a healthy job down (issue
# 39). A trainer that dies still ends the wait at once: its socket closes ("closed by peer"), and the launcher
# stops the other ranks. The trainer keeps dist.timeout_s, naming a generator that stops answering.
# (timedelta.max overflows gloo's milliseconds into a negative wait that fails at once; ten years does not.)
GENERATOR_WAIT = datetime.timedelta(days=3650)


def _as_bytes(obj: Any) -> torch.Tensor:
    import torch

    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)  # [n]


class Channel:
    """Messages between this rank and one peer over a two-rank gloo group (tag 0, in order)."""

    def __init__(self, group: Any, peer: int, timeout_s: float) -> None:
        self.group, self.peer, self.timeout_s = group, peer, timeout_s

    def send(self, obj: Any) -> None:
        """A picklable object to the peer."""
        import torch

        payload = _as_bytes(obj)  # [n]
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


class Fanout:
    """Trainer rank 0 (the group's rank 0) to every generator at once: gloo broadcasts over a group of the N + 1."""

    def __init__(self, group: Any, timeout_s: float) -> None:
        self.group, self.timeout_s = group, timeout_s

    def _broadcast(self, tensor: torch.Tensor) -> None:
        self.group.broadcast(tensor, 0).wait()

    def send(self, obj: Any) -> None:
        """A picklable object to every generator (trainer rank 0's side)."""
        import torch

        payload = _as_bytes(obj)  # [n]
        self._broadcast(torch.tensor([payload.numel()], dtype=torch.int64))
        self._broadcast(payload)

    def recv(self) -> Any:
        """Trainer rank 0's next object (a generator's side)."""
        import torch

        size = torch.zeros(1, dtype=torch.int64)
        self._broadcast(size)
        payload = torch.empty(int(size), dtype=torch.uint8)
        self._broadcast(payload)
        return pickle.loads(payload.numpy().tobytes())

    def send_tensor(self, tensor: torch.Tensor) -> None:
        """A tensor's data; the generators know its shape and dtype (sent before as an object)."""
        self._broadcast(tensor.detach().to("cpu").contiguous())

    def recv_tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        import torch

        out = torch.empty(shape, dtype=dtype)
        self._broadcast(out)
        return out


@dataclass
class Links:
    """A split-job rank's lines: trainer rank 0 has a channel to each generator (in generator order) and the fanout;
    a generator its channel to trainer rank 0 and the fanout; another trainer rank none (it talks to its peers
    over the trainers' group only)."""
    channels: list[Channel]
    fanout: Fanout | None


def connect(rank: int, trainers: int, world_size: int, timeout_s: float) -> Links:
    """This split-job rank's lines (kept for `current`) and, on a trainer rank of several, the trainers' default
    group. Trainers' waits are bounded by `timeout_s` (dist.timeout_s), a generator's by GENERATOR_WAIT. Every rank
    builds the groups it is in in the same order (channel 0, 1, .., then the fanout), so none waits on a peer
    that waits on another."""
    import torch.distributed as torch_dist

    global _LINKS
    store, rank_, world = next(torch_dist.rendezvous("env://", timeout=datetime.timedelta(seconds=timeout_s)))
    assert (rank_, world) == (rank, world_size), (rank_, world, rank, world_size)
    generators = world_size - trainers

    def group(prefix: str, member: int, size: int, wait: datetime.timedelta) -> Any:
        return torch_dist.ProcessGroupGloo(torch_dist.PrefixStore(prefix, store), member, size, wait)

    bounded = datetime.timedelta(seconds=timeout_s)
    if rank < trainers:
        if trainers > 1:
            join_job(timeout_s, store=torch_dist.PrefixStore("grpo_trainers/", store), rank=rank, world_size=trainers)
        if rank > 0:
            _LINKS = Links([], None)
        else:
            channels = [Channel(group(f"grpo_split/{g}/", 0, 2, bounded), 1, timeout_s) for g in range(generators)]
            _LINKS = Links(channels, Fanout(group("grpo_fanout/", 0, generators + 1, bounded), timeout_s))
    else:
        g = rank - trainers
        line = Channel(group(f"grpo_split/{g}/", 1, 2, GENERATOR_WAIT), 0, timeout_s)
        _LINKS = Links([line], Fanout(group("grpo_fanout/", 1 + g, generators + 1, GENERATOR_WAIT), timeout_s))
    return _LINKS


def current() -> Links:
    """The lines `connect` opened in this process."""
    assert _LINKS is not None, "no split-job lines: the CLI opens them (dist.channel.connect)"
    return _LINKS
