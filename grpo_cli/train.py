"""`grpo train`: the GRPO training loop, one step top to bottom.

set-up (preflight, torch, the run state: models, engine, optimizer, cursor, resume point) -> per
step: collect groups [P, G] (prompts, rollouts, rewards, advantages) -> build the train batch ->
reference logprobs -> update (clipped loss + kl_coef * KL over micro-batches, AdamW) -> push
weights (+ check) -> step metrics -> maybe evaluate -> maybe checkpoint -> stop on request.

Each stage is a function in a module named for what it holds (setup.py, collect.py, batch.py,
update.py, sync.py) and takes the run state (`setup.RunState`) and the config it reads.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from grpo_cli.config import TrainConfig
from grpo_cli.dist import COLLECTIVE_SECONDS, Dist
from grpo_cli.dist.ranks import split_roles
from grpo_cli.engines.base import NO_LOGPROBS, Engine, Sampling
from grpo_cli.preflight import preflight
from grpo_cli.prompts.images import image_name, row_images
from grpo_cli.report.console import make_console, summary_lines
from grpo_cli.report.loggers import NullLogger, make_logger
from grpo_cli.report.plot import plot_runs
from grpo_cli.report.watch import NonFiniteGuard, ZeroVarianceWatch
from grpo_cli.rewards.load import close_reward_models
from grpo_cli.rewards.teacher import ServedTeacher
from grpo_cli.runtime import quiet_third_party
from grpo_cli.step.ahead import RolloutsAhead, staleness_metrics
from grpo_cli.step.batch import TrainBatch
from grpo_cli.step.collect import Groups, collect_groups
from grpo_cli.step.generator import is_generator_rank, serve
from grpo_cli.step.heldout import add_greedy_metrics, flatten, heldout_metrics
from grpo_cli.step.metrics import rank_metrics, step_metrics
from grpo_cli.step.rollout import sample_seeds
from grpo_cli.step.setup import setup_torch, start_run, teacher_engine
from grpo_cli.step.state import RunState, Start
from grpo_cli.step.sync import can_stand_in, maybe_push_check, push_mode, push_to_engine, release_engine, standing_in
from grpo_cli.step.timer import StepTimer
from grpo_cli.step.update import fill_logprobs, loss_params, update
from grpo_cli.tools.load import close_tools
from grpo_cli.weights.checkpoint import STEP_PREFIX, checkpoint_info, save_checkpoint, trainer_state
from grpo_cli.weights.lora import summary
from grpo_cli.weights.runs import prune_checkpoints

log = logging.getLogger("grpo_cli.train")


def run(cfg: TrainConfig, run_dir: Path, engine: Engine | None = None) -> int:
    """Train; returns the exit code (0, or 130 after Ctrl-C). `engine`: a vLLM engine already serving this
    model's architecture (a notebook's, a test's), which takes the start point's weights instead of a new
    engine starting (tens of seconds on a CPU)."""
    quiet_third_party(cfg.logging.verbose_libraries)  # before vLLM/datasets/transformers are imported

    task = preflight(cfg)  # data, rewards, model files, prompt lengths: before any model loads
    setup_torch(cfg.trainer)
    if is_generator_rank(cfg):  # rollout.placement=split: a vLLM engine answering the trainer rank (docs/async.md)
        return serve(cfg, task)
    state = start_run(cfg, task, run_dir, engine)  # models, engine, optimizer, cursor; a resume's state put back
    t_cfg, params, started, exit_code = cfg.trainer, loss_params(cfg), time.time(), 0
    out = RunOutput(cfg, run_dir, state.history, state.dist)  # metrics.jsonl (+ wandb), the console, warnings
    stop = GracefulStop()  # Ctrl-C: finish the step, checkpoint, exit 130; a second one exits at once
    guard = NonFiniteGuard(t_cfg.max_bad_steps)
    ahead = RolloutsAhead.wanted(state, cfg)  # None at rollout.max_staleness=0
    try:
        out.header(task.model_path, state)
        if state.start.step == 0:
            if cfg.resume:  # resume=auto with no run to continue: a requeued job's first attempt starts here
                out.console.info(f"resume=auto: no run of {cfg.task} under {Path(cfg.output_dir) / cfg.task} has a "
                                 "resumable checkpoint yet; starting a new run")
            out.record({"step": 0, **heldout_eval(state, cfg, 0), **teacher_heldout(state, cfg)})
        else:
            out.resumed(state.start)
        if ahead is not None:  # rollout.max_staleness = K: the first K batches, from the start's weights
            ahead.fill(state.start.step + 1, state.start.step)
        for step in range(state.start.step + 1, t_cfg.steps + 1):
            timings, collective_start = StepTimer(), COLLECTIVE_SECONDS[0]
            if ahead is None:
                groups = collect_groups(state, cfg, step, timings)  # [P, G]
                release_engine(state, t_cfg, timings)  # vLLM sleeps while the trainer steps
            else:  # sampled from the weights after step - 1 - K; step + K's batch starts sampling now
                groups, sampled = ahead.take(step, timings)  # [P, G]
            state.pool.record(step, groups.pass_rate.tolist())  # what data.sampler reads for the draws after this one
            batch = TrainBatch.build(groups, task.tokenizer.pad_token_id, t_cfg, state.dist, params, task.vision)
            with timings("logprobs"):  # the reference's, and the policy's before the update when it can move
                penalty = fill_logprobs(state, batch, groups, cfg)
            with timings("update"):
                stats = {**update(state, batch, params, cfg), **penalty}
            guard.check(stats, step, out.console.warn)
            if ahead is not None:
                ahead.finish(timings)  # the batch sampled beside the update, before the engine's weights change
            push_to_engine(state, t_cfg, timings)  # wake weights, push, wake KV cache
            stats.update(maybe_push_check(state, batch, step, cfg.rollout, cfg.model.dtype))

            metrics = step_metrics(step, groups, batch, stats, timings, state.scheduler.get_last_lr()[0], started)
            metrics.update(staleness_metrics(step, sampled) if ahead is not None else {})
            metrics.update(state.pool.metrics(step))  # prompts passed over, the pool's buckets
            metrics.update(rank_metrics(state.dist, COLLECTIVE_SECONDS[0] - collective_start))
            metrics.update(state.engine.step_metrics())  # rollout.placement=split: the generator rank's memory
            metrics.update(maybe_heldout_eval(state, cfg, step))
            out.record(metrics)
            last = step == t_cfg.steps
            stopping = state.dist.any(stop.requested)  # one decision for all ranks (Ctrl-C may reach only some)
            maybe_checkpoint(state, metrics, cfg, save_now=last or stopping, ahead=ahead)
            out.after_step(metrics, groups, step, task.tokenizer)  # zero-variance warning, sample completions
            if stopping and not last:
                out.console.warn(f"interrupted at step {step}: checkpoint saved; continue with the same command "
                                 f"plus resume={run_dir}")
                exit_code = 130
                break
    finally:
        stop.restore()
        if ahead is not None:
            ahead.close()
        out.close()
        close_tools(task.tools)  # the tools' and the environment's workers
        close_reward_models(task.reward_fns)  # the servers this run started for its reward models
        if isinstance(state.teacher, ServedTeacher):
            state.teacher.close()  # the teacher's server, when this run started it
    state.dist.barrier()  # every rank is done; then a normal exit (destroy_process_group aborts on gloo: docs/design.md)
    state.engine.close()  # rollout.placement=split: the generator rank's serve returns
    if state.dist.is_main:
        out.summary(time.time() - started)
    return exit_code


class RunOutput:
    """Where a run's results go: metrics.jsonl (+ wandb), the console, the history for the summary.
    Only the main rank writes."""

    def __init__(self, cfg: TrainConfig, run_dir: Path, history: list[dict[str, Any]], dist: Dist) -> None:
        self.cfg, self.run_dir, self.history, self.dist = cfg, run_dir, history, dist
        steps, every = cfg.trainer.steps, cfg.logging.every
        self.logger = make_logger(cfg.logging, run_dir, dataclasses.asdict(cfg)) if dist.is_main else NullLogger()
        self.console = make_console(steps, every) if dist.is_main else \
            make_console(steps, every, force_plain=True, file=open(os.devnull, "w"))
        self.watch = ZeroVarianceWatch(cfg.logging.zero_variance_threshold, cfg.logging.zero_variance_patience)
        self.console.start()

    def header(self, model_path: str, state: RunState) -> None:
        """The run's first console lines: what runs, with LoRA what trains and how it reaches the engine, then
        the loggers' notes (e.g. wandb offline)."""
        cfg, world = self.cfg, self.dist.world_size
        ranks = f" | {world} processes (FSDP2, an engine each)" if world > 1 else ""
        if cfg.rollout.placement == "split":
            ranks = f" | {split_roles(cfg.trainer_ranks, world + cfg.rollout.generator_ranks)} (rollout.placement=split)"
        self.console.info(f"grpo train: {cfg.task} | model {model_path} | engine {cfg.rollout.engine} | "
                          f"{cfg.trainer.steps} steps of {cfg.rollout.prompts_per_step} prompts x "
                          f"{cfg.rollout.group_size}{ranks} | run dir {self.run_dir}")
        if cfg.model.lora.enabled:
            self.console.info(f"{summary(state.policy, cfg.model.lora)} | push: {push_mode(state.engine)}")
        for note in self.logger.notes:
            self.console.info(note)

    def resumed(self, start: Start) -> None:
        """The resume's console lines: where from, "(saved by 2 processes, resumed on 1)" when the world
        size changed, and the lr schedule kept from the original run when trainer.steps changed."""
        saved, t_cfg = start.info["world_size"], self.cfg.trainer
        note = "" if saved == self.dist.world_size else \
            f" (saved by {saved} process{'es' * (saved > 1)}, resumed on {self.dist.world_size})"
        self.console.info(f"resumed from {start.path} at step {start.step}{note}")
        if t_cfg.lr_schedule != "constant" and start.schedule_steps != t_cfg.steps:
            self.console.info(f"lr schedule: {t_cfg.lr_schedule} over the original run's {start.schedule_steps} steps, "
                              f"kept (this run stops at trainer.steps={t_cfg.steps})")

    def record(self, metrics: dict[str, Any]) -> None:
        self.logger.log(metrics, metrics["step"])
        self.console.update(metrics)
        self.history.append(metrics)

    def after_step(self, metrics: dict[str, Any], groups: Groups, step: int, tokenizer: Any) -> None:
        """The zero-variance warning, and a few sample completions every logging.samples_every steps."""
        if warning := self.watch.check(metrics):
            self.console.warn(warning)
        every = self.cfg.logging.samples_every
        if every and step % every == 0:
            G = groups.group_size
            rollouts = groups.rollouts
            samples = [{"prompt": tokenizer.decode(groups.prompt_ids[p]), "completion": rollouts.texts[p][0],
                        "rewards": {name: vals[p * G] for name, vals in groups.scored.per_function.items()},
                        "advantage": float(groups.advantages[p, 0]),
                        **({"trajectory": rollouts.trajectories[p][0], "turns": rollouts.segments[p][0]}
                           if rollouts.segments else {}),
                        **({"environment": rollouts.environments[p][0]._asdict()} if rollouts.environments else {}),
                        **({"images": names} if (names := [image_name(image) for image in
                                                           row_images(groups.rows[p], self.cfg.data.image_column)])
                           else {})}
                       for p in range(min(len(groups.rows), 4))]
            self.logger.log_samples(samples, step)
            self.console.samples(samples, step)

    def summary(self, wall_s: float) -> None:
        """After the last step: the run's plot, and a few lines on what it did and where its files are."""
        plot_runs([self.run_dir], self.run_dir / "metrics.png")
        for line in summary_lines(self.history, self.run_dir, wall_s):
            print(line)

    def close(self) -> None:
        self.console.close()
        self.logger.close()


