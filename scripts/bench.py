"""Benchmark: grpo against TRL's GRPOTrainer on one workload, our step against its two limits,
how cost grows with work, and the loss's peak memory.

    make bench                      # everything (about 15 minutes on 2 CPU cores)
    python scripts/bench.py --quick # fewer steps and scaling points (about 6 minutes)
    python scripts/bench.py --only compare,bounds --steps 10
    python scripts/bench.py --only bounds --set rollout.temperature=0.7

Sections (each heavy piece runs in its own subprocess, one at a time, so nothing
shares the CPU with it and no engine outlives its measurement):

- compare: the default workload of `recipes/bike_pricing.yaml` (shipped base model,
  P prompts x G samples, max_new_tokens, kl_coef, one update per batch) run by
  `grpo train` and by TRL's GRPOTrainer, alternating, R rounds each. Seconds per
  step (median, spread), generated tokens/s, and the ratio. Fairness check: the
  step-1..3 correctness reward of each must match the base model's accuracy on the
  same prompts, measured with vLLM in the bounds section.
- bounds: raw vLLM `generate` on the same prompts and sampling settings (the bound of
  our rollout phase; also asked for one logprob per token, what vLLM charges for them),
  our rollouts as the run samples them and with every sample's logprobs (as a mismatch
  correction needs), and a plain transformers forward+backward over a batch of the
  same kind (the bound of our training phase); our phase split and each phase's ratio
  to its bound.
- scaling: `grpo train` steps as group_size goes 4..32 and max_new_tokens 32..128.
- memory: peak memory of the loss (log-probabilities of the sampled tokens, forward
  and backward) as sequence length and vocabulary grow, chunked vs full logits.
- gpu: only with a CUDA device: training tokens/s and model FLOP utilisation of a
  ~0.5B-parameter Qwen2 built from a config (no download).

Results: printed tables, and every number in `--out` (JSON). No assertion on timings:
this is a measuring tool, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from grpo_cli.runtime import usable_cpus

ROOT = Path(__file__).resolve().parent.parent
RECIPE = "bike_pricing"


# ---------------------------------------------------------------------------- shared helpers


def load_recipe(overrides: list[str] | None = None) -> Any:
    """The recipe as the typed TrainConfig the CLI would build (same composition and checks)."""
    from grpo_cli.cli import load_config

    return load_config("train", [f"recipe={RECIPE}", *(overrides or [])])


def workload_prompts(cfg: Any, count: int) -> tuple[list[dict], list[str]]:
    """The first `count` training rows in the order `grpo train` visits them, and their prompt texts."""
    import random

    from grpo_cli.prompts import rows as data
    from grpo_cli.prompts.templates import render_row

    train_rows, _ = data.load_splits(cfg.data)
    order = random.Random(cfg.trainer.seed).sample(range(len(train_rows)), len(train_rows))
    rows = [train_rows[i] for i in order[:count]]
    return rows, [render_row(r, cfg.data) for r in rows]


def spread(values: list[float]) -> dict[str, float]:
    """Median and the interquartile range (robust to one slow step)."""
    ordered = sorted(values)
    q = statistics.quantiles(ordered, n=4) if len(ordered) >= 2 else [ordered[0]] * 3
    return {"median": statistics.median(ordered), "p25": q[0], "p75": q[2], "n": len(ordered)}


def run_worker(name: str, args: list[str], timeout_s: int) -> dict[str, Any]:
    """Run `bench.py --worker NAME ...` in a fresh process; it writes its result as JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", name, "--result", str(out), *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)
        if out.is_file():
            return json.loads(out.read_text())
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise RuntimeError(f"worker {name} {' '.join(args)} failed (exit {proc.returncode}):\n{tail}")


