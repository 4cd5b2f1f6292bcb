"""rollout.placement=split: the ranks that only generate (docs/async.md).

In a split job the first ranks train (the policy, the reference, the optimizer, the loop; rank 0 writes every
file) and the last rollout.generator_ranks each hold a vLLM engine and nothing else. The trainers' `state.engine`
is an `engines.remote.RemoteEngine`: each engine call comes here from trainer rank 0 over this rank's channel,
and the weights over the fanout that reaches every generator at once (dist/channel.py). A generator runs
`serve`: it answers calls in the order they come until told to stop.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from grpo_cli.config import TrainConfig
from grpo_cli.dist.channel import Fanout, current
from grpo_cli.engines.tools import with_tools
from grpo_cli.engines.vllm import VLLMEngine
from grpo_cli.runtime import peak_rss_gib
from grpo_cli.step.state import Task

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

# The engine calls the generator answers by calling its engine's method of the same name, with the same arguments
FORWARDED = ("generate", "score", "read_weights", "read_adapter", "load_adapter")


def is_generator_rank(cfg: TrainConfig) -> bool:
    """Whether this process is a generator rank of a split job (it runs `serve`, not the training loop)."""
    return cfg.rollout.placement == "split" and int(os.environ.get("RANK", "0")) >= cfg.trainer_ranks


def serve(cfg: TrainConfig, task: Task) -> int:
    """The generator rank's whole run: answer the trainer's engine calls, over the channel the CLI opened,
    until it says stop. Ctrl-C is the trainer's to act on (it checkpoints, then says stop)."""
    links = current()
    channel, fanout = links.channels[0], links.fanout

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    engine: Any = None
    while True:
        name, args = channel.recv()
        if name == "stop":
            return 0
        if name == "start":  # the base as this node resolved it (preflight); a resume's weights come as a push.
            # The engine never sleeps, its GPU holds no trainer (engines.options.sleep_wanted), and it is this
            # rank's own (cli/__init__.py)
            log.info("generator: the engine starts from %s (model.name_or_path=%s on this node)", task.model_path,
                     cfg.model.name_or_path)
            engine = with_tools(VLLMEngine(task.model_path, cfg.model, cfg.rollout, cfg.trainer.seed,
                                           cfg.logging.verbose_libraries), task.tools, cfg.rollout)
            channel.send(engine.adapters)
        elif name == "push_weights":  # the tensors come over the fanout, to every generator at once
            engine.push_weights(_incoming(fanout))
            channel.send(None)
        elif name == "push_adapter":
            engine.push_adapter(*fanout.recv())
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


def _incoming(fanout: Fanout) -> Iterator[tuple[str, torch.Tensor]]:
    while (header := fanout.recv()) is not None:
        name, shape, dtype = header
        yield name, fanout.recv_tensor(shape, dtype)