def maybe_heldout_eval(state: RunState, cfg: TrainConfig, step: int) -> dict[str, float]:
    """Held-out metrics every eval.every steps and at the last step ({} otherwise), with their time."""
    every = cfg.eval.every or cfg.trainer.steps
    if not (step % every == 0 or step == cfg.trainer.steps):
        return {}
    tick = time.time()
    metrics = heldout_eval(state, cfg, step)
    return {**metrics, "time/eval": time.time() - tick}


def heldout_eval(state: RunState, cfg: TrainConfig, step: int) -> dict[str, float]:
    """Held-out metrics (sampled pass@1 = mean of the correctness reward), as eval/... keys. At world
    size > 1 the ranks' engines sample their shares of the problems (ShardedEngine), and rank 0's
    metrics are everyone's (a reward that timed out on one rank only must not split the best-model
    decision)."""
    sampling = Sampling(cfg.eval.samples_per_problem, cfg.eval.temperature, cfg.rollout.top_p,
                        cfg.rollout.max_new_tokens, logprob_seeds=NO_LOGPROBS)  # evaluation reads no sampling logprobs
    seeds = sample_seeds(cfg.trainer.seed, step, len(state.heldout.rows), stream=1, group_size=sampling.n)
    metrics = heldout_metrics(state.engine, state.heldout, sampling, seeds, max_tokens=cfg.rollout.trajectory_tokens)
    if cfg.eval.greedy:  # eval/greedy_accuracy (and in a tool run eval/greedy_call_share)
        add_greedy_metrics(metrics, state.engine, state.heldout, cfg.rollout.max_new_tokens,
                           cfg.rollout.trajectory_tokens)
    return state.dist.broadcast(flatten(metrics))