def rss_bytes() -> int:
    """Current resident set size of this process."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


# ---------------------------------------------------------------------------- ours: `grpo train`


# TRL's optimizer settings: one lr for every weight, constant after warm-up (the recipe's norm-gain
# lr and cosine decay change what is learned, not what a step costs).
SAME_OPTIMIZER = ["trainer.norm_lr_scale=1", "trainer.lr_schedule=constant"]


def run_ours(overrides: list[str], steps: int, warmup: int, timeout_s: int = 1800) -> dict[str, Any]:
    """`grpo train` on the recipe, `warmup + steps` steps; per-step timings come from its metrics.jsonl."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [str(Path(sys.executable).parent / "grpo"), "train", f"recipe={RECIPE}",
               f"trainer.steps={warmup + steps}", "eval.every=0", "eval.num_problems=8",
               "checkpoint.every=0", "logging.samples_every=0", f"output_dir={tmp}",
               *SAME_OPTIMIZER, *overrides]
        started = time.time()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)
        wall = time.time() - started
        files = list(Path(tmp).glob("*/*/metrics.jsonl"))
        if proc.returncode != 0 or not files:
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
            raise RuntimeError(f"grpo train failed (exit {proc.returncode}): {' '.join(cmd)}\n{tail}")
        metrics = [json.loads(line) for line in files[0].read_text().splitlines() if line.strip()]
    steps_m = [m for m in metrics if m["step"] > warmup and "time/step" in m]
    first = [m for m in metrics if 1 <= m["step"] <= 3]
    phases = ("generate", "reward", "logprobs", "update", "push")
    total = sum(m["time/step"] for m in steps_m)
    return {
        "command": " ".join(["grpo", *[c for c in cmd[1:] if not c.startswith("output_dir=")]]),
        "step_s": spread([m["time/step"] for m in steps_m]),
        "gen_tokens_per_s": sum(m["completion_len/mean"] * m["samples"] for m in steps_m) / total,
        "rollout_tokens_per_s": spread([m["tokens_per_s"] for m in steps_m]),
        "train_tokens_per_s": sum(m["train_tokens"] for m in steps_m)
        / sum(m["time/logprobs"] + m["time/update"] for m in steps_m),
        "phase_fraction": {p: sum(m[f"time/{p}"] for m in steps_m) / total for p in phases},
        "phase_s": {p: statistics.median(m[f"time/{p}"] for m in steps_m) for p in phases},
        "early_correct": statistics.mean(m["reward/correct"] for m in first),
        "mean_length": statistics.mean(m["completion_len/mean"] for m in steps_m),
        "wall_s": wall,
    }


# ---------------------------------------------------------------------------- TRL's GRPOTrainer


