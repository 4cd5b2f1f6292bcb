"""`RemoteEngine`: the engine of a split job's generator rank, as the trainer's loop sees it (docs/async.md).

Each engine call goes to the generator over the job's channel (dist/channel.py) and waits for the answer,
except `start_generate`, which returns at once so that the generator samples while the trainer steps
(rollout.max_staleness > 0). After each optimizer step the weights go over tensor by tensor. The generator
side, which answers these calls, is `grpo_cli.generator.serve`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpo_cli.dist.channel import Channel
from grpo_cli.engines.base import Completion, LeafEngine, Replies, Request, Rollouts, Sampling
from grpo_cli.errors import RunFailure

if TYPE_CHECKING:
    import torch

GENERATOR_RANK = 1  # rank 0 trains


class RemoteEngine(LeafEngine):
    """The generator rank's engine, as the trainer's loop sees it (the whole `Engine` protocol)."""

    in_process = False  # the generator samples in its own process, beside this one's update

    def __init__(self, channel: Channel, tokenizer: Any) -> None:
        self.channel, self.tokenizer = channel, tokenizer
        # the generator starts its engine from the base as its own node resolves model.name_or_path (builtin:NAME
        # lives where that node installed grpo_cli, issue 54); the answer says how it takes LoRA
        self.adapters = self._call("start")

    def _call(self, name: str, *args: Any) -> Any:
        self.channel.send((name, args))
        return self._answer(name)

    def _answer(self, name: str) -> Any:
        """The generator's answer to `name`; one line naming the generator when it hangs or dies."""
        try:
            return self.channel.recv()
        except RuntimeError as e:  # gloo: "Timed out waiting ... for recv"
            if "Timed out" not in str(e):
                raise  # the generator died ("closed by peer"): its line and the launcher's say why (cli._peer_failed)
            raise RunFailure(f"generator rank {GENERATOR_RANK} hung: no answer to '{name}' within "
                             f"dist.timeout_s={self.channel.timeout_s:g} s") from e

    def generate(self, prompt_ids: list[list[int]], sampling: Sampling, seeds: list[int],
                 rows: list[dict] | None = None) -> Rollouts:
        return self._call("generate", prompt_ids, sampling, seeds, rows)

    def start_generate(self, prompt_ids: list[list[int]], sampling: Sampling, seeds: list[int],
                       rows: list[dict] | None = None) -> Callable[[], tuple[Rollouts, float]]:
        """Start sampling on the generator and return at once; the returned call waits for (rollouts, the
        generator's seconds)."""
        self.channel.send(("generate_timed", (prompt_ids, sampling, seeds, rows)))
        return lambda: self._answer("generate")

    def generate_each(self, requests: list[Request], on_finish: Callable[[Any, Completion], Request | None],
                      replies: Replies | None = None) -> None:
        """The tool loop runs on the generator rank, around its own engine: its requests never cross the channel."""
        raise RuntimeError("generate_each of a split job's engine: the generator rank runs the tool loop itself")

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        return self._call("score", sequences)

    def read_weights(self, names: Iterable[str]) -> dict[str, Any]:
        return self._call("read_weights", list(names))

    def read_adapter(self, modules: Iterable[str]) -> dict[str, tuple[Any, Any]]:
        return self._call("read_adapter", list(modules))

    def load_adapter(self, directory: str | Path | None) -> None:
        self._call("load_adapter", str(directory) if directory is not None else None)

    def push_adapter(self, tensors: dict[str, Any], config: dict[str, Any]) -> None:
        self._call("push_adapter", {k: v.detach().to("cpu") for k, v in tensors.items()}, config)

    def push_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Tensor by tensor: its name, shape and dtype, then its data; the generator's engine loads each as it
        comes (never the whole model in extra memory on either side)."""
        self.channel.send(("push_weights", ()))
        for name, tensor in named_tensors:
            self.channel.send((name, tuple(tensor.shape), tensor.dtype))
            self.channel.send_tensor(tensor)
        self.channel.send(None)
        self._answer("push_weights")  # the engine has them all

    def sleep(self) -> None:  # the generator has its device to itself: nothing to free for the trainer
        pass

    def wake_weights(self) -> None:
        pass

    def wake_kv_cache(self) -> None:
        pass

    def step_metrics(self) -> dict[str, float]:
        """The generator process's peak resident memory (the trainer's is memory/peak_rss_gib)."""
        return {"memory/generator_peak_rss_gib": self._call("peak_rss_gib")}

    def close(self) -> None:
        """The run is over (or stopping): the generator leaves `serve`."""
        self.channel.send(("stop", ()))