def teacher_heldout(state: RunState, cfg: TrainConfig) -> dict[str, float]:
    """distill.teacher's held-out pass@1, once at a new run's start, sampled as the student's step-0 evaluation is
    (its seeds, eval.samples_per_problem at eval.temperature): the line the student climbs towards ({} without a
    teacher). By the run's own engine with the teacher's weights pushed in when they fit it (then the policy's
    pushed back), else with transformers on the teacher itself (any teacher the passes run; slower)."""
    if state.teacher is None or isinstance(state.teacher, ServedTeacher):  # a served one: no engine samples it here
        return {}
    sampling = Sampling(cfg.eval.samples_per_problem, cfg.eval.temperature, cfg.rollout.top_p,
                        cfg.rollout.max_new_tokens, logprob_seeds=NO_LOGPROBS)
    seeds = sample_seeds(cfg.trainer.seed, 0, len(state.heldout.rows), stream=1, group_size=sampling.n)

    def measure(engine: Engine) -> float:
        return heldout_metrics(engine, state.heldout, sampling, seeds, max_tokens=cfg.rollout.trajectory_tokens)["pass@1"]

    if can_stand_in(state.engine, state.policy, state.teacher):
        with standing_in(state.engine, state.policy, state.teacher):
            value = measure(state.engine)
    else:
        engine = teacher_engine(cfg, state.task, state.teacher, state.dist)
        try:
            value = measure(engine)
        finally:
            engine.close()
    return state.dist.broadcast({"eval/teacher_pass@1": value})