def worker_trl(args: argparse.Namespace) -> dict[str, Any]:
    """TRL's GRPOTrainer on the same workload: same model, prompts, sampling, loss, optimizer settings."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from grpo_cli import rewards
    from grpo_cli.weights.checkpoint import resolve_model_path

    cfg = load_recipe()
    torch.set_num_threads(usable_cpus())
    r, t = cfg.rollout, cfg.trainer
    steps = args.warmup + args.steps
    rows, prompts = workload_prompts(cfg, steps * r.prompts_per_step)
    dataset = Dataset.from_list([{"prompt": p, "answer": row["answer"]} for p, row in zip(prompts, rows)])
    model_path = resolve_model_path(cfg.model.name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)

    def correct(completions: list[str], answer: list[str], **kwargs: Any) -> list[float]:
        return rewards.correct(completions, answer, cfg.data.answer_format)

    def format(completions: list[str], **kwargs: Any) -> list[float]:  # noqa: A001 (TRL logs it by __name__)
        return rewards.format_ok(completions, cfg.data.answer_format)

    times: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *a: Any, **k: Any) -> None:
            self.start = time.perf_counter()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            times.append(time.perf_counter() - self.start)

    with tempfile.TemporaryDirectory() as tmp:
        config = GRPOConfig(
            output_dir=tmp, report_to=[], save_strategy="no", logging_steps=1, seed=t.seed, use_cpu=True,
            max_steps=steps, per_device_train_batch_size=r.prompts_per_step * r.group_size,
            gradient_accumulation_steps=1, num_generations=r.group_size, num_iterations=1,
            max_completion_length=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, top_k=0,
            beta=t.kl_coef, epsilon=t.clip_eps, loss_type="grpo", scale_rewards="group",
            learning_rate=t.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=t.weight_decay,
            adam_beta1=t.betas[0], adam_beta2=t.betas[1], max_grad_norm=t.max_grad_norm,
            reward_weights=[w.weight for w in cfg.rewards], use_vllm=args.trl_vllm, vllm_mode="colocate",
            shuffle_dataset=False,  # the rows are already in grpo train's order: both see the same prompts per step
            bf16=False, fp16=False, dataloader_num_workers=0, log_completions=False, disable_tqdm=True,
        )
        trainer = GRPOTrainer(model=model, reward_funcs=[correct, format], args=config, train_dataset=dataset,
                              processing_class=tokenizer, callbacks=[StepTimer()])
        trainer.train()
        logs = [h for h in trainer.state.log_history if "rewards/correct/mean" in h]
    measured = list(range(args.warmup, steps))
    return {
        "step_s": spread([times[i] for i in measured]),
        "gen_tokens_per_s": sum(logs[i]["completions/mean_length"] * r.prompts_per_step * r.group_size
                                for i in measured) / sum(times[i] for i in measured),
        "early_correct": statistics.mean(h["rewards/correct/mean"] for h in logs[:3]),
        "mean_length": statistics.mean(logs[i]["completions/mean_length"] for i in measured),
        "generation": "vLLM colocate" if args.trl_vllm else "transformers generate",
    }


# ---------------------------------------------------------------------------- the limits of our step


def worker_bounds(args: argparse.Namespace) -> dict[str, Any]:
    """Raw vLLM generate vs our rollout path (same engine, prompts, seeds, settings, alternating), the
    base model's accuracy on the workload's prompts, and plain forward/backward over one step's tokens."""
    threads = usable_cpus()
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    import torch
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams

    from grpo_cli import rewards
    from grpo_cli.engines.vllm import VLLMEngine
    from grpo_cli.step.rollout import sample_seeds, training_sampling
    from grpo_cli.weights.checkpoint import resolve_model_path

    torch.set_num_threads(threads)
    cfg = load_recipe(args.set)
    r, P, G = cfg.rollout, cfg.rollout.prompts_per_step, cfg.rollout.group_size
    steps = args.warmup + args.steps
    rows, prompts = workload_prompts(cfg, P * steps)
    model_path = resolve_model_path(cfg.model.name_or_path)
    engine = VLLMEngine(model_path, cfg.model, r, cfg.trainer.seed)
    tok = engine.tokenizer
    prompt_ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]

    def raw(batch: list[list[int]], seeds: list[int], logprobs: int | None = None) -> Any:
        """vLLM's defaults (detokenized text, no logprobs) with the run's sampling settings; `logprobs=0`: one
        logprob per token too, the engine's own mode (what vLLM itself charges for them)."""
        params = [SamplingParams(n=G, temperature=r.temperature, top_p=r.top_p, max_tokens=r.max_new_tokens, seed=s,
                                 logprobs=logprobs) for s in seeds]
        return engine.llm.generate([{"prompt_token_ids": ids} for ids in batch], params, use_tqdm=False)

    names = ["ours", "ours_every_logprob", "raw", "raw_logprobs"]
    tps: dict[str, list[float]] = {name: [] for name in names}
    correct, last = [], None
    for k in range(steps):
        batch = prompt_ids[k * P:(k + 1) * P]
        seeds = sample_seeds(cfg.trainer.seed, k + 1, P, group_size=G)
        tokens: dict[str, int] = {}
        for name in names[k % len(names):] + names[:k % len(names)]:  # rotate who goes first
            engine.llm.reset_prefix_cache()  # none reuses another's prompt KV blocks
            tick = time.perf_counter()
            if name.startswith("ours"):  # the run's own sampling (logprobs for rollout.mismatch_groups), or all
                sampling = training_sampling(cfg, seeds)
                ours = engine.generate(batch, sampling if name == "ours" else sampling._replace(logprob_seeds=None),
                                       seeds)
                tokens[name] = ours.num_tokens
            else:
                outs = raw(batch, seeds, 0 if name == "raw_logprobs" else None)
                tokens[name] = sum(len(c.token_ids) for o in outs for c in o.outputs)
            if k >= args.warmup:
                tps[name].append(tokens[name] / (time.perf_counter() - tick))
            if name == "raw":
                texts = [c.text for o in outs for c in o.outputs]
        scores = rewards.correct(texts, [row["answer"] for row in rows[k * P:(k + 1) * P] for _ in range(G)],
                                 cfg.data.answer_format)  # [P*G]
        correct += [statistics.mean(scores[p * G:(p + 1) * G]) for p in range(P)]  # per prompt
        last = (batch, ours)

    # The training bound: one step's sequences (prompt + completion) through plain transformers code.
    batch, ours = last
    sequences = [p + c for p, group in zip(batch, ours.completion_ids) for c in group]
    tokens = sum(len(s) for s in sequences)
    policy = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval().requires_grad_(False)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-12)

    def plain_step(rows_per_pass: int) -> float:
        """Reference forward (no grad) + forward/backward with full logits + AdamW, arrival order."""
        tick = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        for i in range(0, len(sequences), rows_per_pass):
            part = sequences[i:i + rows_per_pass]
            width = max(len(s) for s in part)
            ids = torch.tensor([s + [tok.pad_token_id] * (width - len(s)) for s in part])  # [b, T]
            attn = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in part])  # [b, T]
            labels = ids.masked_fill(attn == 0, -100)  # [b, T]
            with torch.no_grad():
                ref(input_ids=ids, attention_mask=attn)
            policy(input_ids=ids, attention_mask=attn, labels=labels).loss.backward()
        optimizer.step()
        return time.perf_counter() - tick

    plain = {}
    for rows_per_pass in (len(sequences), 16):
        plain_step(rows_per_pass)  # warm-up
        plain[str(rows_per_pass)] = spread([tokens / plain_step(rows_per_pass) for _ in range(5)])
    return {
        "ours_rollout_tokens_per_s": spread(tps["ours"]),
        "ours_every_logprob_tokens_per_s": spread(tps["ours_every_logprob"]),
        "raw_vllm_tokens_per_s": spread(tps["raw"]),
        "raw_vllm_logprobs_tokens_per_s": spread(tps["raw_logprobs"]),
        "overrides": args.set,
        "base_correct_per_prompt": correct,  # the base model's accuracy on each prompt, in grpo train's order
        "plain_train_tokens_per_s": plain,
        "train_batch": {"sequences": len(sequences), "tokens": tokens},
        "steps": steps,
    }


