"""The process around a command: CPU threads, its peak memory, and the third-party libraries' progress bars and
chatter."""

from __future__ import annotations

import logging
import os
import resource
import sys


def usable_cpus() -> int:
    """The cores this process may run on: its CPU set (a container's or taskset's), not the machine's count."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # no sched_getaffinity (macOS)
        return os.cpu_count() or 1


def cpu_threads(requested: int, processes_per_node: int = 1) -> int:
    """trainer.threads, or (0) this process's share of the cores it may run on."""
    return requested or max(1, usable_cpus() // processes_per_node)


def set_threads(threads: int) -> None:
    """torch's CPU threads, and OMP_NUM_THREADS before any vLLM engine starts: vLLM's CPU backend keeps
    OMP_NUM_THREADS when it is set (else it drops torch to one thread) and then turns
    torch.set_num_threads into a no-op for the whole process (docs/design.md)."""
    import torch

    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    torch.set_num_threads(threads)


# ---------------------------------------------------------------------------
# third-party chatter

QUIET_ENV = {
    "VLLM_LOGGING_LEVEL": "ERROR",  # vLLM reads it when first imported
    "TRANSFORMERS_VERBOSITY": "error",
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",  # also turns off transformers' "Loading weights" bars
    "TQDM_DISABLE": "1",  # any other tqdm bar that does not pass disable= itself
}
QUIET_LOGGERS = ("vllm", "transformers", "datasets", "huggingface_hub", "filelock", "urllib3")


def quiet_third_party(verbose: bool) -> None:
    """Silence vLLM's, datasets' and transformers' progress bars and log chatter, unless `verbose`.

    Call it before those libraries are imported (their env variables are read at import); modules already
    imported are quieted through their own APIs. Variables the user set explicitly are left alone.
    """
    if verbose:
        return
    import warnings

    # vLLM touches a deprecated torch.distributed name at import when a process group exists (a torchrun rank)
    warnings.filterwarnings("ignore", message=r".*torch\.distributed\.reduce_op.* is deprecated", category=FutureWarning)
    user_set = {key for key in QUIET_ENV if key in os.environ}
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    for name in QUIET_LOGGERS:
        if name == "vllm" and "VLLM_LOGGING_LEVEL" in user_set:
            continue
        logging.getLogger(name).setLevel(logging.ERROR)
    if "datasets" in sys.modules:  # already imported: its env variables were read; quiet it through its API
        import datasets

        datasets.disable_progress_bars()
        datasets.logging.set_verbosity_error()
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    if "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()


def peak_rss_gib() -> float:
    """This process's peak resident memory so far, GiB (host memory: weights, engine, activations on the CPU)."""
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return kib / 2**20