def maybe_checkpoint(state: RunState, metrics: dict[str, Any], cfg: TrainConfig, save_now: bool,
                     ahead: RolloutsAhead | None = None) -> None:
    """The best model by held-out pass@1, and a resumable checkpoint every checkpoint.every steps, at the
    end and when `save_now` (with the batches sampled ahead, rollout.max_staleness); `state.best_pass` follows
    the best."""
    step, checkpoints = metrics["step"], state.run_dir / "checkpoints"
    info = checkpoint_info(step, cfg, state.task.model_path, metrics.get("eval/pass@1"), state.dist.world_size)
    if metrics.get("eval/pass@1", -1.0) > state.best_pass:
        state.best_pass = metrics["eval/pass@1"]
        save_checkpoint(state.policy, state.task.tokenizer_files, checkpoints / "best", info, dist=state.dist)
    if save_now or (cfg.checkpoint.every and step % cfg.checkpoint.every == 0):
        name = "final" if step == cfg.trainer.steps else f"{STEP_PREFIX}{step:06d}"
        save_checkpoint(state.policy, state.task.tokenizer_files, checkpoints / name, info,
                        trainer_state(state.optimizer, state.scheduler, state.pool, state.best_pass,
                                      state.start.schedule_steps)
                        | ({"rollouts_ahead": ahead.state_dict()} if ahead is not None else {}),
                        optimizer=state.optimizer, dist=state.dist)
        if state.dist.is_main:
            prune_checkpoints(state.run_dir, cfg.checkpoint.keep_last)


class GracefulStop:
    """SIGINT handling: the first Ctrl-C asks the loop to stop after the current step (it
    checkpoints and exits 130); a second one exits at once with 130."""
    # Under torchrun a Ctrl-C reaches a worker twice: from the terminal, and forwarded by the agent.
    # A second SIGINT this soon after the first is that copy, not a second press.
    ECHO_S = 2.0

    def __init__(self) -> None:
        self.requested = False
        self._first_at = 0.0
        self._under_launcher = "LOCAL_RANK" in os.environ
        self._previous = signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested and self._under_launcher and time.monotonic() - self._first_at < self.ECHO_S:
            return
        if self.requested:
            print("\ninterrupted twice: exiting now", file=sys.stderr, flush=True)
            os._exit(130)  # vLLM's threads could hold a normal exit; nothing half-written: saves are atomic
        self.requested, self._first_at = True, time.monotonic()
        if os.environ.get("RANK", "0") != "0":  # one message for the job
            return
        print("\ninterrupt: stopping after this step and saving a checkpoint (Ctrl-C again to quit now)",
              file=sys.stderr, flush=True)

    def restore(self) -> None:
        signal.signal(signal.SIGINT, self._previous)
