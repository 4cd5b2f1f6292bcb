"""Rollouts sampled ahead of the trainer: `rollout.max_staleness=K` (docs/async.md).

With K > 0 the batch of step t is always sampled from the weights after step t-1-K (the start's weights for
the first K+1 steps), so a run stays a pure function of its seed however long each phase takes. While the
trainer runs step t, a thread samples the batch of step t+K on this rank's engine, which then holds the
weights after step t-1; the push of step t's weights waits for that batch. The thread only generates: the
main thread draws the prompts, gathers the ranks' shares, scores, trains and pushes, so every collective
stays in one thread, in one order on every rank. With rollout.placement=split there is no thread: the
generator rank samples while this one trains (engines.remote.RemoteEngine.start_generate). The batches already
sampled go into each checkpoint's trainer state, so a resume (at any world size) trains on exactly the
batches the run would have.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from grpo_cli.config import RolloutConfig, TrainConfig
from grpo_cli.engines.base import Rollouts
from grpo_cli.step.collect import Groups, score_groups
from grpo_cli.step.rollout import draw_prompts
from grpo_cli.step.state import RunState
from grpo_cli.step.timer import StepTimer
from grpo_cli.tools.environment import EnvironmentEnd


@dataclass
class Sampled:
    """One step's batch, sampled and gathered, not yet scored."""
    step: int  # the step that trains on it
    policy_version: int  # the optimizer steps behind the weights it came from (0: the start's weights)
    rows: list[dict[str, Any]]  # [P] the prompts' dataset rows
    prompt_ids: list[list[int]]  # [P] prompt token ids
    rollouts: Rollouts  # [P][G] every rank's samples
    generate_s: float  # seconds this rank's engine took to sample its share

    def state_dict(self) -> dict[str, Any]:
        """Plain types only (checkpoint.load_trainer_state reads with weights_only=True)."""
        rollouts = {name: getattr(self.rollouts, name) for name in Rollouts.FIELDS}
        rollouts["environments"] = [[end._asdict() for end in group] for group in self.rollouts.environments]
        return {"step": self.step, "policy_version": self.policy_version, "rows": self.rows,
                "prompt_ids": self.prompt_ids, "rollouts": rollouts, "generate_s": self.generate_s}

    @staticmethod
    def from_state_dict(saved: dict[str, Any]) -> Sampled:
        fields = dict(saved["rollouts"])
        fields["environments"] = [[EnvironmentEnd(**end) for end in group] for group in fields["environments"]]
        return Sampled(saved["step"], saved["policy_version"], saved["rows"], saved["prompt_ids"],
                       Rollouts(**fields), saved["generate_s"])


def overlap_wanted(rollout: RolloutConfig, trainer_device: Any) -> bool:
    """rollout.overlap: "auto" samples in a thread beside the update when the trainer is on CUDA (its kernels run
    while Python waits); on the CPU the two phases fight for the same cores and the GIL, and the thread made the
    default run's step 2x slower (docs/async.md), so the batch is sampled after the update there."""
    return {"thread": True, "off": False, "auto": str(trainer_device).startswith("cuda")}[rollout.overlap]


def policy_version(step: int, max_staleness: int) -> int:
    """The optimizer steps behind the weights the batch of `step` is sampled from: those after step
    step-1-K, or the start's (0) for the first K+1 steps."""
    return max(0, step - 1 - max_staleness)


