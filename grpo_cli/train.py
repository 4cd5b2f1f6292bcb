"""`grpo train`: the GRPO training loop, one step top to bottom.

set-up (preflight, torch, resume point, models, optimizer) -> per step: collect groups [P, G]
(prompts, rollouts, rewards, advantages) -> build the train batch -> reference logprobs ->
update (clipped loss + kl_coef * KL over micro-batches, AdamW) -> push weights (+ check) ->
step metrics -> maybe evaluate -> maybe checkpoint -> stop on request.

Each stage is a function in a module named for what it holds: setup.py, collect.py,
batch.py, update.py, sync.py; rank and device questions go through dist.Dist.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from grpo_cli.config import TrainConfig

log = logging.getLogger("grpo_cli.train")


def run(cfg: TrainConfig, run_dir: Path) -> int:
    from grpo_cli import monitor

    monitor.quiet_third_party(cfg.logging.verbose_libraries)  # before vLLM/datasets/transformers are imported
    from grpo_cli.batch import TrainBatch
    from grpo_cli.checkpoint import restore_trainer_state
    from grpo_cli.collect import PromptCursor, collect_groups
    from grpo_cli.dist import COLLECTIVE_SECONDS, Dist
    from grpo_cli.optim import build_optimizer
    from grpo_cli.setup import build_models, preflight, resume_or_start, setup_torch, truncate_metrics
    from grpo_cli.sync import maybe_push_check, push_to_engine, release_engine
    from grpo_cli.update import NonFiniteGuard, loss_params, score_batch, update

    task = preflight(cfg)  # data, rewards, model files, prompt lengths: before any model loads
    setup_torch(cfg)
    dist = Dist.init(cfg.trainer.device)
    start = resume_or_start(cfg, run_dir, task.model_path)
    models = build_models(cfg, task, start, dist)
    optimizer, scheduler = build_optimizer(models.policy, cfg.trainer, start.schedule_steps)
    cursor = PromptCursor(len(task.train_rows), cfg.trainer.seed)
    best_pass, history = -1.0, []  # best held-out pass@1 so far (checkpoints/best holds that model)
    if start.state is not None:
        best_pass = restore_trainer_state(start.state, optimizer, scheduler, cursor, Path(start.path), models.policy)
        if dist.is_main:
            history = truncate_metrics(run_dir / "metrics.jsonl", start.step)  # drop steps after the checkpoint
        dist.barrier()

    def encode(row: dict[str, Any]) -> list[int]:
        return task.encode(row, cfg)

    t_cfg, engine, policy, params = cfg.trainer, models.engine, models.policy, loss_params(cfg)
    started, exit_code = time.time(), 0
    out = RunOutput(cfg, run_dir, history, dist)  # metrics.jsonl (+ wandb), the console, warnings
    stop = GracefulStop()  # Ctrl-C: finish the step, checkpoint, exit 130; a second one exits at once
    guard = NonFiniteGuard(t_cfg.max_bad_steps)
    try:
        out.header(f"grpo train: {cfg.task} | model {task.model_path} | engine {cfg.rollout.engine} | "
                   f"{t_cfg.steps} steps of {cfg.rollout.prompts_per_step} prompts x {cfg.rollout.group_size}"
                   f"{out.ranks_note} | run dir {run_dir}")
        if start.step == 0:
            out.record({"step": 0, **evaluate(engine, task.heldout_rows[: cfg.eval.num_problems], encode,
                                              task.reward_fns, cfg, 0, dist)})
        else:
            out.resumed(start)
        for step in range(start.step + 1, t_cfg.steps + 1):
            timings = monitor.StepTimer()
            collective_start = COLLECTIVE_SECONDS[0]
            groups = collect_groups(engine, cursor, task.train_rows, encode, task.reward_fns, cfg, step, dist,
                                    timings)  # [P, G]
            release_engine(engine, optimizer, cfg, dist, timings)  # vLLM sleeps while the trainer steps
            batch = TrainBatch.build(groups, task.tokenizer.pad_token_id, t_cfg, dist, params)
            with timings("logprobs"):  # the reference's, and the policy's before the update when it can move
                penalty = score_batch(policy, models.reference, batch, groups, cfg, dist)
            with timings("update"):
                stats = {**update(policy, optimizer, scheduler, batch, params, cfg, dist), **penalty}
            guard.check(stats, step, out.console.warn)
            push_to_engine(engine, policy, optimizer, cfg, dist, timings)  # wake weights, push, wake KV cache
            stats.update(maybe_push_check(engine, policy, batch, step, cfg.rollout, dist, cfg.model.dtype))

            metrics = step_metrics(step, groups, batch, stats, timings, scheduler.get_last_lr()[0], started)
            metrics.update(rank_metrics(dist, COLLECTIVE_SECONDS[0] - collective_start))
            metrics.update(maybe_evaluate(engine, task, encode, cfg, step, dist))
            out.record(metrics)
            last = step == t_cfg.steps
            stopping = dist.any(stop.requested)  # one decision for all ranks (Ctrl-C may reach only some)
            best_pass = maybe_checkpoint(policy, task.tokenizer, optimizer, scheduler, cursor, best_pass, metrics,
                                         cfg, run_dir, task.model_path, start.schedule_steps,
                                         save_now=last or stopping, dist=dist)
            out.after_step(metrics, groups, step, task.tokenizer)  # zero-variance warning, sample completions
            if stopping and not last:
                out.console.warn(f"interrupted at step {step}: checkpoint saved; continue with the same command "
                                 f"plus resume={run_dir}")
                exit_code = 130
                break
    finally:
        stop.restore()
        out.close()
    dist.barrier()  # every rank is done; then a normal exit (destroy_process_group aborts on gloo: shared/DESIGN.md)
    if dist.is_main:
        from grpo_cli.plot import plot_runs

        plot_runs([run_dir], run_dir / "metrics.png")
        for line in monitor.summary_lines(history, run_dir, time.time() - started):
            print(line)
    return exit_code


def rank_metrics(dist: Any, collective_s: float) -> dict[str, float]:
    """Peak host memory of the largest rank, and (several ranks) the seconds the step spent in the loop's
    own collectives, which sit inside the phases (FSDP2's communication is not counted here)."""
    from grpo_cli import monitor

    metrics = {"memory/peak_rss_gib": max(dist.gather(monitor.peak_rss_gib()))}
    if dist.world_size > 1:
        metrics["dist/collective_s"] = collective_s
    return metrics


def step_metrics(step: int, groups: Any, batch: Any, stats: dict[str, Any], timings: dict[str, float], lr: float,
                 started: float) -> dict[str, Any]:
    """One step's metrics line: rewards, the update's stats, lengths, group statistics, speed, time split."""
    rollouts, scored = groups.rollouts, groups.scored
    lengths = [len(c) for group in rollouts.completion_ids for c in group]
    push_checks = {k: v for k, v in stats.items() if k.startswith("push_check/")}
    update_stats = {k: v for k, v in stats.items() if k not in push_checks}
    return {
        "step": step,
        "reward/mean": float(groups.reward.mean()),
        "reward/std": float(groups.reward.std(unbiased=False)),
        **{f"reward/{name}": sum(vals) / len(vals) for name, vals in scored.per_function.items()},
        "reward/failures": groups.failures.total,  # samples x functions that raised, timed out or returned junk
        "reward/dropped": int(groups.dropped.sum()),  # samples that left the loss (a reward with on_failure=drop failed)
        **{f"reward_failures/{name}": groups.failures.counts.get(name, 0) for name in scored.per_function},
        **update_stats,  # loss, the loss's token means (kl, clip_frac, ...), grad_norm, skips, mismatch
        "lr": lr,
        "completion_len/mean": sum(lengths) / len(lengths),
        "completion_len/max": max(lengths),
        "truncation_rate": sum(t for group in rollouts.truncated for t in group) / len(lengths),
        "groups/all_correct_frac": float(groups.all_correct.float().mean()),
        "groups/all_wrong_frac": float(groups.all_wrong.float().mean()),
        "groups/kept": int(groups.keep.sum()),
        "sampling/rounds": groups.rounds,  # > 1 only with rollout.dynamic_sampling
        "sampling/groups": len(groups.rows),
        "samples": len(lengths),
        "tokens_per_s": rollouts.num_tokens / max(timings["generate"], 1e-9),
        "train_tokens": batch.train_tokens,  # kept samples' prompt + completion tokens (each prompt runs once)
        "train_tokens_per_s": batch.train_tokens / max(timings["logprobs"] + timings["update"], 1e-9),
        **{f"time/{k}": v for k, v in timings.items()},
        "time/step": sum(timings.values()),
        "elapsed_s": time.time() - started,
        **push_checks,
    }


class RunOutput:
    """Where a run's results go: metrics.jsonl (+ wandb), the console, the history for the summary.
    Only the main rank writes."""

    def __init__(self, cfg: TrainConfig, run_dir: Path, history: list[dict[str, Any]], dist: Any) -> None:
        import dataclasses

        from grpo_cli import monitor

        self.cfg, self.history, self.dist = cfg, history, dist
        self.logger = monitor.make_logger(cfg.logging, run_dir, dataclasses.asdict(cfg)) if dist.is_main \
            else monitor.NullLogger()
        self.console = monitor.make_console(cfg.trainer.steps, cfg.logging.every) if dist.is_main else \
            monitor.make_console(cfg.trainer.steps, cfg.logging.every, force_plain=True, file=open(os.devnull, "w"))
        self.watch = monitor.ZeroVarianceWatch(cfg.logging.zero_variance_threshold,
                                               cfg.logging.zero_variance_patience)
        self.console.start()

    @property
    def ranks_note(self) -> str:
        """The header's note on the processes (nothing for one)."""
        return f" | {self.dist.world_size} processes (FSDP2, an engine each)" if self.dist.world_size > 1 else ""

    def resumed(self, start: Any) -> None:
        """The resume's console lines: where from, "(saved by 2 processes, resumed on 1)" when the world
        size changed, and the lr schedule kept from the original run when trainer.steps changed."""
        saved, t_cfg = start.info.get("world_size", 1), self.cfg.trainer
        note = "" if saved == self.dist.world_size else \
            f" (saved by {saved} process{'es' * (saved > 1)}, resumed on {self.dist.world_size})"
        self.console.info(f"resumed from {start.path} at step {start.step}{note}")
        if t_cfg.lr_schedule != "constant" and start.schedule_steps != t_cfg.steps:
            self.console.info(f"lr schedule: {t_cfg.lr_schedule} over the original run's {start.schedule_steps} steps, "
                              f"kept (this run stops at trainer.steps={t_cfg.steps})")

    def header(self, line: str) -> None:
        """The run's first console lines: what runs, then the loggers' notes (e.g. wandb offline)."""
        self.console.info(line)
        for note in getattr(self.logger, "notes", []):
            self.console.info(note)

    def record(self, metrics: dict[str, Any]) -> None:
        self.logger.log(metrics, metrics["step"])
        self.console.update(metrics)
        self.history.append(metrics)

    def after_step(self, metrics: dict[str, Any], groups: Any, step: int, tokenizer: Any) -> None:
        """The zero-variance warning, and a few sample completions every logging.samples_every steps."""
        if warning := self.watch.check(metrics):
            self.console.warn(warning)
        every = self.cfg.logging.samples_every
        if every and step % every == 0:
            G = groups.group_size
            samples = [{"prompt": tokenizer.decode(groups.prompt_ids[p]), "completion": groups.rollouts.texts[p][0],
                        "rewards": {name: vals[p * G] for name, vals in groups.scored.per_function.items()},
                        "advantage": float(groups.advantages[p, 0])} for p in range(min(len(groups.rows), 4))]
            self.logger.log_samples(samples, step)
            self.console.samples(samples, step)

    def close(self) -> None:
        self.console.close()
        self.logger.close()


def maybe_evaluate(engine: Any, task: Any, encode: Any, cfg: TrainConfig, step: int, dist: Any) -> dict[str, float]:
    """Held-out metrics every eval.every steps and at the last step ({} otherwise), with their time."""
    every = cfg.eval.every or cfg.trainer.steps
    if not (step % every == 0 or step == cfg.trainer.steps):
        return {}
    tick = time.time()
    metrics = evaluate(engine, task.heldout_rows[: cfg.eval.num_problems], encode, task.reward_fns, cfg, step, dist)
    return {**metrics, "time/eval": time.time() - tick}


def evaluate(engine: Any, rows: list[dict[str, Any]], encode: Any, reward_fns: Any, cfg: TrainConfig,
             step: int, dist: Any) -> dict[str, float]:
    """Held-out metrics (sampled pass@1 = mean of the correctness reward), as eval/... keys.
    At world size > 1 the ranks' engines sample their shares of the problems (ShardedEngine), and rank 0's
    metrics are everyone's (a reward that timed out on one rank only must not split the best-model decision)."""
    from grpo_cli.evaluate import flatten, heldout_metrics
    from grpo_cli.rollout import sample_seeds

    metrics = heldout_metrics(engine, rows, encode, reward_fns, cfg.data.answer_format, cfg.eval.samples_per_problem,
                              cfg.eval.temperature, cfg.rollout.top_p, cfg.rollout.max_new_tokens,
                              sample_seeds(cfg.trainer.seed, step, len(rows), stream=1),
                              prompt_column=cfg.data.prompt_column)
    return dist.broadcast(flatten(metrics))


def maybe_checkpoint(policy: Any, tokenizer: Any, optimizer: Any, scheduler: Any, cursor: Any, best_pass: float,
                     metrics: dict[str, Any], cfg: TrainConfig, run_dir: Path, base_model: str,
                     schedule_steps: int, save_now: bool, dist: Any) -> float:
    """The best model by held-out pass@1, and a resumable checkpoint every checkpoint.every steps, at the
    end and when `save_now`; returns the best pass@1 so far."""
    import dataclasses

    from grpo_cli.checkpoint import STEP_PREFIX, prune_checkpoints, save_checkpoint, trainer_state

    step = metrics["step"]
    info = {"step": step, "task": cfg.task, "base_model": base_model, "config": dataclasses.asdict(cfg),
            "eval/pass@1": metrics.get("eval/pass@1"), "world_size": dist.world_size}
    if metrics.get("eval/pass@1", -1.0) > best_pass:
        best_pass = metrics["eval/pass@1"]
        save_checkpoint(policy, tokenizer, run_dir / "checkpoints" / "best", info, dist=dist)
    if save_now or (cfg.checkpoint.every and step % cfg.checkpoint.every == 0):
        name = "final" if step == cfg.trainer.steps else f"{STEP_PREFIX}{step:06d}"
        save_checkpoint(policy, tokenizer, run_dir / "checkpoints" / name, info,
                        trainer_state(optimizer, scheduler, cursor, best_pass, schedule_steps), optimizer=optimizer, dist=dist)
        if dist.is_main:
            prune_checkpoints(run_dir, cfg.checkpoint.keep_last)
    return best_pass


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
