"""Build the outcome reward model shipped in grpo_cli/models: bike_rm, a sequence classifier that tells right
answers to the bike-pricing questions from wrong ones (docs/rewards.md).

    .venv/bin/python scripts/make_reward_model.py          # ~20 minutes on 2 CPU cores
    .venv/bin/python scripts/make_reward_model.py --rounds 1   # the base policy's samples only (~10 minutes)

What it does, top to bottom:
1. samples --group completions at temperature 1 for each of the first --prompts training questions of
   `recipe=bike_pricing` (the base policy, builtin:bike_base, through the project's vLLM engine), and
   --heldout-group for each held-out question; labels every sample with the task's exact checker (`correct`);
2. trains a one-logit classifier on them: the base model's own layers with a fresh score head
   (Qwen2ForSequenceClassification), its input the question, a newline and the completion (the reward model's
   `plain` template, grpo_cli/rewards/model.py), binary cross-entropy, AdamW;
3. each further round (--rounds) trains the shipped base policy against the model so far with
   `grpo train recipe=bike_pricing_rm` at bike_pricing's rates (trainer.lr=3e-4, norm_lr_scale=10) for --rl-steps
   steps (where an over-optimized policy finds what the model wrongly pays for: 80 steps were enough for round
   1's), samples that policy on the next --prompts training
   questions, labels them with the checker, and trains the model on to the union for --round-epochs epochs: the
   iterated reward modelling of RLHF, which shows the model the answers its own optimization produces;
4. measures the final model on held-out samples (questions it never saw) of the base policy and of each round's
   policy: accuracy at logit 0, the AUC (how often a right answer outscores a wrong one) and the AUC within a
   question (what group-relative advantages read); writes the model, its tokenizer (the policy's) and rm.json
   (the data, the settings, the measurements) to --out.

Deterministic on one machine and package set (seeded sampling and training), not across machines.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def sample(engine, task, cfg, rows: list[dict], group: int, seed_base: int) -> tuple[list[str], list[str], list[float]]:
    """(questions, completions, labels) of `group` samples per row from the base policy, labelled by `correct`."""
    from grpo_cli.engines.base import NO_LOGPROBS, Sampling
    from grpo_cli.rewards import SampleContext, score

    sampling = Sampling(group, 1.0, 1.0, cfg.rollout.max_new_tokens, logprob_seeds=NO_LOGPROBS)
    seeds = [seed_base + i * group for i in range(len(rows))]
    rollouts = engine.generate([task.encode(row) for row in rows], sampling, seeds, rows)
    completions = [text for texts in rollouts.texts for text in texts]  # [P*G]
    questions = [row[cfg.data.prompt_column] for row in rows for _ in range(group)]  # [P*G]
    columns = {"answer": [row["answer"] for row in rows for _ in range(group)]}
    correct = next(r for r in task.reward_fns if r.name == "correct")
    labels = score([correct], completions, columns, cfg.data.answer_format,
                   context=SampleContext(prompts=questions)).per_function["correct"]
    return questions, completions, labels


def auc(scores: list[float], labels: list[float]) -> float:
    """P(a right answer's score > a wrong one's), ties counted half."""
    import bisect

    right = [s for s, y in zip(scores, labels) if y == 1.0]
    wrong = [s for s, y in zip(scores, labels) if y == 0.0]
    if not right or not wrong:
        return float("nan")
    order = sorted(wrong)
    wins = sum(bisect.bisect_left(order, s) + 0.5 * (bisect.bisect_right(order, s) - bisect.bisect_left(order, s))
               for s in right)
    return wins / (len(right) * len(wrong))


def train(model, tokenizer, texts: list[str], labels: list[float], epochs: int, lr: float, batch: int,
          seed: int) -> list[float]:
    """Binary cross-entropy on the one logit, AdamW, shuffled batches; the mean loss of each epoch."""
    import torch

    torch.manual_seed(seed)
    order = list(range(len(texts)))
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    steps = epochs * -(-len(texts) // batch)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 - s / steps)  # linear decay to 0
    losses = []
    model.train()
    for epoch in range(epochs):
        rng.shuffle(order)
        total = 0.0
        for first in range(0, len(order), batch):
            ids = order[first:first + batch]
            enc = tokenizer([texts[i] for i in ids], padding=True, truncation=True, max_length=512,
                            return_tensors="pt")
            target = torch.tensor([labels[i] for i in ids])  # [B]
            logit = model(**enc).logits[:, 0]  # [B]
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logit, target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            schedule.step()
            total += float(loss) * len(ids)
        losses.append(total / len(order))
        print(f"epoch {epoch + 1}/{epochs}: loss {losses[-1]:.4f}", flush=True)
    model.eval()
    return losses


def within_auc(scores: list[float], labels: list[float], group: int) -> float:
    """The AUC over pairs of one question's samples only (consecutive blocks of `group`)."""
    wins = pairs = 0.0
    for first in range(0, len(labels), group):
        block = list(zip(scores[first:first + group], labels[first:first + group]))
        for a, ya in block:
            for b, yb in block:
                if ya == 1.0 and yb == 0.0:
                    pairs += 1
                    wins += (a > b) + 0.5 * (a == b)
    return wins / pairs if pairs else float("nan")


def logits_of(model, tokenizer, texts: list[str]) -> list[float]:
    import torch

    out = []
    with torch.no_grad():
        for first in range(0, len(texts), 64):
            enc = tokenizer(texts[first:first + 64], padding=True, truncation=True, max_length=512, return_tensors="pt")
            out += model(**enc).logits[:, 0].tolist()
    return out


