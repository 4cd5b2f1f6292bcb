"""`grpo train ... dist.nproc_per_node=N`: the command starting itself under torchrun's agent, and a
worker process joining the job.

`launch` runs torch.distributed's elastic agent in this process (what `torchrun` runs), with the
same command line as the workers' entry point: each worker finds WORLD_SIZE set and trains as one
rank. One node: a private rendezvous on a free local port (torchrun --standalone). Several nodes:
the static rendezvous at dist.rdzv_endpoint, this node being dist.node_rank (torchrun --nnodes
--node-rank --rdzv-endpoint). The plain `torchrun --nproc-per-node N -m grpo_cli train ...`
lands in the same worker path.

What the agent does on a failure (torch/distributed/elastic): when a worker exits non-zero it
stops the others (SIGTERM, SIGKILL after `SHUTDOWN_TIMEOUT_S`) and reports each worker's exit
code; a SIGINT to the agent is forwarded to the workers, which then checkpoint and exit 130.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from typing import TYPE_CHECKING, Any
from grpo_cli.runtime import cpu_threads
from grpo_cli.config import DistConfig

LAUNCHER_PID_ENV = "GRPO_LAUNCHER_PID"  # the agent's pid, for a worker to see whether it is still there

# How long the agent waits for the workers after a Ctrl-C (they end the step and checkpoint) or after
# another worker failed (they are stuck in a collective) before it kills them:
# dist.timeout_s is used: a step, an evaluation and a checkpoint must fit in it.




def under_launcher() -> bool:
    """Whether this process is one rank of a torchrun job (torchrun sets WORLD_SIZE, RANK, LOCAL_RANK)."""
    return "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def log_name(command: str, global_rank: int) -> str:
    """The log file of a rank in the run directory: train.log for rank 0, train-rank1.log, ..."""
    return f"{command}.log" if global_rank == 0 else f"{command}-rank{global_rank}.log"


def join_job(timeout_s: int, store: Any = None, rank: int | None = None, world_size: int | None = None) -> None:
    """A worker's first step: the process group (gloo for CPU tensors, nccl for CUDA ones), with a
    timeout so a rank that died or hangs fails the others' collectives instead of blocking forever. Every rank
    of the job by default; a split job's trainer ranks join one of their own (`store`, `rank`, `world_size`:
    dist/channel.py)."""
    import datetime

    import torch
    import torch.distributed as torch_dist

    if torch_dist.is_initialized():
        return
    die_with_parent()
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    own = {} if store is None else {"store": store, "rank": rank, "world_size": world_size}
    torch_dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **own)


def bind_generator_gpu() -> str | None:
    """A split job's generator rank (rollout.placement=split): show this process only its node's LOCAL_RANK-th
    GPU, before anything starts CUDA here. vLLM's one-process worker takes cuda:0 of the GPUs it sees and sets it
    again over any torch.cuda.set_device made before (vllm/v1/worker/gpu_worker.py), so without this the engine
    starts on the trainer's GPU and leaves its own idle (issue 39). A node with fewer GPUs than that keeps what
    it shows: the engine shares the first GPU with the trainer. Returns the GPU bound, or None."""
    import torch

    if torch.cuda.is_initialized():
        raise RuntimeError("bind_generator_gpu: CUDA already started in this process; it must run before")
    count = torch.cuda.device_count()  # through NVML: counts the GPUs without starting CUDA; 0 on a CPU build
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if count <= local:
        return None
    listed = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    visible = [d.strip() for d in listed.split(",")] if listed else [str(i) for i in range(count)]
    os.environ["CUDA_VISIBLE_DEVICES"] = visible[local]
    return visible[local]


def die_with_parent(signum: int = signal.SIGKILL) -> None:
    """Linux: this worker gets `signum` when its launcher dies. torchrun starts each worker in a session of
    its own, so a `kill -9` of the launcher (or the OOM killer) would otherwise leave the workers running.
    (A distillation teacher's server takes SIGTERM, so it stops its own engine process: teacher.py.)"""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    PR_SET_PDEATHSIG = 1
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signum)
    except OSError:
        return
    launcher = os.environ.get(LAUNCHER_PID_ENV)  # set by `launch`; plain torchrun: not known, not checked
    if launcher and os.getppid() != int(launcher):  # the launcher died before the call
        os._exit(1)


def share_from_rank0(value: Any) -> Any:
    """Rank 0's `value` on every rank (the run directory's name, fixed once per job)."""
    import torch.distributed as torch_dist

    box = [value]
    torch_dist.broadcast_object_list(box, src=0)
    return box[0]


def launch(dist_cfg: DistConfig, argv: list[str]) -> int:
    """Run `python -m grpo_cli train ARGV` as dist.nproc_per_node workers on this node (of dist.nnodes);
    returns the command's exit code: 0, 130 after Ctrl-C, else the first failed rank's."""
    import uuid

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)  # the one line below says it
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # the workers' C++ start-up warnings (NUMA binding)
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())

    os.environ.setdefault("OMP_NUM_THREADS", str(cpu_threads(0, dist_cfg.nproc_per_node)))  # a share of the cores each
    if dist_cfg.nnodes == 1:  # torchrun --standalone: a private rendezvous on a free local port
        rdzv = {"rdzv_backend": "c10d", "rdzv_endpoint": "127.0.0.1:0", "run_id": str(uuid.uuid4())}
    else:  # torchrun --nnodes N --node-rank R --rdzv-endpoint HOST:PORT: node ranks as given
        rdzv = {"rdzv_backend": "static", "rdzv_endpoint": dist_cfg.rdzv_endpoint, "run_id": "grpo",
                "rdzv_configs": {"rank": dist_cfg.node_rank, "timeout": dist_cfg.timeout_s}}
    config = LaunchConfig(min_nodes=dist_cfg.nnodes, max_nodes=dist_cfg.nnodes,
                          nproc_per_node=dist_cfg.nproc_per_node, max_restarts=0, monitor_interval=0.5,
                          shutdown_timeout=dist_cfg.timeout_s, **rdzv)
    interrupted = []
    previous = signal.getsignal(signal.SIGINT)
    started = time.time()
    try:
        elastic_launch(config, sys.executable)("-m", "grpo_cli", "train", *argv)
    except SignalException as e:
        interrupted.append(e.sigval)
    except ChildFailedError as e:
        if all(f.exitcode == 130 for f in e.failures.values()):  # every rank stopped on a Ctrl-C, checkpointed
            return 130
        first_rank, first = min(e.failures.items(), key=lambda kv: kv[1].timestamp)
        code = first.exitcode if first.exitcode > 0 else 1
        print(f"grpo train: error: rank {first_rank} exited with {_describe(first.exitcode)} after "
              f"{time.time() - started:.0f} s; the other ranks were stopped (the rank's own error line, if it could "
              f"print one, is above; its traceback in the run directory's {log_name('train', first_rank)})",
              file=sys.stderr)
        return code
    finally:
        signal.signal(signal.SIGINT, previous)
    return 130 if interrupted else 0


def _describe(exitcode: int) -> str:
    if exitcode < 0:
        try:
            return f"signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"signal {-exitcode}"
    return f"exit code {exitcode}"