class RolloutsAhead:
    """The batches sampled ahead of the trainer, and the one being sampled beside it."""

    def __init__(self, state: RunState, cfg: TrainConfig, saved: list[dict[str, Any]] | None) -> None:
        self.state, self.cfg, self.K = state, cfg, cfg.rollout.max_staleness
        self.ready: dict[int, Sampled] = {s.step: s for s in map(Sampled.from_state_dict, saved or [])}
        # rollout.overlap: sample in a thread beside the update, or after it (the same batches either way)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grpo-rollouts") \
            if overlap_wanted(cfg.rollout, state.dist.device) and state.engine.in_process else None
        # (step, policy version, rows, prompt ids, the call that waits for (rollouts, seconds), beside the update?)
        self.running: tuple[int, int, list[dict[str, Any]], list[list[int]], Callable, bool] | None = None

    @classmethod
    def wanted(cls, state: RunState, cfg: TrainConfig) -> RolloutsAhead | None:
        """The run's batches ahead with rollout.max_staleness > 0 (a resume's, from its trainer state), else None."""
        if not cfg.rollout.max_staleness:
            return None
        return cls(state, cfg, (state.start.state or {}).get("rollouts_ahead"))

    def fill(self, first_step: int, current_version: int) -> None:
        """Before the loop: sample now, from the weights the engine holds, the batches of steps first_step ..
        first_step+K-1 that are not here (all of them in a new run; none after a resume from a checkpoint
        that saved them; those past the saved run's last step when a resume raises trainer.steps)."""
        for step in range(first_step, min(first_step + self.K, self.cfg.trainer.steps + 1)):
            if step not in self.ready:
                self.ready[step] = self._sample_now(step, current_version)

    def _sample_now(self, step: int, version: int) -> Sampled:
        rows, prompt_ids, sampling, seeds = draw_prompts(self.state, self.cfg, step)
        tick = time.time()
        rollouts = self.state.engine.generate(prompt_ids, sampling, seeds, rows)
        return Sampled(step, version, rows, prompt_ids, rollouts, time.time() - tick)

    def take(self, step: int, timings: StepTimer) -> tuple[Groups, Sampled]:
        """The batch of `step`, scored; the batch of step+K starts sampling beside the trainer."""
        sampled = self.ready.pop(step)  # sampled K steps ago, or by `fill`
        if step + self.K <= self.cfg.trainer.steps:
            self._start(step + self.K, version=policy_version(step + self.K, self.K))  # the engine's: after step-1
        with timings("reward"):
            groups = score_groups(sampled.rows, sampled.prompt_ids, sampled.rollouts, self.state.task.reward_fns,
                                  self.cfg, step, self.state.dist)
        return groups, sampled

    def _start(self, step: int, version: int) -> None:
        rows, prompt_ids, sampling, seeds = draw_prompts(self.state, self.cfg, step)  # the cursor moves in step order
        # a split job's generator rank starts sampling now; this process's engine samples in the thread, or in
        # `finish` after the update
        wait = self.state.engine.start_generate(prompt_ids, sampling, seeds, rows)
        if self.pool is not None:
            wait = self.pool.submit(wait).result
        self.running = (step, version, rows, prompt_ids, wait, self.pool is not None or not self.state.engine.in_process)

    def finish(self, timings: StepTimer) -> None:
        """Wait for the batch being sampled (before the engine takes new weights) and gather the ranks' shares."""
        if self.running is None:
            return
        step, version, rows, prompt_ids, wait, overlapped = self.running
        self.running = None
        with timings("wait_rollouts" if overlapped else "generate"):
            part, generate_s = wait()  # a failure in the thread (or the generator rank) is raised here
            rollouts = self.state.engine.gather_shares(part)  # a collective at world size > 1
        self.ready[step] = Sampled(step, version, rows, prompt_ids, rollouts, generate_s)

    def state_dict(self) -> list[dict[str, Any]]:
        """The batches sampled and not yet trained on, for the checkpoint (nothing is running then)."""
        assert self.running is None, "a checkpoint while a batch is being sampled"
        return [self.ready[step].state_dict() for step in sorted(self.ready)]

    def close(self) -> None:
        """Let a batch still sampling finish (its engine call cannot be cut short) and stop the thread."""
        if self.pool is not None:
            self.pool.shutdown(wait=True)


def staleness_metrics(step: int, sampled: Sampled) -> dict[str, Any]:
    """Which weights the step's batch came from, and how many optimizer steps behind the trainer's they were."""
    return {"rollout/policy_version": sampled.policy_version, "rollout/staleness": step - 1 - sampled.policy_version,
            "tokens_per_s": sampled.rollouts.num_tokens / max(sampled.generate_s, 1e-9),
            "time/generate_ahead": sampled.generate_s}  # not in time/step: it ran beside an earlier step

