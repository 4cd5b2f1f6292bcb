"""Collecting a step's groups: which prompts (the cursor), their rollouts, rewards and advantages, `[P, G]`.

`PromptCursor` owns the prompt order and position, and saves and restores them for an
exact resume. `collect_groups` is the first stage of a step: draw P prompts, sample G
completions of each with the rollout engine, score them with the reward functions and
turn the rewards into group-relative advantages.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from grpo_cli.config import TrainConfig
from grpo_cli.rewards import RewardFailures, Scores
from grpo_cli.rollout import Rollouts


class PromptCursor:
    """The train rows in a seeded order, reshuffled (seed + step) at each new epoch."""

    def __init__(self, num_rows: int, seed: int) -> None:
        self.num_rows, self.seed = num_rows, seed
        self.order = random.Random(seed).sample(range(num_rows), num_rows)  # row indices, this epoch's order
        self.position = 0  # index into `order` of the next prompt

    def take(self, count: int, step: int) -> list[int]:
        """The next `count` row indices; an epoch that runs out mid-step continues in a new order."""
        rows = []
        for _ in range(count):
            if self.position == len(self.order):  # a new epoch, in a new seeded order
                self.order = random.Random(self.seed + step).sample(range(self.num_rows), self.num_rows)
                self.position = 0
            rows.append(self.order[self.position])
            self.position += 1
        return rows

    def state_dict(self) -> dict[str, Any]:
        import torch

        return {"order": torch.tensor(self.order), "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.order, self.position = state["order"].tolist(), state["position"]


@dataclass
class Groups:
    """One step's P prompts with G scored completions each."""

    rows: list[dict[str, Any]]  # [P] the prompts' dataset rows
    prompt_ids: list[list[int]]  # [P] prompt token ids
    rollouts: Rollouts  # [P][G] completions, their sampling logprobs and truncation flags
    scored: Scores  # summed reward and each function's scores, flat [P*G]
    failures: RewardFailures  # reward calls that raised or returned bad values
    reward: Any  # [P, G] summed reward (rounded if trainer.reward_round_decimals)
    advantages: Any  # [P, G] group-relative advantages
    all_correct: Any  # [P] bool: every sample right (no signal)
    all_wrong: Any  # [P] bool: every sample wrong (no signal)
    keep: Any  # [P] bool: groups that enter the loss

    @property
    def group_size(self) -> int:
        return self.reward.shape[1]

    def kept(self) -> list[int]:
        """Indices of the groups that enter the loss."""
        return [p for p, k in enumerate(self.keep.tolist()) if k]


def sample_groups(engine: Any, cursor: PromptCursor, train_rows: list[dict[str, Any]], encode: Any,
                  cfg: TrainConfig, step: int) -> tuple[list[dict[str, Any]], list[list[int]], Rollouts]:
    """Draw the step's prompts and sample a group of completions for each: [P][G]."""
    from grpo_cli.rollout import sample_seeds

    r_cfg = cfg.rollout
    rows = [train_rows[i] for i in cursor.take(r_cfg.prompts_per_step, step)]
    prompt_ids = [encode(row) for row in rows]
    rollouts = engine.generate(prompt_ids, r_cfg.group_size, r_cfg.temperature, r_cfg.top_p,
                               r_cfg.max_new_tokens, sample_seeds(cfg.trainer.seed, step, len(rows)))
    return rows, prompt_ids, rollouts


def score_groups(rows: list[dict[str, Any]], prompt_ids: list[list[int]], rollouts: Rollouts, reward_fns: list,
                 cfg: TrainConfig, step: int, dist: Any) -> Groups:
    """Rewards [P, G] from the reward functions, then group-relative advantages and the groups kept."""
    import torch

    from grpo_cli import grpo, rewards
    from grpo_cli.errors import UsageError

    t_cfg = cfg.trainer
    P, G = len(rows), cfg.rollout.group_size
    completions = [text for group in rollouts.texts for text in group]  # [P*G]
    columns = {k: [row[k] for row in rows for _ in range(G)] for k in rows[0]}  # each [P*G]
    failures = rewards.RewardFailures()
    scored = rewards.score(reward_fns, completions, columns, cfg.data.answer_format, failures)
    if failures.total > len(completions) * len(reward_fns) / 2:  # most samples: the reward itself is broken
        name, reason = next(iter(failures.last_error.items()))
        raise UsageError(f"reward function '{name}' failed on most samples at step {step}: {reason}")
    reward = torch.tensor(scored.total, dtype=torch.float32, device=dist.device).view(P, G)  # [P, G]
    reward = grpo.round_rewards(reward, t_cfg.reward_round_decimals)  # [P, G]
    advantages = grpo.group_advantages(reward, scale_by_std=t_cfg.scale_by_std)  # [P, G]
    correct = torch.tensor(next(iter(scored.per_function.values())), device=dist.device).view(P, G)  # [P, G]
    all_correct, all_wrong = grpo.zero_variance_groups(reward, correct)  # [P], [P]
    keep = torch.ones(P, dtype=torch.bool, device=dist.device)  # [P]
    if t_cfg.filter_zero_variance:
        keep = ~(all_correct | all_wrong)  # [P]
    return Groups(rows, prompt_ids, rollouts, scored, failures, reward, advantages, all_correct, all_wrong, keep)


def collect_groups(engine: Any, cursor: PromptCursor, train_rows: list[dict[str, Any]], encode: Any,
                   reward_fns: list, cfg: TrainConfig, step: int, dist: Any, timings: Any) -> Groups:
    """The step's first stage: prompts -> rollouts [P][G] -> rewards and advantages [P, G]."""
    with timings("generate"):
        rows, prompt_ids, rollouts = sample_groups(engine, cursor, train_rows, encode, cfg, step)
    with timings("reward"):
        return score_groups(rows, prompt_ids, rollouts, reward_fns, cfg, step, dist)