# ---------------------------------------------------------------------------- loss memory


def worker_memory(args: argparse.Namespace) -> dict[str, Any]:
    """Peak memory of the loss's log-probabilities (forward + backward) on `tokens` positions and a
    `vocab`-sized head, chunked (grpo_cli.algorithm.grpo) or through full logits. Its own process: ru_maxrss
    is a high-water mark, so the growth over the RSS before the computation is the peak it needed."""
    import torch
    import torch.nn.functional as F

    from grpo_cli.algorithm.passes import logprobs_from_hidden

    torch.set_num_threads(usable_cpus())
    g = torch.Generator().manual_seed(0)
    hidden_size = 256
    hidden = torch.randn(1, args.tokens, hidden_size, generator=g).requires_grad_(True)  # [1, T, H]
    weight = (0.02 * torch.randn(args.vocab, hidden_size, generator=g)).requires_grad_(True)  # [V, H]
    targets = torch.randint(0, args.vocab, (1, args.tokens), generator=g)  # [1, T]

    def forward_backward(tokens: int) -> None:
        if args.impl == "chunked":
            logp = logprobs_from_hidden(hidden[:, :tokens], weight, targets[:, :tokens], chunk_tokens=1024)  # [1, t]
        else:
            logits = F.linear(hidden[:, :tokens], weight).float()  # [1, t, V]
            logp = torch.log_softmax(logits, -1).gather(-1, targets[:, :tokens, None])[..., 0]  # [1, t]
        logp.sum().backward()

    # A warm-up on 8 positions first, so `seconds` times the computation rather than first-call set-up
    # (lazy imports, kernel selection); it allocates next to nothing, so the RSS mark below is unchanged.
    forward_backward(8)
    hidden.grad, weight.grad = None, None
    before = rss_bytes()
    tick = time.perf_counter()
    forward_backward(args.tokens)
    seconds = time.perf_counter() - tick
    return {"peak_bytes": peak_rss_bytes() - before, "seconds": seconds,
            "full_logits_bytes": 4 * args.tokens * args.vocab}


# ---------------------------------------------------------------------------- GPU (only with CUDA)

PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L4": 121e12, "A10": 125e12}  # dense


