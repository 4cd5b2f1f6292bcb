"""A distillation teacher served by vLLM (docs/distillation.md): its logprob of every sampled token, over HTTP.

A teacher larger than the trainer's device runs as a vLLM OpenAI-compatible server, started by grpo for the
run (`distill.server=start`: a local model, stopped with the run) or already running (`distill.server=URL`).
Each sample is sent whole (prompt + completion token ids) to `/v1/completions` with `echo`, one generated
token and `prompt_logprobs=0`: vLLM returns the logprob of every token of the text under the teacher, and the
completion's positions are the teacher's grades. Those prompt logprobs are of the untempered distribution,
so a served teacher needs `rollout.temperature=1` (config.py refuses the rest).

The requests run `distill.requests_in_flight` at a time; one that fails is tried `REQUEST_TRIES` times in all (the
rule of every served model, `served.ask`), then the step fails with one line naming the server: a teacher's grade is
part of the loss, never a default.
"""

from __future__ import annotations

import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpo_cli.engines.served import REQUEST_TRIES, Placement, Server, ask
from grpo_cli.engines.served import start_server as start_server_on
from grpo_cli.errors import RunFailure, Unreachable

if TYPE_CHECKING:
    import torch

SERVED_NAME = "teacher"  # the model name a server started here answers to
START_HINT = "set distill.server=start to have grpo start one on distill.teacher"


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

    def __init__(self, url: str, model: str, timeout_s: float, in_flight: int, server: Server | None = None) -> None:
        self.url, self.model, self.timeout_s, self.in_flight = url.rstrip("/"), model, timeout_s, in_flight
        self.server = server  # the server grpo started (stopped by `close`), None for one given by URL

    @property
    def process(self) -> subprocess.Popen | None:
        return self.server.process if self.server is not None else None

    def grade(self, sequence: list[int], start: int) -> list[float]:
        """[len(sequence) - start] the teacher's logprob of each completion token of one sample."""
        body = {"model": self.model, "prompt": sequence, "max_tokens": 1, "echo": True, "prompt_logprobs": 0,
                "temperature": 1.0}
        try:  # served.ask: the retry rule every served model shares; an answer it cannot read is a failed try too
            return ask(f"{self.url}/v1/completions", body, self.timeout_s, REQUEST_TRIES,
                       f"distill.server: the teacher at {self.url}, on one sample,",
                       read=lambda answer: completion_grades(answer["choices"][0], sequence, start))
        except Unreachable as e:  # a teacher cannot be skipped as a reward can: the run stops, in one line
            raise RunFailure(str(e)) from None

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
        """Stop the server grpo started, waiting for it to go."""
        if self.server is not None:
            self.server.stop()
        self.server = None


def start_server(model_path: str, where: Placement, max_model_len: int, log_path: Path, timeout_s: float,
                 timeout_per_request_s: float, in_flight: int) -> ServedTeacher:
    """A vLLM server on the teacher (`served.start_server`), placed `where` says (the trainer's device, the
    weights' dtype, its KV cache), ready within `timeout_s`."""
    server = start_server_on(model_path, SERVED_NAME, ["--dtype", where.dtype, "--max-model-len", str(max_model_len),
                                                       "--enforce-eager"], log_path, timeout_s, "distill.server", where)
    return ServedTeacher(server.url, SERVED_NAME, timeout_per_request_s, in_flight, server)
