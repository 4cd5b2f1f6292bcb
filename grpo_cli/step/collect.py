"""Collecting a step's groups: which prompts (the pool), their rollouts, rewards and advantages, `[P, G]`.

`pool.PromptPool` owns which prompts a step draws, and saves and restores its state for an
exact resume. `collect_groups` is the first stage of a step: draw P prompts, sample G
completions of each with the rollout engine, score them with the reward functions and
turn the rewards into group-relative advantages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from grpo_cli import rewards
from grpo_cli.algorithm import grpo
from grpo_cli.config import TrainConfig
from grpo_cli.dist import Dist
from grpo_cli.engines.base import Rollouts
from grpo_cli.errors import RunFailure
from grpo_cli.rewards import RewardFailures, Scores, WeightedReward
from grpo_cli.step.rollout import sample_groups
from grpo_cli.step.state import RunState
from grpo_cli.step.timer import StepTimer

if TYPE_CHECKING:
    import torch



@dataclass
class Groups:
    """One step's P prompts with G scored completions each."""
    rows: list[dict[str, Any]]  # [P] the prompts' dataset rows
    prompt_ids: list[list[int]]  # [P] prompt token ids
    rollouts: Rollouts  # [P][G] completions, their sampling logprobs and truncation flags
    scored: Scores  # summed reward and each function's scores, flat [P*G]
    failures: RewardFailures  # reward calls that raised or returned bad values
    reward: torch.Tensor  # [P, G] summed reward (rounded if trainer.reward_round_decimals)
    advantages: torch.Tensor  # [P, G] group-relative advantages (trainer.advantage)
    all_correct: torch.Tensor  # [P] bool: every sample right (no signal)
    all_wrong: torch.Tensor  # [P] bool: every sample wrong (no signal)
    keep: torch.Tensor  # [P] bool: groups that enter the loss
    dropped: torch.Tensor  # [P, G] bool: samples a reward with on_failure=drop failed on; they leave the loss
    rounds: int = 1  # sampling rounds it took (dynamic sampling)
    pass_rate: torch.Tensor | None = None  # [P] the share of each group's scored samples the correctness check passed

    @property
    def group_size(self) -> int:
        return self.reward.shape[1]

    def kept(self) -> list[int]:
        """Indices of the groups that enter the loss."""
        return [p for p, k in enumerate(self.keep.tolist()) if k]


def concat_groups(parts: list[Groups]) -> Groups:
    """Several sampling rounds' groups as one, in round order."""
    import torch

    if len(parts) == 1:
        return parts[0]
    rollouts = Rollouts.concat([g.rollouts for g in parts])
    scored, failures = merge_scores([(g.scored, g.failures) for g in parts])
    tensors = [torch.cat([getattr(g, f) for g in parts]) for f in
               ("reward", "advantages", "all_correct", "all_wrong", "keep")]
    return Groups(sum((g.rows for g in parts), []), sum((g.prompt_ids for g in parts), []), rollouts, scored,
                  failures, *tensors, dropped=torch.cat([g.dropped for g in parts]), rounds=len(parts),
                  pass_rate=torch.cat([g.pass_rate for g in parts]))


