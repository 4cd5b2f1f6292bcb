"""rollout.placement=split: a rank that only generates (docs/async.md).

In a split job rank 0 trains alone (the policy, the reference, the optimizer, the loop, every file) and rank 1
holds a vLLM engine and nothing else. The trainer's `state.engine` is a `RemoteEngine`: each engine call goes
to the generator over the job's channel (dist/channel.py) and waits for the answer, except `start_generate`,
which returns at once so that the generator samples while the trainer steps (rollout.max_staleness > 0). After
each optimizer step the weights go over tensor by tensor, and the push check re-scores its probes in the
generator's engine. The generator runs `serve`: it answers calls in the order they come until told to stop.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from grpo_cli.config import TrainConfig

if TYPE_CHECKING:
    import torch

    from grpo_cli.dist.channel import Channel
    from grpo_cli.rollout import Rollouts, Sampling
    from grpo_cli.setup import Task

GENERATOR_RANK = 1  # rank 0 trains
# The engine calls the generator answers by calling its engine's method of the same name, with the same arguments
FORWARDED = ("generate", "score", "read_weights", "read_adapter", "push_adapter")


class RemoteEngine:
    """The generator rank's engine, as the trainer's loop sees it (rollout.Engine)."""

    def __init__(self, channel: Channel, tokenizer: Any, model_path: str) -> None:
        self.channel, self.tokenizer = channel, tokenizer
        self.adapters = self._call("start", model_path)  # the generator starts its engine; how it takes LoRA

    def _call(self, name: str, *args: Any) -> Any:
        self.channel.send((name, args))
        return self._answer(name)

    def _answer(self, name: str) -> Any:
        """The generator's answer to `name`; one line naming the generator when it hangs or dies."""
        from grpo_cli.errors import RunFailure

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

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        return self._call("score", sequences)

    def read_weights(self, names: Iterable[str]) -> dict[str, Any]:
        return self._call("read_weights", list(names))

    def read_adapter(self, modules: Iterable[str]) -> dict[str, tuple[Any, Any]]:
        return self._call("read_adapter", list(modules))

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

    def peak_rss_gib(self) -> float:
        """The generator process's peak resident memory (the trainer's is memory/peak_rss_gib)."""
        return self._call("peak_rss_gib")

    def close(self) -> None:
        """The run is over (or stopping): the generator leaves `serve`."""
        self.channel.send(("stop", ()))


def is_generator_rank(cfg: TrainConfig) -> bool:
    """Whether this process is the generator rank of a split job (it runs `serve`, not the training loop)."""
    return cfg.rollout.placement == "split" and int(os.environ.get("RANK", "0")) == GENERATOR_RANK


def generator_metrics(engine: Any) -> dict[str, float]:
    """The generator rank's step metrics (its peak memory) in a split job; {} otherwise."""
    return {"memory/generator_peak_rss_gib": engine.peak_rss_gib()} if isinstance(engine, RemoteEngine) else {}


def stop_generator(engine: Any) -> None:
    """At the end of a split job's run (every rank done): the generator rank leaves `serve`."""
    if isinstance(engine, RemoteEngine):
        engine.close()


def serve(cfg: TrainConfig, task: Task) -> int:
    """The generator rank's whole run: answer the trainer's engine calls, over the channel the CLI opened,
    until it says stop. Ctrl-C is the trainer's to act on (it checkpoints, then says stop)."""
    from grpo_cli.dist.channel import current
    from grpo_cli.metrics import peak_rss_gib
    from grpo_cli.rollout import VLLMEngine
    from grpo_cli.tools.trajectories import with_tools

    channel = current()

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    engine: Any = None
    while True:
        name, args = channel.recv()
        if name == "stop":
            return 0
        if name == "start":  # the start point's weights (a resume's checkpoint, or the base)
            inner = VLLMEngine(args[0], cfg.model, cfg.rollout, cfg.trainer.seed, cfg.logging.verbose_libraries)
            engine = with_tools(inner, task.tools, cfg.rollout)
            channel.send(inner.adapters)
        elif name == "push_weights":
            engine.push_weights(_incoming(channel))
            channel.send(None)
        elif name == "generate_timed":
            tick = time.time()
            rollouts = engine.generate(*args)
            channel.send((rollouts, time.time() - tick))
        elif name == "peak_rss_gib":
            channel.send(peak_rss_gib())
        elif name in FORWARDED:
            channel.send(getattr(_innermost(engine, name), name)(*args))
        else:
            raise RuntimeError(f"the trainer asked the generator for '{name}', which it does not know")


def _incoming(channel: Channel) -> Iterator[tuple[str, torch.Tensor]]:
    while (header := channel.recv()) is not None:
        name, shape, dtype = header
        yield name, channel.recv_tensor(shape, dtype)


def _innermost(engine: Any, method: str) -> Any:
    """The engine itself, or the one a tool wrapper holds when only that has `method` (read_weights, ...)."""
    while not hasattr(engine, method) and hasattr(engine, "engine"):
        engine = engine.engine
    return engine
