"""Keeping the rollout engine in step with the trainer: the weight push and the push check.

After every optimizer step the policy's weights go into the engine (`push`). Every
`rollout.push_check_every` steps the engine re-scores a few of the step's sequences and
the run stops if its logprobs differ from the trainer's: it would be sampling from stale
weights, which no other metric shows.
"""

from __future__ import annotations

from typing import Any

from grpo_cli.batch import TrainBatch
from grpo_cli.config import RolloutConfig

PROBE_SEQUENCES = 4  # sequences re-scored by the engine in a push check


def push(engine: Any, policy: Any, dist: Any) -> None:
    """Every checkpoint-format tensor of the policy into this rank's engine."""
    engine.push_weights(policy.state_dict().items())


def push_check(engine: Any, policy: Any, sequences: list[list[int]], prompt_lens: list[int], tol: float,
               device: Any = "cpu") -> float:
    """Re-score a probe batch in the engine and compare with the trainer: stale weights stop the run."""
    import torch

    from grpo_cli import grpo

    engine_lp = engine.score(sequences)
    worst = 0.0
    with torch.no_grad():
        for seq, n, elp in zip(sequences, prompt_lens, engine_lp):
            ids = torch.tensor([seq], device=device)  # [1, T]
            trainer_lp = grpo.token_logprobs_reference(policy, ids, torch.ones_like(ids))[0]  # [T-1]
            diff = (trainer_lp[n - 1:] - torch.tensor(elp[n - 1:], device=device)).abs()  # [T-n] completion tokens
            worst = max(worst, float(diff.mean()) if diff.numel() else 0.0)
    if worst > tol:
        raise RuntimeError(f"the rollout engine holds stale weights: its logprobs differ from the trainer's by "
                           f"{worst:.2e} (> rollout.push_check_tol={tol:g}) after a weight push")
    return worst


def maybe_push_check(engine: Any, policy: Any, batch: TrainBatch, step: int, cfg: RolloutConfig,
                     dist: Any) -> dict[str, float]:
    """The push check on the step's first sequences when it is due: {"push_check/max_abs_diff": ...} or {}."""
    if not (cfg.push_check_every and step % cfg.push_check_every == 0 and batch.micro_batches):
        return {}
    rows = range(min(PROBE_SEQUENCES, len(batch.completions)))
    prompts = [batch.prompt_tokens[batch.prompt_index[j]] for j in rows]
    worst = push_check(engine, policy, [ids + batch.completions[j] for j, ids in zip(rows, prompts)],
                       [len(ids) for ids in prompts], cfg.push_check_tol, dist.device)
    return {"push_check/max_abs_diff": worst}