def score_groups(rows: list[dict[str, Any]], prompt_ids: list[list[int]], rollouts: Rollouts,
                 reward_fns: list[WeightedReward], cfg: TrainConfig, step: int, dist: Dist) -> Groups:
    """Rewards [P, G] from the reward functions, then group-relative advantages and the groups kept."""
    import torch

    t_cfg = cfg.trainer
    P, G = len(rows), cfg.rollout.group_size
    completions = [text for group in rollouts.texts for text in group]  # [P*G]
    columns = {k: [row[k] for row in rows for _ in range(G)] for k in rows[0]}  # each [P*G]
    tokens = rollouts.model_tokens()  # [P*G] the model's own (a trajectory's tool replies are not)
    calls = rollouts.tool_calls()  # [P*G] each trajectory's tool calls; None single-turn
    env = rollouts.environment_results()  # ([P*G] states, [P*G] rewards) with an environment, else None
    whole = rollouts.trajectory_texts()  # ([P*G] texts, [P*G] tokens) of a tool run's whole trajectories, else None
    mine = dist.share(P)  # each rank scores its share of the groups; every rank then holds all the scores
    lo, hi = mine.start * G, mine.stop * G
    failures = rewards.RewardFailures()
    context = rewards.SampleContext(tokens[lo:hi], columns[cfg.data.prompt_column][lo:hi],
                                    calls[lo:hi] if calls is not None else None,
                                    (env[0][lo:hi], env[1][lo:hi]) if env is not None else None,
                                    whole[0][lo:hi] if whole is not None else None,
                                    whole[1][lo:hi] if whole is not None else None,
                                    cfg.rollout.trajectory_tokens if whole is not None else None)
    scored = rewards.score(reward_fns, completions[lo:hi], {k: v[lo:hi] for k, v in columns.items()},
                           cfg.data.answer_format, failures, group_size=G,
                           max_new_tokens=cfg.rollout.max_new_tokens,  # a tool run: a model turn's cap
                           context=context)
    if dist.world_size > 1:
        scored, failures = merge_scores(dist.gather((scored, failures)))
    for name, count in failures.counts.items():
        if count > len(completions) / 2:  # most samples: the reward itself is broken, not the completions
            raise RunFailure(f"reward function '{name}' failed on {count} of {len(completions)} samples at step "
                             f"{step}: {failures.last_error[name]}")
    reward = torch.tensor(scored.total, dtype=torch.float32, device=dist.device).view(P, G)  # [P, G]
    reward = grpo.round_rewards(reward, t_cfg.reward_round_decimals)  # [P, G]
    dropped = torch.tensor(scored.dropped, device=dist.device).view(P, G)  # [P, G] on_failure=drop samples
    if dropped.any():  # they leave the group statistics and the loss
        advantages = grpo.masked_advantages(grpo.ADVANTAGES[t_cfg.advantage], reward, ~dropped)  # [P, G]
    else:
        advantages = grpo.ADVANTAGES[t_cfg.advantage](reward)  # [P, G]
    correct = torch.tensor(scored.per_function[rewards.correctness_name(reward_fns)],
                           device=dist.device).view(P, G)  # [P, G] the correctness check
    all_correct, all_wrong = grpo.zero_variance_groups(reward, correct)  # [P], [P]
    scored_count = (~dropped).sum(dim=1)  # [P] samples left in each group
    pass_rate = (correct * ~dropped).sum(dim=1) / scored_count.clamp(min=1)  # [P] the prompt pool's record
    keep = torch.ones(P, dtype=torch.bool, device=dist.device)  # [P]
    if t_cfg.filter_zero_variance or cfg.rollout.dynamic_sampling:
        keep = ~(all_correct | all_wrong)  # [P]
    return Groups(rows, prompt_ids, rollouts, scored, failures, reward, advantages, all_correct, all_wrong, keep,
                  dropped=dropped, pass_rate=pass_rate)


def merge_scores(parts: list[tuple[Scores, RewardFailures]]) -> tuple[Scores, RewardFailures]:
    """(scores, failures) of consecutive parts of the samples as one, in order (the ranks' shares of a
    step, or the rounds of dynamic sampling)."""
    names = list(parts[0][0].per_function)
    scored = Scores(sum((s.total for s, _ in parts), []), {n: sum((s.per_function[n] for s, _ in parts), [])
                                                           for n in names},
                    sum((s.dropped for s, _ in parts), []))
    failures = RewardFailures()
    for _, f in parts:
        failures.counts.update(f.counts)
        failures.last_error.update(f.last_error)
    return scored, failures


def collect_groups(state: RunState, cfg: TrainConfig, step: int, timings: StepTimer) -> Groups:
    """The step's first stage: prompts -> rollouts [P][G] -> rewards and advantages [P, G].

    With rollout.dynamic_sampling (DAPO), rounds of prompts_per_step more prompts are sampled
    until prompts_per_step groups have reward variance or rollout.max_sampling_rounds is reached;
    the first prompts_per_step such groups enter the loss.
    """
    r_cfg = cfg.rollout
    rounds = r_cfg.max_sampling_rounds if r_cfg.dynamic_sampling else 1
    parts: list[Groups] = []
    for round_index in range(rounds):
        with timings("generate"):
            rows, prompt_ids, rollouts = sample_groups(state, cfg, step, round_index)
        with timings("reward"):
            parts.append(score_groups(rows, prompt_ids, rollouts, state.task.reward_fns, cfg, step, state.dist))
        if sum(int(part.keep.sum()) for part in parts) >= r_cfg.prompts_per_step:
            break
    groups = concat_groups(parts)
    if r_cfg.dynamic_sampling:  # the first prompts_per_step groups with signal
        groups.keep = groups.keep & (groups.keep.long().cumsum(0) <= r_cfg.prompts_per_step)  # [P*rounds]
    return groups
