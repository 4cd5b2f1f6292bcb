"""rollout.placement=split: a rank that only generates (docs/async.md).

In a split job rank 0 trains alone (the policy, the reference, the optimizer, the loop, every file) and rank 1
holds a vLLM engine and nothing else. The trainer's `state.engine` is an `engines.remote.RemoteEngine`: each
engine call comes here over the job's channel (dist/channel.py). The generator runs `serve`: it answers calls
in the order they come until told to stop.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from grpo_cli.config import TrainConfig
from grpo_cli.dist.channel import Channel, current
from grpo_cli.engines.remote import GENERATOR_RANK
from grpo_cli.engines.tools import with_tools
from grpo_cli.engines.vllm import VLLMEngine
from grpo_cli.runtime import peak_rss_gib
from grpo_cli.state import Task

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

# The engine calls the generator answers by calling its engine's method of the same name, with the same arguments
FORWARDED = ("generate", "score", "read_weights", "read_adapter", "push_adapter", "load_adapter")


def is_generator_rank(cfg: TrainConfig) -> bool:
    """Whether this process is the generator rank of a split job (it runs `serve`, not the training loop)."""
    return cfg.rollout.placement == "split" and int(os.environ.get("RANK", "0")) == GENERATOR_RANK


def serve(cfg: TrainConfig, task: Task) -> int:
    """The generator rank's whole run: answer the trainer's engine calls, over the channel the CLI opened,
    until it says stop. Ctrl-C is the trainer's to act on (it checkpoints, then says stop)."""
    channel = current()

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    engine: Any = None
    while True:
        name, args = channel.recv()
        if name == "stop":
            return 0
        if name == "start":  # the base as this node resolved it (preflight); a resume's weights come as a push.
            # The engine never sleeps, its GPU holds no trainer (engines.options.sleep_wanted), and it is this
            # rank's own (cli.py)
            log.info("generator: the engine starts from %s (model.name_or_path=%s on this node)", task.model_path,
                     cfg.model.name_or_path)
            engine = with_tools(VLLMEngine(task.model_path, cfg.model, cfg.rollout, cfg.trainer.seed,
                                           cfg.logging.verbose_libraries), task.tools, cfg.rollout)
            channel.send(engine.adapters)
        elif name == "push_weights":
            engine.push_weights(_incoming(channel))
            channel.send(None)
        elif name == "generate_timed":
            tick = time.time()
            rollouts = engine.generate(*args)
            channel.send((rollouts, time.time() - tick))
        elif name == "peak_rss_gib":
            channel.send(peak_rss_gib())
        elif name in FORWARDED:  # a tool wrapper forwards what it does not change to the vLLM engine
            channel.send(getattr(engine, name)(*args))
        else:
            raise RuntimeError(f"the trainer asked the generator for '{name}', which it does not know")


def _incoming(channel: Channel) -> Iterator[tuple[str, torch.Tensor]]:
    while (header := channel.recv()) is not None:
        name, shape, dtype = header
        yield name, channel.recv_tensor(shape, dtype)
