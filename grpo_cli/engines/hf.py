"""`HFEngine`: transformers `generate` on the trainer's policy itself (no vLLM needed, slower). It shares the
policy's parameters, so a push is a no-op, and a sharded policy is gathered once per call."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch

from grpo_cli.dist.shard import gathered, run_pass
from grpo_cli.engines.base import Completion, LeafEngine, Replies, Request, Rollouts, Sampling
from grpo_cli.errors import UsageError


class HFEngine(LeafEngine):
    """transformers `generate` on the trainer's policy itself (no vLLM needed, slower)."""

    def __init__(self, policy: torch.nn.Module, tokenizer: Any,
                 autocast: Callable[[], AbstractContextManager] | None = None) -> None:
        self.policy = policy
        self.tokenizer = tokenizer
        self.autocast = autocast or contextlib.nullcontext  # () -> the compute context (bf16 autocast on CUDA)

    adapters = "shared"  # LoRA: the policy's own adapters apply
    in_process = True

    def generate(self, prompt_ids: list[list[int]], sampling: Sampling, seeds: list[int],
                 rows: list[dict] | None = None) -> Rollouts:
        """Every rank enters this, with prompts or none (a sharded policy's gather is a collective)."""
        with gathered(self.policy):  # sharded (FSDP): gathered once, so ranks with different work need no collective
            return self._generate(prompt_ids, sampling, seeds)

    def _generate(self, prompt_ids: list[list[int]], sampling: Sampling, seeds: list[int]) -> Rollouts:
        eos = self.tokenizer.eos_token_id
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else eos
        completion_ids, logprobs, texts, truncated = [], [], [], []
        was_training = self.policy.training
        self.policy.eval()
        device = next(self.policy.parameters()).device
        # Temperature 0 is greedy (Sampling's contract); transformers' generate refuses temperature=0.
        decoding = {"do_sample": False} if sampling.temperature == 0 else {
            "do_sample": True, "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": 0}
        for ids, seed in zip(prompt_ids, seeds):
            torch.manual_seed(seed)
            input_ids = torch.tensor([ids] * sampling.n, device=device)  # [G, T_prompt]
            with torch.no_grad(), self.autocast():
                out = run_pass(self.policy, _generate,
                    input_ids=input_ids, attention_mask=torch.ones_like(input_ids), **decoding,
                    max_new_tokens=sampling.max_new_tokens,
                    eos_token_id=eos, pad_token_id=pad, output_scores=True, return_dict_in_generate=True,
                )
            new = out.sequences[:, len(ids):]  # [G, T_new]
            # the scores are the logits after the temperature (and top_p): the distribution sampled from, as
            # the vLLM engine reports it and the trainer computes it
            sampled_from = torch.stack(out.scores, dim=1).float().log_softmax(-1)  # [G, T_new, V]
            token_lp = sampled_from.gather(-1, new[..., None])[..., 0]  # [G, T_new]
            group_ids, group_lp, group_text, group_trunc = [], [], [], []
            for row, row_lp in zip(new.tolist(), token_lp.tolist()):
                length = row.index(eos) + 1 if eos in row else len(row)
                group_ids.append(row[:length])
                group_lp.append(row_lp[:length])
                group_text.append(self.tokenizer.decode(row[:length], skip_special_tokens=True))
                group_trunc.append(eos not in row[:length])
            completion_ids.append(group_ids)
            logprobs.append(group_lp)
            texts.append(group_text)
            truncated.append(group_trunc)
        self.policy.train(was_training)
        return Rollouts(prompt_ids, completion_ids, logprobs, texts, truncated)

    def generate_each(self, requests: list[Request], on_finish: Callable[[Any, Completion], Request | None],
                      replies: Replies | None = None) -> None:
        """In rounds: each request of a round sampled on its own (n = 1, its seed), its completion handed to
        `on_finish`; the requests those return, and those `replies` gives back after the round (tool replies, at
        the round tools.pool's rule gives: a round is this engine's step), make the next round. One gather of a
        sharded policy for all."""
        numbers = itertools.count()  # each request's id, for the rejoin rule
        rounds = [(next(numbers), r) for r in requests]
        with gathered(self.policy):
            while rounds or (replies is not None and replies.waiting()):
                follow = []
                for _, request in rounds:
                    out = self._generate([request.prompt_ids], request.sampling._replace(n=1), [request.seed])
                    done = Completion(out.completion_ids[0][0], out.sampling_logprobs[0][0], out.truncated[0][0])
                    if (nxt := on_finish(request.key, done)) is not None:
                        follow.append((next(numbers), nxt))
                if replies is not None and replies.waiting():
                    follow += [(next(numbers), r) for r in replies.take([number for number, _ in follow])]
                rounds = follow

    def push_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        """Nothing to do: this engine samples from the trainer's own parameters."""

    def push_adapter(self, tensors: dict[str, Any], config: dict[str, Any]) -> None:
        """Nothing to do: this engine samples from the trainer's own module, adapters included."""

    def load_adapter(self, directory: str | Path | None) -> None:
        """The adapters are the policy module's own; a saved one cannot replace them here."""
        if directory is not None:
            raise UsageError(f"the transformers engine samples from the trainer's module and cannot load the adapter "
                             f"in {directory}; use rollout.engine=vllm")

    def read_weights(self, names: Iterable[str]) -> dict[str, Any]:
        """{}: the engine's tensors are the policy's own, nothing to compare."""
        return {}

    def read_adapter(self, modules: Iterable[str]) -> dict[str, tuple[Any, Any]]:
        return {}

    def sleep(self) -> None:
        """Nothing to free: the trainer's own module."""

    def wake_weights(self) -> None:
        """Nothing to wake."""

    def wake_kv_cache(self) -> None:
        """Nothing to wake."""

    def close(self) -> None:
        """Nothing to stop: the policy module is the trainer's."""

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        device = next(self.policy.parameters()).device
        out = []
        with gathered(self.policy), torch.no_grad(), self.autocast():
            for seq in sequences:
                logits = run_pass(self.policy, _logits, torch.tensor([seq], device=device))[0, :-1].float()  # [T-1, V]
                targets = torch.tensor(seq[1:], device=device)[:, None]  # [T-1, 1]
                out.append(logits.log_softmax(-1).gather(-1, targets)[:, 0].tolist())
        return out


def _generate(model: Any, **kwargs: Any) -> Any:
    return model.generate(**kwargs)


def _logits(model: Any, ids: Any) -> Any:
    return model(ids).logits