def measure(model, tokenizer, texts: list[str], labels: list[float], group: int) -> dict[str, float]:
    scores = logits_of(model, tokenizer, texts)
    return {"samples": len(labels), "right": sum(labels),
            "accuracy": sum((s > 0) == (y == 1.0) for s, y in zip(scores, labels)) / len(labels),
            "majority_baseline": max(sum(labels), len(labels) - sum(labels)) / len(labels),
            "auc": auc(scores, labels), "auc_within_question": within_auc(scores, labels, group)}


def rl_policy(model, tokenizer, steps: int, work: Path) -> str:
    """`grpo train recipe=bike_pricing_rm` against `model` for `steps` steps: the final checkpoint's directory."""
    import subprocess
    import sys

    rm_dir = work / "rm"
    model.save_pretrained(rm_dir)
    tokenizer.save_pretrained(rm_dir)
    done = subprocess.run([sys.executable, "-m", "grpo_cli", "train", "recipe=bike_pricing_rm", f"rewards.0.model={rm_dir}",
                           "trainer.lr=3e-4", "trainer.norm_lr_scale=10",  # the rates that over-optimize
                           f"trainer.steps={steps}", "eval.every=0", "checkpoint.every=0", f"output_dir={work / 'rl'}"],
                          cwd=REPO, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"the round's grpo train failed:\n{done.stderr[-3000:]}")
    (run_dir,) = (work / "rl" / "bike_pricing_rm").iterdir()
    return str(run_dir / "checkpoints" / "final")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=1500, help="training questions sampled a round")
    parser.add_argument("--group", type=int, default=8, help="samples per training question")
    parser.add_argument("--heldout-group", type=int, default=8, help="samples per held-out question")
    parser.add_argument("--epochs", type=int, default=3, help="epochs of the first round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rl-steps", type=int, default=80, help="steps of a round's grpo train")
    parser.add_argument("--round-epochs", type=int, default=1, help="epochs over the union, each further round")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=REPO / "grpo_cli" / "models" / "bike_rm")
    args = parser.parse_args(argv)

    import tempfile

    import torch
    from transformers import AutoModelForSequenceClassification

    from grpo_cli.cli import load_config
    from grpo_cli.engines.vllm import VLLMEngine
    from grpo_cli.preflight import preflight
    from grpo_cli.rewards.model import render_plain

    started = time.time()
    cfg = load_config("train", ["recipe=bike_pricing", "rollout.enforce_eager=true"])
    task = preflight(cfg)
    tokenizer = task.tokenizer

    def texts_of(questions: list[str], completions: list[str]) -> list[str]:
        return [render_plain(q, c, tokenizer) for q, c in zip(questions, completions)]

    texts, labels, heldout, rounds = [], [], {}, []
    policy = task.model_path
    model = None
    with tempfile.TemporaryDirectory(prefix="grpo-rm-") as tmp:
        for r in range(args.rounds):
            if r > 0:  # the policy the model so far over-optimizes into
                policy = rl_policy(model, tokenizer, args.rl_steps, Path(tmp) / f"round{r}")
            engine = VLLMEngine(policy, cfg.model, cfg.rollout, cfg.trainer.seed)
            rows = task.train_rows[r * args.prompts:(r + 1) * args.prompts]
            q, c, y = sample(engine, task, cfg, rows, args.group, 7_000_000 + r * 1_000_000)
            hq, hc, hy = sample(engine, task, cfg, task.heldout_rows, args.heldout_group, 90_000_000 + r * 1_000_000)
            del engine
            texts += texts_of(q, c)
            labels += y
            heldout[f"round{r + 1}_policy"] = (texts_of(hq, hc), hy)
            print(f"round {r + 1}: {len(y)} samples of {'the base policy' if r == 0 else 'its RL policy'} "
                  f"({sum(y) / len(y):.3f} right), {time.time() - started:.0f} s", flush=True)
            if model is None:
                torch.manual_seed(args.seed)
                model = AutoModelForSequenceClassification.from_pretrained(task.model_path, num_labels=1,
                                                                           dtype=torch.float32)
                model.config.id2label, model.config.label2id = {0: "right"}, {"right": 0}
            else:  # measured before it sees the round's samples: how the over-optimized policy fooled it
                before = measure(model, tokenizer, *heldout[f"round{r + 1}_policy"], args.heldout_group)
                print(f"  the model so far on this policy's held-out samples: {before}", flush=True)
            epochs = args.epochs if r == 0 else args.round_epochs
            losses = train(model, tokenizer, texts, labels, epochs, args.lr, args.batch, args.seed + r)
            rounds.append({"policy": "builtin:bike_base" if r == 0 else f"round {r}'s model, {args.rl_steps} GRPO steps",
                           "train_questions": len(rows), "samples": len(y), "right": sum(y), "epochs": epochs,
                           "loss_per_epoch": losses, **({} if r == 0 else {"fooled_before": before})})

    measured = {name: measure(model, tokenizer, t, y, args.heldout_group) for name, (t, y) in heldout.items()}
    for name, m in measured.items():
        print(f"held-out samples of the {name}: accuracy {m['accuracy']:.3f} (majority {m['majority_baseline']:.3f}), "
              f"AUC {m['auc']:.3f}, within a question {m['auc_within_question']:.3f}")
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    (args.out / "rm.json").write_text(json.dumps({
        "what": "outcome reward model for bike_pricing: the logit of 'right' (the exact checker's verdict) for the "
                "question, a newline and the completion (rewards[i].template=plain)",
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "rounds": rounds, "measured_heldout": measured, "seconds": time.time() - started}, indent=2) + "\n")
    print(f"wrote {args.out} in {time.time() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