def worker_gpu(args: argparse.Namespace) -> dict[str, Any]:
    """Training-side tokens/s and MFU of a ~0.5B Qwen2 (Qwen2.5-0.5B's shape) built from a config."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from grpo_cli.algorithm import grpo, passes

    config = Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
                         max_position_embeddings=4096)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to("cuda", torch.bfloat16)
    model.config.use_cache = False
    params = sum(p.numel() for p in model.parameters())
    batch, seq = 8, 1024
    ids = torch.randint(0, config.vocab_size, (batch, seq), device="cuda")  # [B, T]
    attn = torch.ones_like(ids)  # [B, T]
    mask = torch.ones(batch, seq - 1, device="cuda")  # [B, T-1]
    adv = torch.randn(batch, device="cuda")  # [B]
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(), "params": params, "batch": [batch, seq]}

    def ours() -> None:
        logp = passes.token_logprobs(model, ids, attn, chunk_tokens=4096)  # [B, T-1]
        loss, _ = grpo.grpo_loss(grpo.LossInputs(logp, mask, adv))
        loss.backward()

    def plain() -> None:
        model(input_ids=ids, attention_mask=attn, labels=ids).loss.backward()

    for name, fn in (("ours", ours), ("plain", plain)):
        fn()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(5):
            torch.cuda.synchronize()
            tick = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - tick)
            model.zero_grad(set_to_none=True)
        tokens_per_s = batch * seq / statistics.median(times)
        # 6 flops per parameter and token (forward + backward), the tied head counted once, plus attention
        flops_per_token = 6 * params + 12 * config.num_hidden_layers * config.hidden_size * seq
        peak = next((v for k, v in PEAK_BF16_FLOPS.items() if k in results["device"]), None)
        results[name] = {"tokens_per_s": tokens_per_s, "peak_memory_bytes": torch.cuda.max_memory_allocated(),
                         "mfu": tokens_per_s * flops_per_token / peak if peak else None}
    return results


# ---------------------------------------------------------------------------- the report


def table(title: str, header: list[str], rows: list[list[Any]]) -> str:
    cells = [header] + [[f"{v:,.3f}" if isinstance(v, float) and abs(v) < 100 else
                         f"{v:,.0f}" if isinstance(v, float) else str(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = [title, "  ".join(h.ljust(w) for h, w in zip(header, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
              for r in cells[1:]]
    return "\n".join(lines)


def say(text: str) -> None:
    print(text, flush=True)


def section_compare(args: argparse.Namespace, report: dict[str, Any]) -> None:
    say(f"\n== compare: grpo vs TRL GRPOTrainer, {args.rounds} alternating rounds of {args.warmup} + {args.steps} "
        "steps ...")
    try:
        run_worker("trl", ["--trl-vllm", "--steps", "1", "--warmup", "0"], timeout_s=900)
        trl_vllm = "TRL's vLLM colocate mode ran"
    except RuntimeError as e:
        last = [line for line in str(e).splitlines() if line.strip()][-1].removeprefix("[rank0]: ")
        trl_vllm = f"TRL's vLLM colocate mode fails on the CPU backend at its first weight sync: {last}"
    say(trl_vllm)
    ours_runs, trl_runs = [], []
    for i in range(args.rounds):
        say(f"  round {i + 1}: grpo train ...")
        ours_runs.append(run_ours([], args.steps, args.warmup))
        say(f"  round {i + 1}: TRL GRPOTrainer ...")
        trl_runs.append(run_worker("trl", ["--steps", str(args.steps), "--warmup", str(args.warmup)], timeout_s=1800))
    report["compare"] = {"ours": ours_runs, "trl": trl_runs, "trl_vllm": trl_vllm}


def section_bounds(args: argparse.Namespace, report: dict[str, Any]) -> None:
    say("\n== bounds: raw vLLM generate and plain forward/backward, same prompts and settings ...")
    report["bounds"] = run_worker("bounds", ["--steps", str(args.steps), "--warmup", str(args.warmup),
                                             "--set", *args.set], 1800)


def section_scaling(args: argparse.Namespace, report: dict[str, Any]) -> None:
    points = [("rollout.group_size", g) for g in ((4, 16) if args.quick else (4, 8, 16, 32))]
    points += [("rollout.max_new_tokens", n) for n in ((32, 128) if args.quick else (32, 64, 128))]
    say(f"\n== scaling: {len(points)} short grpo train runs ...")
    report["scaling"] = []
    for key, value in points:
        result = run_ours([f"{key}={value}"], max(3, args.steps // 2), 1)
        report["scaling"].append({"key": key, "value": value, **result})


def section_memory(args: argparse.Namespace, report: dict[str, Any]) -> None:
    points = [(t, 32768) for t in ((1024, 8192) if args.quick else (1024, 4096, 16384))]
    points += [(4096, v) for v in ((8192, 131072) if args.quick else (8192, 32768, 131072))]
    say(f"\n== memory: the loss's peak memory at {len(points)} sizes, chunked and full logits ...")
    report["memory"] = []
    for tokens, vocab in dict.fromkeys(points):
        for impl in ("chunked", "full"):
            res = run_worker("memory", ["--tokens", str(tokens), "--vocab", str(vocab), "--impl", impl], 600)
            report["memory"].append({"tokens": tokens, "vocab": vocab, "impl": impl, **res})


def section_gpu(args: argparse.Namespace, report: dict[str, Any]) -> None:
    import torch

    if not torch.cuda.is_available():
        say("\n== gpu: skipped (no CUDA device)")
        report["gpu"] = "skipped: no CUDA device"
        return
    say("\n== gpu: a ~0.5B Qwen2 from a config, forward/backward ...")
    report["gpu"] = run_worker("gpu", [], 900)


SECTIONS = {"compare": section_compare, "bounds": section_bounds, "scaling": section_scaling,
            "memory": section_memory, "gpu": section_gpu}


def print_report(report: dict[str, Any]) -> None:
    mib = 2**20
    if "compare" in report:
        c = report["compare"]
        ours_steps = [s for run in c["ours"] for s in [run["step_s"]["median"]]]
        trl_steps = [s for run in c["trl"] for s in [run["step_s"]["median"]]]
        o_med, t_med = statistics.median(ours_steps), statistics.median(trl_steps)
        o_tps = statistics.mean(run["gen_tokens_per_s"] for run in c["ours"])
        t_tps = statistics.mean(run["gen_tokens_per_s"] for run in c["trl"])
        rows = [["grpo (vLLM rollouts)", o_med, f"{min(ours_steps):.2f}-{max(ours_steps):.2f}", o_tps,
                 statistics.mean(r["early_correct"] for r in c["ours"]), 1.0],
                [f"TRL {trl_version()} ({c['trl'][0]['generation']})", t_med,
                 f"{min(trl_steps):.2f}-{max(trl_steps):.2f}", t_tps,
                 statistics.mean(r["early_correct"] for r in c["trl"]), t_med / o_med]]
        say("\n" + table("Same workload (recipe bike_pricing), median s/step per round; speed-up = TRL s/step / ours",
                         ["trainer", "s/step", "round medians", "generated tok/step-s", "step 1-3 correct", "speed-up"], rows))
        if "bounds" in report:
            say(fairness(report))
        say(c["trl_vllm"])
    if "bounds" in report:
        b = report["bounds"]
        o, raw = b["ours_rollout_tokens_per_s"]["median"], b["raw_vllm_tokens_per_s"]["median"]
        plain = {k: v["median"] for k, v in b["plain_train_tokens_per_s"].items()}
        best_plain = max(plain.values())
        raw_lp = b["raw_vllm_logprobs_tokens_per_s"]["median"]
        every = b["ours_every_logprob_tokens_per_s"]["median"]
        rows = [["rollout: our generate (same engine, the run's logprobs)", o, "", ""],
                ["rollout: ours, every sample's logprobs (a mismatch correction)", every, "",
                 f"every/raw {every / raw:.2f}"],
                ["rollout: raw vLLM LLM.generate", raw, "", f"ours/raw {o / raw:.2f}"],
                ["rollout: raw vLLM, one logprob per token", raw_lp, "", f"raw+logprobs/raw {raw_lp / raw:.2f}"]]
        for k, v in plain.items():
            rows.append([f"training: plain fwd+bwd, {k} rows/pass", v, "", ""])
        if "compare" in report:
            ours_train = statistics.mean(run["train_tokens_per_s"] for run in report["compare"]["ours"])
            rows.append(["training: ours (logprobs + update, each prompt once)", ours_train, "",
                         f"ours/best plain {ours_train / best_plain:.2f}"])
        say("\n" + table("Our step against its limits (tokens/s; training tokens = prompt + completion of every "
                         "sample, though ours runs each group's prompt once)", ["path", "tokens/s", "", "ratio"], rows))
    if "compare" in report:
        run = report["compare"]["ours"][-1]
        frac = run["phase_fraction"]
        say("\n" + table("Our phase split (grpo train, last round)", ["phase", "median s", "fraction of step"],
                         [[p, run["phase_s"][p], f"{frac[p]:.1%}"] for p in frac]))
    if "scaling" in report:
        rows = [[f"{s['key'].split('.')[-1]}={s['value']}", s["step_s"]["median"], s["gen_tokens_per_s"],
                 s["train_tokens_per_s"], s["mean_length"]] for s in report["scaling"]]
        say("\n" + table("Scaling (grpo train, other settings from the recipe)",
                         ["setting", "s/step", "generated tok/step-s", "train tok/s", "mean length"], rows))
    if "memory" in report:
        rows = [[m["tokens"], m["vocab"], m["impl"], m["peak_bytes"] / mib, m["full_logits_bytes"] / mib, m["seconds"]]
                for m in report["memory"]]
        say("\n" + table("Loss peak memory (log-probs of sampled tokens, forward + backward, hidden 256, chunks of "
                         "1024 tokens)", ["tokens", "vocab", "logits", "peak MiB", "full logits MiB", "seconds"], rows))
    if isinstance(report.get("gpu"), dict):
        g = report["gpu"]
        rows = [[name, g[name]["tokens_per_s"], "-" if g[name]["mfu"] is None else f"{g[name]['mfu']:.1%}",
                 g[name]["peak_memory_bytes"] / mib] for name in ("ours", "plain")]
        say("\n" + table(f"GPU: {g['device']}, {g['params'] / 1e6:.0f}M params, batch {g['batch']}",
                         ["path", "tokens/s", "MFU", "peak MiB"], rows))
    elif "gpu" in report:
        say(f"\nGPU: {report['gpu']}")


def fairness(report: dict[str, Any]) -> str:
    """Each trainer's steps 1-3 reward vs the base model on the same 3 x P prompts, in standard errors
    (per-prompt accuracies vary far more than samples of one prompt, so the error is over prompts)."""
    per_prompt = report["bounds"]["base_correct_per_prompt"]
    n = 3 * len(per_prompt) // (report["bounds"]["steps"])  # prompts in steps 1-3
    base = statistics.mean(per_prompt[:n])
    se = statistics.stdev(per_prompt[:n]) / n**0.5
    parts = [f"fairness: base model on the first {n} prompts (raw vLLM) {base:.3f} +- {se:.3f} (1 s.e.)"]
    for name in ("ours", "trl"):
        got = statistics.mean(run["early_correct"] for run in report["compare"][name])
        parts.append(f"{'grpo' if name == 'ours' else 'TRL'} steps 1-3 {got:.3f} ({(got - base) / se:+.1f} s.e.)")
    return "; ".join(parts)


def trl_version() -> str:
    from importlib.metadata import version

    return version("trl")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections of {list(SECTIONS)}")
    parser.add_argument("--steps", type=int, default=8, help="measured steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="steps run before measuring")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds of grpo and TRL")
    parser.add_argument("--quick", action="store_true", help="fewer steps and sizes (about 6 minutes)")
    parser.add_argument("--out", default=None, help="JSON file for every number (default runs/bench/DATE.json)")
    parser.add_argument("--set", nargs="*", default=[], help="bounds: recipe overrides, e.g. rollout.temperature=0.7")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--trl-vllm", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tokens", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--vocab", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--impl", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    workers = {"trl": worker_trl, "bounds": worker_bounds, "memory": worker_memory, "gpu": worker_gpu}
    if args.worker:
        result = workers[args.worker](args)
        Path(args.result).write_text(json.dumps(result, indent=1))
        return 0
    if args.quick:
        args.steps, args.rounds = min(args.steps, 5), 1
    chosen = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in SECTIONS]
    if unknown:
        parser.error(f"unknown section(s) {unknown}; choose from {list(SECTIONS)}")
    try:
        import trl  # noqa: F401
    except ImportError:
        if "compare" in chosen:
            parser.error("the compare section needs TRL: pip install -e '.[bench]' (or `make bench`)")
    out = Path(args.out or ROOT / "runs" / "bench" / f"{time.strftime('%Y-%m-%d_%H-%M-%S')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"command": " ".join(["scripts/bench.py", *(argv if argv is not None else sys.argv[1:])]),
                              "cpu_count": os.cpu_count(), "usable_cpus": usable_cpus(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    started = time.time()
    for name in chosen:
        SECTIONS[name](args, report)
        out.write_text(json.dumps(report, indent=1))  # partial results survive an interrupted run
    report["wall_s"] = time.time() - started
    out.write_text(json.dumps(report, indent=1))
    print_report(report)
    say(f"\nall numbers: {out} ({report['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
