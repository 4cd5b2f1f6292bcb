"""`RemoteEngine`: a split job's generator ranks, as the trainer ranks' loop sees them (docs/async.md).

Trainer rank 0 speaks for the trainers: each engine call goes over its channel to every generator that takes a
part in it (dist/channel.py), and the answer reaches the other trainer ranks over their group, so every trainer
rank makes the same calls and gets the same answers, as with an engine of its own. A step's prompts are cut into
one contiguous share per generator, each sampled from its own seeds, so the samples do not depend on the number
of generators. `start_generate` returns at once, so that the generators sample while the trainers step
(rollout.max_staleness > 0). After each optimizer step the weights go out tensor by tensor, broadcast once to
every generator (the fanout). The generator side, which answers these calls, is `grpo_cli.step.generator.serve`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpo_cli.dist.channel import Channel, Links
from grpo_cli.dist.ranks import Dist, contiguous_share
from grpo_cli.engines.base import Completion, LeafEngine, Replies, Request, Rollouts, Sampling
from grpo_cli.errors import RunFailure

if TYPE_CHECKING:
    import torch


class RemoteEngine(LeafEngine):
    """The generator ranks' engines, as one engine of the trainer ranks' loop (the whole `Engine` protocol)."""

    in_process = False  # the generators sample in their own processes, beside this one's update

    def __init__(self, links: Links, dist: Dist, tokenizer: Any) -> None:
        self.channels, self.fanout, self.dist, self.tokenizer = links.channels, links.fanout, dist, tokenizer
        self.first_generator = dist.world_size  # the generators' global ranks follow the trainers'
        # each generator starts its engine from the base as its own node resolves model.name_or_path (builtin:NAME
        # lives where that node installed grpo_cli, issue 54); the answer says how it takes LoRA
        self.adapters = self._shared(lambda: self._call_all("start")[0])

    def _shared(self, on_rank0: Callable[[], Any]) -> Any:
        """Trainer rank 0's `on_rank0()` on every trainer rank (the others do not call it)."""
        return self.dist.broadcast(on_rank0() if self.dist.is_main else None)

    def _call_all(self, name: str, *args: Any) -> list[Any]:
        """Trainer rank 0: `name` to every generator, then each one's answer, in generator order."""
        for line in self.channels:
            line.send((name, args))
        return [self._answer(g, name) for g in range(len(self.channels))]

    def _answer(self, g: int, name: str) -> Any:
        """Generator g's answer to `name`; one line naming the generator's rank when it hangs or dies."""
        line: Channel = self.channels[g]
        try:
            return line.recv()
        except RuntimeError as e:  # gloo: "Timed out waiting ... for recv"
            if "Timed out" not in str(e):
                raise  # the generator died ("closed by peer"): its line and the launcher's say why (cli._peer_failed)
            raise RunFailure(f"generator rank {self.first_generator + g} hung: no answer to '{name}' within "
                             f"dist.timeout_s={line.timeout_s:g} s") from e

    def generate(self, prompt_ids: list[list[int]], sampling: Sampling, seeds: list[int],
                 rows: list[dict] | None = None) -> Rollouts:
        return self.gather_shares(self.start_generate(prompt_ids, sampling, seeds, rows)()[0])

    def start_generate(self, prompt_ids: list[list[int]], sampling: Sampling, seeds: list[int],
                       rows: list[dict] | None = None) -> Callable[[], tuple[Rollouts, float]]:
        """Start sampling on the generators (each its contiguous share of the prompts) and return at once; the
        returned call waits for (every share in prompt order, the slowest generator's seconds) on trainer rank 0,
        (None, 0.0) on the others, which `gather_shares` then gives rank 0's rollouts."""
        if not self.dist.is_main:
            return lambda: (None, 0.0)  # type: ignore[return-value]
        asked = []
        for g, line in enumerate(self.channels):
            share = contiguous_share(len(prompt_ids), g, len(self.channels))
            if share:  # fewer prompts than generators: the last ones sit this one out
                line.send(("generate_timed", (prompt_ids[share.start:share.stop], sampling,
                                              seeds[share.start:share.stop],
                                              rows[share.start:share.stop] if rows is not None else None)))
                asked.append(g)

        def wait() -> tuple[Rollouts, float]:
            answers = [self._answer(g, "generate") for g in asked]
            return Rollouts.concat([part for part, _ in answers]), max(seconds for _, seconds in answers)

        return wait

    def gather_shares(self, part: Rollouts) -> Rollouts:
        """Every generator's samples, gathered on trainer rank 0: to every trainer rank (a collective when several)."""
        return self.dist.broadcast(part)

    def generate_each(self, requests: list[Request], on_finish: Callable[[Any, Completion], Request | None],
                      replies: Replies | None = None) -> None:
        """The tool loop runs on the generator ranks, around their own engines: its requests never cross a channel."""
        raise RuntimeError("generate_each of a split job's engine: the generator ranks run the tool loop themselves")

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        """Generator 0's logprobs (the push check; every generator holds the same weights: `read_weights`)."""
        return self._shared(lambda: self._call_one("score", sequences))

    def _call_one(self, name: str, *args: Any) -> Any:
        self.channels[0].send((name, args))
        return self._answer(0, name)

    def read_weights(self, names: Iterable[str]) -> dict[str, Any]:
        """Generator 0's tensors, once every other generator's are found equal to them in every bit."""
        return self._same_on_every_generator("read_weights", list(names))

    def read_adapter(self, modules: Iterable[str]) -> dict[str, tuple[Any, Any]]:
        return self._same_on_every_generator("read_adapter", list(modules))

    def _same_on_every_generator(self, name: str, args: list[str]) -> dict[str, Any]:
        def ask() -> tuple[dict[str, Any], str | None]:
            held = self._call_all(name, args)
            for g, theirs in enumerate(held[1:], start=1):
                if not _equal(theirs, held[0]):
                    return {}, (f"generator rank {self.first_generator + g} holds other weights than generator rank "
                                f"{self.first_generator} after the same broadcast ({', '.join(args)})")
            return held[0], None

        tensors, problem = self._shared(ask)
        if problem:
            raise RunFailure(problem)
        return tensors

    def load_adapter(self, directory: str | Path | None) -> None:
        if self.dist.is_main:
            self._call_all("load_adapter", str(directory) if directory is not None else None)

    def push_adapter(self, tensors: dict[str, Any], config: dict[str, Any]) -> None:
        """The adapters, broadcast once to every generator."""
        if not self.dist.is_main:
            return
        for line in self.channels:
            line.send(("push_adapter", ()))
        self.fanout.send(({k: v.detach().to("cpu") for k, v in tensors.items()}, config))
        [self._answer(g, "push_adapter") for g in range(len(self.channels))]

    def push_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Tensor by tensor, broadcast once to every generator: its name, shape and dtype, then its data; each
        generator's engine loads each as it comes (never the whole model in extra memory on either side). Every
        trainer rank walks `named_tensors` (a sharded policy's tensors are gathered as they come, a collective);
        rank 0 sends them."""
        if not self.dist.is_main:
            for _ in named_tensors:
                pass
            return
        for line in self.channels:
            line.send(("push_weights", ()))
        for name, tensor in named_tensors:
            self.fanout.send((name, tuple(tensor.shape), tensor.dtype))
            self.fanout.send_tensor(tensor)
        self.fanout.send(None)
        [self._answer(g, "push_weights") for g in range(len(self.channels))]  # every engine has them all

    def sleep(self) -> None:  # the generators have their devices to themselves: nothing to free for the trainer
        pass

    def wake_weights(self) -> None:
        pass

    def wake_kv_cache(self) -> None:
        pass

    def step_metrics(self) -> dict[str, float]:
        """The largest peak resident memory of a generator process (the trainer's is memory/peak_rss_gib)."""
        return {"memory/generator_peak_rss_gib": self._shared(lambda: max(self._call_all("peak_rss_gib")))}

    def close(self) -> None:
        """The run is over (or stopping): the generators leave `serve`."""
        if self.dist.is_main:
            for line in self.channels:
                line.send(("stop", ()))


def _equal(a: Any, b: Any) -> bool:
    """Whether two answers of read_weights / read_adapter hold the same tensors, bit for bit."""
    import torch

    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b
