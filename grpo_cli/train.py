"""`grpo train`: the GRPO training loop, one function, top to bottom.

sample prompts -> roll out [P, G] -> rewards -> group advantages -> reference
logprobs -> clipped loss + kl_coef * KL (micro-batches) -> clip grads -> AdamW
-> push weights into the rollout engine -> log -> (eval, checkpoint).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import random
import signal
import sys
import time
from pathlib import Path
from typing import Any

from grpo_cli.config import TrainConfig

log = logging.getLogger("grpo_cli.train")

PROBE_SEQUENCES = 4  # sequences re-scored by the engine in a push check


def run(cfg: TrainConfig, run_dir: Path) -> int:
    from grpo_cli import data, monitor, rewards
    from grpo_cli.errors import UsageError

    monitor.quiet_third_party(cfg.logging.verbose_libraries)  # before vLLM/datasets/transformers are imported

    # --- fail at the edge: data and reward functions before any model is loaded
    train_rows, heldout_rows = data.load_splits(cfg.data)
    reward_fns = rewards.load_rewards(cfg.rewards)
    rewards.validate_columns(train_rows, reward_fns)
    rewards.validate_columns(heldout_rows, reward_fns)

    import torch

    from grpo_cli import grpo
    from grpo_cli.checkpoint import (
        STEP_PREFIX,
        load_policy,
        load_tokenizer,
        load_trainer_state,
        read_info,
        resolve_model_path,
        save_checkpoint,
        step_checkpoints,
    )
    from grpo_cli.prompts import render
    from grpo_cli.rollout import build_engine, max_model_len, sample_seeds

    t_cfg, r_cfg = cfg.trainer, cfg.rollout
    # Threads before the engine starts: vLLM's CPU backend keeps OMP_NUM_THREADS if set (else drops
    # torch to 1 thread) and then turns torch.set_num_threads into a no-op for the whole process.
    threads = t_cfg.threads or os.cpu_count() or 1
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    torch.set_num_threads(threads)
    random.seed(t_cfg.seed)
    torch.manual_seed(t_cfg.seed)
    if t_cfg.deterministic:
        torch.use_deterministic_algorithms(True)
    try:
        model_path = resolve_model_path(cfg.model.name_or_path)
    except FileNotFoundError as e:
        raise UsageError(f"model.name_or_path: {e}") from None
    tokenizer = load_tokenizer(model_path)
    context = max_model_len(model_path, cfg.model)
    from transformers import AutoConfig

    if reason := grpo.shared_prompt_unsupported(AutoConfig.from_pretrained(model_path)):  # before any model loads
        raise UsageError(f"model.name_or_path: {reason}")

    def encode(row: dict[str, Any]) -> list[int]:
        return tokenizer(render(row[cfg.data.prompt_column], cfg.data.template, tokenizer),
                         add_special_tokens=False)["input_ids"]

    for name, rows in (("train", train_rows), ("held-out", heldout_rows)):
        texts = [render(row[cfg.data.prompt_column], cfg.data.template, tokenizer) for row in rows]
        lengths = [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
        worst = max(range(len(rows)), key=lengths.__getitem__)
        if lengths[worst] + r_cfg.max_new_tokens > context:
            raise UsageError(f"{name} row {worst}: its prompt of {lengths[worst]} tokens + rollout.max_new_tokens="
                             f"{r_cfg.max_new_tokens} exceeds the model's context of {context} tokens; lower "
                             "rollout.max_new_tokens, set model.max_context_tokens, or drop long prompts")

    # --- resume: the run directory is the resumed run's own (the CLI resolves resume=DIR|auto to it)
    start_step, state, start_path = 0, None, model_path
    if cfg.resume:
        start_path = str(step_checkpoints(run_dir)[-1])
        info = read_info(Path(start_path))
        _check_same_run(info["config"], dataclasses.asdict(cfg))
        start_step = info["step"]
        if start_step >= t_cfg.steps:
            raise UsageError(f"nothing to resume: {start_path} is at step {start_step} and trainer.steps="
                             f"{t_cfg.steps}; pass a larger trainer.steps to train further")
        state = load_trainer_state(Path(start_path))

    # --- models: the policy, the frozen reference (only when the KL term is on), the rollout engine
    policy = load_policy(start_path, cfg.model.dtype)
    policy.train()
    policy.config.use_cache = False
    ref_model = None
    if t_cfg.kl_coef > 0:
        ref_model = load_policy(model_path, cfg.model.dtype).eval().requires_grad_(False)
    engine = build_engine(r_cfg.engine, start_path, cfg.model, r_cfg, t_cfg.seed, policy, tokenizer,
                          show_progress=cfg.logging.verbose_libraries)

    eval_every = cfg.eval.every or t_cfg.steps
    optimizer = torch.optim.AdamW(param_groups(policy, t_cfg.lr, t_cfg.norm_lr_scale), lr=t_cfg.lr,
                                  betas=tuple(t_cfg.betas), weight_decay=t_cfg.weight_decay)
    schedule = LR_SCHEDULES[t_cfg.lr_schedule]
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: schedule(s, t_cfg.warmup_steps, t_cfg.steps))
    loss_fn = grpo.LOSSES[t_cfg.loss]
    order = random.Random(t_cfg.seed).sample(range(len(train_rows)), len(train_rows))
    position = 0  # index into `order` of the next prompt
    best_pass = -1.0  # best held-out pass@1 so far (checkpoints/best holds that model)
    history: list[dict[str, Any]] = []
    if state is not None:
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        order, position, best_pass = state["order"].tolist(), state["position"], state["best_pass"]
        random.setstate(state["python_rng"])
        torch.set_rng_state(state["torch_rng"])
        history = _truncate_metrics(run_dir / "metrics.jsonl", start_step)  # drop steps after the checkpoint

    started = time.time()
    exit_code = 0
    stop = GracefulStop()  # Ctrl-C: finish the step, checkpoint, exit 130; a second one exits at once
    logger = monitor.make_logger(cfg.logging, run_dir, dataclasses.asdict(cfg))  # metrics.jsonl (+ wandb)
    console = monitor.make_console(t_cfg.steps, cfg.logging.every)  # live view on a TTY, plain lines otherwise
    watch = monitor.ZeroVarianceWatch(cfg.logging.zero_variance_threshold, cfg.logging.zero_variance_patience)
    console.start()
    try:
        console.info(f"grpo train: {cfg.task} | model {model_path} | engine {r_cfg.engine} | {t_cfg.steps} steps "
                     f"of {r_cfg.prompts_per_step} prompts x {r_cfg.group_size} | run dir {run_dir}")
        for note in logger.notes:
            console.info(note)
        if start_step == 0:
            baseline = {"step": 0, **evaluate(engine, heldout_rows[: cfg.eval.num_problems], encode, reward_fns,
                                              cfg, 0)}
            logger.log(baseline, 0)
            console.update(baseline)
            history.append(baseline)
        else:
            console.info(f"resumed from {start_path} at step {start_step}")
        bad_steps = 0  # consecutive steps skipped for a non-finite loss or gradient
        for step in range(start_step + 1, t_cfg.steps + 1):
            timings: dict[str, float] = {}
            tick = time.time()

            # --- sample prompts and roll out groups: [P, G]
            rows = []
            for _ in range(r_cfg.prompts_per_step):
                if position == len(order):  # a new epoch, in a new seeded order
                    order = random.Random(t_cfg.seed + step).sample(range(len(train_rows)), len(train_rows))
                    position = 0
                rows.append(train_rows[order[position]])
                position += 1
            P, G = len(rows), r_cfg.group_size
            prompt_ids = [encode(row) for row in rows]
            rollouts = engine.generate(prompt_ids, G, r_cfg.temperature, r_cfg.top_p, r_cfg.max_new_tokens,
                                       sample_seeds(t_cfg.seed, step, P))
            timings["generate"] = time.time() - tick

            # --- rewards [P, G] and group-relative advantages [P, G]
            tick = time.time()
            completions = [text for group in rollouts.texts for text in group]  # [P*G]
            columns = {k: [row[k] for row in rows for _ in range(G)] for k in rows[0]}  # each [P*G]
            failures = rewards.RewardFailures()
            scored = rewards.score(reward_fns, completions, columns, cfg.data.answer_format, failures)
            if failures.total > len(completions) * len(reward_fns) / 2:  # most samples: the reward itself is broken
                name, reason = next(iter(failures.last_error.items()))
                raise UsageError(f"reward function '{name}' failed on most samples at step {step}: {reason}")
            reward = torch.tensor(scored.total, dtype=torch.float32).view(P, G)  # [P, G]
            reward = grpo.round_rewards(reward, t_cfg.reward_round_decimals)  # [P, G]
            advantages = grpo.group_advantages(reward, scale_by_std=t_cfg.scale_by_std)  # [P, G]
            correct = torch.tensor(next(iter(scored.per_function.values()))).view(P, G)  # [P, G] first reward
            all_correct, all_wrong = grpo.zero_variance_groups(reward, correct)  # [P], [P]
            keep = torch.ones(P, dtype=torch.bool)  # [P]
            if t_cfg.filter_zero_variance:
                keep = ~(all_correct | all_wrong)  # [P]
            timings["reward"] = time.time() - tick

            # --- the token batch of kept groups: each prompt once [P', Tp], each completion a row [b, Tc]
            kept = [p for p in range(P) if keep[p]]
            completions_kept, prompt_index, seq_adv, seq_sampling_lp = [], [], [], []
            for slot, p in enumerate(kept):
                for g in range(G):
                    completions_kept.append(rollouts.completion_ids[p][g])
                    prompt_index.append(slot)  # row of its prompt in the prompt batch
                    seq_adv.append(float(advantages[p, g]))
                    seq_sampling_lp.append(rollouts.sampling_logprobs[p][g])
            prompt_batch = _pad_rows([prompt_ids[p] for p in kept], tokenizer.pad_token_id)  # [P', Tp] x 2
            micro_batches = make_micro_batches([len(c) for c in completions_kept], t_cfg.micro_batch_size,
                                               t_cfg.micro_batch_tokens)  # completion indices, length-sorted
            # padded once, used by the reference pass and the update: prompt rows [b], ids [b, Tc], mask [b, Tc]
            passes = [(torch.tensor([prompt_index[j] for j in mb]),
                       *_pad_rows([completions_kept[j] for j in mb], tokenizer.pad_token_id)) for mb in micro_batches]

            # --- reference logprobs (no grad): the prompts once, then micro-batch by micro-batch
            tick = time.time()
            ref_lps: list[Any] = [None] * len(passes)
            if ref_model is not None and passes:
                with torch.no_grad():
                    ref_prompts = grpo.prompt_states(ref_model, *prompt_batch)
                    for i, (index, ids, mask) in enumerate(passes):
                        ref_lps[i] = grpo.completion_logprobs(ref_model, ref_prompts, index, ids, mask,
                                                              t_cfg.logprob_chunk_tokens,
                                                              temperature=r_cfg.temperature)  # [b, Tc]
            timings["logprobs"] = time.time() - tick

            # --- the update: clipped surrogate + kl_coef * KL, accumulated over micro-batches
            tick = time.time()
            optimizer.zero_grad(set_to_none=True)
            # Every micro-batch loss is divided by the full batch's normalizer, so their gradients add up
            # to the full-batch loss's (sequences for "grpo", completion tokens for "token_mean").
            normalizer = grpo.NORMALIZERS[t_cfg.loss](
                _pad_rows(completions_kept, tokenizer.pad_token_id)[1]) if passes else 1.0
            totals: dict[str, float] = {"loss": 0.0}
            stat_tokens = 0.0
            mismatch_sum, mismatch_tokens = 0.0, 0
            if passes:
                prompts = grpo.prompt_states(policy, *prompt_batch)  # with autograd: backward once, at the end
                leaves = grpo.prompt_leaves(prompts)  # collect the prompts' gradient over the micro-batches
            for i, (mb, (index, ids, mask)) in enumerate(zip(micro_batches, passes)):
                logps = grpo.completion_logprobs(policy, leaves, index, ids, mask, t_cfg.logprob_chunk_tokens,
                                                 temperature=r_cfg.temperature)  # [b, Tc]
                adv = torch.tensor([seq_adv[j] for j in mb])[:, None]  # [b, 1]
                loss, stats = loss_fn(logps, logps.detach(), ref_lps[i], adv, mask, clip_eps=t_cfg.clip_eps,
                                      clip_eps_high=t_cfg.clip_eps_high, kl_coef=t_cfg.kl_coef, normalizer=normalizer)
                loss.backward()
                totals["loss"] += float(loss.detach())
                for k in ("kl", "clip_frac", "ratio"):  # token means of this micro-batch -> token means of the batch
                    totals[k] = totals.get(k, 0.0) + stats[k] * stats["tokens"]
                stat_tokens += stats["tokens"]
                # train/inference mismatch: the engine's sampling logprobs vs the trainer's, same tokens
                sampled = _pad_values([seq_sampling_lp[j] for j in mb], mask)  # [b, Tc]
                mismatch_sum += float(((logps.detach() - sampled).abs() * mask).sum())
                mismatch_tokens += int(mask.sum())
            if passes:
                grpo.prompt_backward(prompts, leaves)  # the prompts' share of the gradient
            for k in ("kl", "clip_frac", "ratio"):
                totals[k] = totals.get(k, 0.0) / max(stat_tokens, 1.0)
            grad_norm = float(torch.nn.utils.clip_grad_norm_(policy.parameters(), t_cfg.max_grad_norm))
            finite = math.isfinite(grad_norm) and math.isfinite(totals["loss"])
            bad_steps = 0 if finite else bad_steps + 1
            if not finite:  # skip the update: one bad batch must not poison the weights
                console.warn(f"step {step}: non-finite loss or gradient, update skipped ({bad_steps} in a row)")
                if bad_steps >= t_cfg.max_bad_steps:
                    raise UsageError(f"{bad_steps} steps in a row had a non-finite loss or gradient (trainer."
                                     f"max_bad_steps={t_cfg.max_bad_steps}); lower trainer.lr or check the rewards")
            elif micro_batches:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            timings["update"] = time.time() - tick

            # --- push the new weights into the rollout engine
            tick = time.time()
            engine.push_weights(policy.state_dict().items())
            timings["push"] = time.time() - tick
            if r_cfg.push_check_every and step % r_cfg.push_check_every == 0 and passes:
                probe = [prompt_ids[kept[prompt_index[j]]] for j in range(min(PROBE_SEQUENCES, len(prompt_index)))]
                totals["push_check/max_abs_diff"] = push_check(
                    engine, policy, [ids + completions_kept[j] for j, ids in enumerate(probe)],
                    [len(ids) for ids in probe], r_cfg.push_check_tol)

            # --- log
            lengths = [len(c) for group in rollouts.completion_ids for c in group]
            train_tokens = sum(G * len(prompt_ids[p]) for p in kept) + sum(map(len, completions_kept))
            step_time = sum(timings.values())
            metrics: dict[str, Any] = {
                "step": step,
                "reward/mean": float(reward.mean()),
                "reward/std": float(reward.std(unbiased=False)),
                **{f"reward/{name}": sum(vals) / len(vals) for name, vals in scored.per_function.items()},
                "reward/failures": failures.total,
                "loss": totals.get("loss", 0.0),
                "kl": totals.get("kl", 0.0),
                "clip_frac": totals.get("clip_frac", 0.0),
                "grad_norm": grad_norm if finite else None,
                "skipped_nonfinite": int(not finite),
                "lr": scheduler.get_last_lr()[0],
                "completion_len/mean": sum(lengths) / len(lengths),
                "completion_len/max": max(lengths),
                "truncation_rate": sum(t for group in rollouts.truncated for t in group) / len(lengths),
                "groups/all_correct_frac": float(all_correct.float().mean()),
                "groups/all_wrong_frac": float(all_wrong.float().mean()),
                "groups/kept": int(keep.sum()),
                "mismatch/mean_abs_logprob": mismatch_sum / max(mismatch_tokens, 1),
                "samples": len(completions),
                "tokens_per_s": rollouts.num_tokens / max(timings["generate"], 1e-9),
                "train_tokens": train_tokens,  # kept samples' prompt + completion tokens (each prompt runs once)
                "train_tokens_per_s": train_tokens / max(timings["logprobs"] + timings["update"], 1e-9),
                **{f"time/{k}": v for k, v in timings.items()},
                "time/step": step_time,
                "elapsed_s": time.time() - started,
            }
            metrics.update({k: v for k, v in totals.items() if k.startswith("push_check/")})
            if step % eval_every == 0 or step == t_cfg.steps:
                tick = time.time()
                metrics.update(evaluate(engine, heldout_rows[: cfg.eval.num_problems], encode, reward_fns, cfg, step))
                metrics["time/eval"] = time.time() - tick
            logger.log(metrics, step)
            console.update(metrics)
            history.append(metrics)

            # --- checkpoints: periodic (resumable), the best by held-out pass@1, and one on Ctrl-C
            info = {"step": step, "task": cfg.task, "base_model": model_path, "config": dataclasses.asdict(cfg),
                    "eval/pass@1": metrics.get("eval/pass@1")}
            if metrics.get("eval/pass@1", -1.0) > best_pass:
                best_pass = metrics["eval/pass@1"]
                save_checkpoint(policy, tokenizer, run_dir / "checkpoints" / "best", info)
            last = step == t_cfg.steps
            if last or stop.requested or (cfg.checkpoint.every and step % cfg.checkpoint.every == 0):
                trainer_state = {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                                 "order": torch.tensor(order), "position": position, "best_pass": best_pass,
                                 "python_rng": random.getstate(), "torch_rng": torch.get_rng_state()}
                name = "final" if last else f"{STEP_PREFIX}{step:06d}"
                save_checkpoint(policy, tokenizer, run_dir / "checkpoints" / name, info, trainer_state)
                _prune_checkpoints(run_dir / "checkpoints", cfg.checkpoint.keep_last)
            if warning := watch.check(metrics):
                console.warn(warning)
            if cfg.logging.samples_every and step % cfg.logging.samples_every == 0:
                samples = [{"prompt": tokenizer.decode(prompt_ids[p]), "completion": rollouts.texts[p][0],
                            "rewards": {name: vals[p * G] for name, vals in scored.per_function.items()},
                            "advantage": float(advantages[p, 0])} for p in range(min(P, 4))]
                logger.log_samples(samples, step)
                console.samples(samples, step)
            if stop.requested and not last:
                console.warn(f"interrupted at step {step}: checkpoint saved; continue with the same command "
                             f"plus resume={run_dir}")
                exit_code = 130
                break
    finally:
        stop.restore()
        console.close()
        logger.close()
    from grpo_cli.plot import plot_runs

    plot_runs([run_dir], run_dir / "metrics.png")
    for line in monitor.summary_lines(history, run_dir, time.time() - started):
        print(line)
    return exit_code


class GracefulStop:
    """SIGINT handling: the first Ctrl-C asks the loop to stop after the current step (it
    checkpoints and exits 130); a second one exits at once with 130."""

    def __init__(self) -> None:
        self.requested = False
        self._previous = signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:
            print("\ninterrupted twice: exiting now", file=sys.stderr, flush=True)
            os._exit(130)  # vLLM's threads could hold a normal exit; nothing half-written: saves are atomic
        self.requested = True
        print("\ninterrupt: stopping after this step and saving a checkpoint (Ctrl-C again to quit now)",
              file=sys.stderr, flush=True)

    def restore(self) -> None:
        signal.signal(signal.SIGINT, self._previous)


# Keys that may change between a run and its resume; any other difference would make the
# resumed run a different experiment, so it is refused.
RESUMABLE_CHANGES = ("resume", "output_dir", "trainer.steps", "logging.", "checkpoint.", "eval.every")


def _check_same_run(saved: dict[str, Any], current: dict[str, Any]) -> None:
    from grpo_cli.errors import UsageError

    def flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
        return out

    a, b = flat(saved), flat(current)
    changed = [k for k in sorted(set(a) | set(b))
               if a.get(k) != b.get(k) and not any(k == c or k.startswith(c) for c in RESUMABLE_CHANGES)]
    if changed:
        diffs = ", ".join(f"{k} ({a.get(k)!r} -> {b.get(k)!r})" for k in changed[:5])
        raise UsageError(f"resume: the config differs from the run's: {diffs}; only "
                         f"{', '.join(RESUMABLE_CHANGES[2:])} may change")


def _truncate_metrics(path: Path, last_step: int) -> list[dict[str, Any]]:
    """Keep metrics up to `last_step` (steps logged after the checkpoint are replayed) and return them."""
    if not path.is_file():
        return []
    kept = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    kept = [m for m in kept if m.get("step", 0) <= last_step]
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(m) + "\n" for m in kept))
    tmp.replace(path)
    return kept


def _prune_checkpoints(root: Path, keep_last: int) -> None:
    """Delete periodic checkpoints beyond the newest `keep_last` (best and final are not periodic)."""
    import shutil

    from grpo_cli.checkpoint import STEP_PREFIX

    periodic = sorted(p for p in root.glob(f"{STEP_PREFIX}*") if p.is_dir() and ".tmp-" not in p.name)
    for old in periodic[:-keep_last]:
        shutil.rmtree(old)


def evaluate(engine: Any, rows: list[dict[str, Any]], encode: Any, reward_fns: Any, cfg: TrainConfig,
             step: int) -> dict[str, float]:
    """Held-out metrics (sampled pass@1 = mean of the first reward, the correctness check), as eval/... keys."""
    from grpo_cli.evaluate import flatten, heldout_metrics
    from grpo_cli.rollout import sample_seeds

    metrics = heldout_metrics(engine, rows, encode, reward_fns, cfg.data.answer_format, cfg.eval.samples_per_problem,
                              cfg.eval.temperature, cfg.rollout.top_p, cfg.rollout.max_new_tokens,
                              sample_seeds(cfg.trainer.seed, step, len(rows), stream=1))
    return flatten(metrics)


def push_check(engine: Any, policy: Any, sequences: list[list[int]], prompt_lens: list[int], tol: float) -> float:
    """Re-score a probe batch in the engine and compare with the trainer: stale weights stop the run."""
    import torch

    from grpo_cli import grpo

    engine_lp = engine.score(sequences)
    worst = 0.0
    with torch.no_grad():
        for seq, n, elp in zip(sequences, prompt_lens, engine_lp):
            ids = torch.tensor([seq])  # [1, T]
            trainer_lp = grpo.token_logprobs_reference(policy, ids, torch.ones_like(ids))[0]  # [T-1]
            diff = (trainer_lp[n - 1:] - torch.tensor(elp[n - 1:])).abs()  # [T-n] completion tokens
            worst = max(worst, float(diff.mean()) if diff.numel() else 0.0)
    if worst > tol:
        raise RuntimeError(f"the rollout engine holds stale weights: its logprobs differ from the trainer's by "
                           f"{worst:.2e} (> rollout.push_check_tol={tol:g}) after a weight push")
    return worst


def constant_lr(index: int, warmup: int, total: int) -> float:
    """LR factor of optimizer step `index` (0-based): linear warm-up over `warmup` steps, then 1."""
    return min(1.0, (index + 1) / warmup) if warmup else 1.0


def linear_lr(index: int, warmup: int, total: int) -> float:
    """Warm-up, then a straight line from 1 down to 0 at step `total` (the last step gets 1/(total-warmup))."""
    if index < warmup:
        return constant_lr(index, warmup, total)
    return max(0.0, (total - index) / max(total - warmup, 1))


def cosine_lr(index: int, warmup: int, total: int) -> float:
    """Warm-up, then half a cosine from 1 down to 0 at step `total`."""
    if index < warmup:
        return constant_lr(index, warmup, total)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, (index - warmup) / max(total - warmup, 1))))


# trainer.lr_schedule picks one by name. On resume with a larger trainer.steps the decay stretches to the new end.
LR_SCHEDULES = {"constant": constant_lr, "linear": linear_lr, "cosine": cosine_lr}


def param_groups(model: Any, lr: float, norm_lr_scale: float) -> list[dict[str, Any]]:
    """AdamW groups: normalization gains (1-D weights named *norm*) at `lr * norm_lr_scale`, the rest at `lr`.

    Why: Adam moves every weight by about lr a step, whatever its gradient's size. A
    norm gain of ~1 that has to change by ~50% (e.g. to sharpen the output distribution,
    as the final norm sets the logits' scale) then needs thousands of steps at a learning
    rate that is safe for the matrices.
    """
    if norm_lr_scale == 1.0:
        return [{"params": list(model.parameters()), "lr": lr}]  # one group: trainer states stay as before
    norms, rest = [], []
    for name, param in model.named_parameters():
        (norms if param.ndim == 1 and "norm" in name.lower() else rest).append(param)
    return [{"params": rest, "lr": lr}, {"params": norms, "lr": lr * norm_lr_scale}]


def make_micro_batches(lengths: list[int], max_seqs: int, max_tokens: int = 0) -> list[list[int]]:
    """Sequence indices grouped into forward/backward passes, shortest first.

    Sorting by length puts similar lengths together, so little compute goes to padding
    (issue 8: the reference pass + update of a default step went from 1.23 s to 0.86 s).
    Each pass holds at most `max_seqs` sequences and, when `max_tokens > 0`, at most
    `max_tokens` padded tokens (rows x longest row); a single longer sequence gets a pass
    of its own. The order does not change the loss: every micro-batch is divided by the
    full batch's normalizer and the gradients add up.
    """
    batches: list[list[int]] = []
    for j in sorted(range(len(lengths)), key=lengths.__getitem__):  # ascending: lengths[j] is the batch's width
        fits = batches and len(batches[-1]) < max_seqs and (
            not max_tokens or (len(batches[-1]) + 1) * lengths[j] <= max_tokens)
        if fits:
            batches[-1].append(j)
        else:
            batches.append([j])
    return batches


def _pad_rows(rows: list[list[int]], pad_id: int) -> tuple[Any, Any]:
    """Right-padded ids [n, T] and their float mask [n, T] (1 on real tokens); T is at least 1."""
    import torch

    width = max([1, *map(len, rows)])
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)  # [n, T]
    mask = torch.zeros((len(rows), width), dtype=torch.float32)  # [n, T]
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        mask[i, : len(row)] = 1.0
    return ids, mask


def _pad_values(values: list[list[float]], mask: Any) -> Any:
    """Per-token values of each completion, right-padded with 0 like `mask` [b, Tc]."""
    import torch

    out = torch.zeros_like(mask)  # [b, Tc]
    for i, row in enumerate(values):
        out[i, : len(row)] = torch.tensor(row[: out.shape[1]], dtype=out.dtype)
    return out
