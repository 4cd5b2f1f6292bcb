"""The smallest GRPO policy: one parameter theta, P(correct) = sigmoid(theta).

Each step samples a group of G answers (correct with probability p), gives each the
group-relative advantage from `grpo_cli.algorithm.grpo.group_advantages`, and moves theta along
mean(advantage * d log p(answer) / d theta). A group that is all right or all wrong has
zero std, carries no signal, and is skipped (and counted).

    python scripts/toy_grpo.py                    # G=8 from theta=-1.5 (p=0.18): learns
    python scripts/toy_grpo.py --group-size 2     # tiny groups: many skipped, slower
    python scripts/toy_grpo.py --no-std           # Dr. GRPO: r - mean, no std scaling
"""

from __future__ import annotations

import argparse
import math

import numpy as np
import torch

from grpo_cli.algorithm.grpo import group_advantages


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--group-size", type=int, default=8, help="G: answers sampled per step")
    parser.add_argument("--theta", type=float, default=-1.5, help="initial logit of a correct answer")
    parser.add_argument("--lr", type=float, default=0.5, help="learning rate")
    parser.add_argument("--steps", type=int, default=40, help="update steps")
    parser.add_argument("--no-std", action="store_true", help="Dr. GRPO: advantages r - mean, no std scaling")
    args = parser.parse_args(argv)

    rng = np.random.default_rng(0)
    theta, skipped = args.theta, 0
    for step in range(1, args.steps + 1):
        p = 1.0 / (1.0 + math.exp(-theta))  # P(correct) = sigmoid(theta)
        rewards = (rng.random(args.group_size) < p).astype(np.float64)  # [G] 1 = correct
        if rewards.std() == 0:  # all right or all wrong: zero advantages, no signal
            skipped += 1
        else:
            adv = group_advantages(torch.from_numpy(rewards)[None], scale_by_std=not args.no_std)[0].numpy()  # [G]
            grad_logp = np.where(rewards == 1.0, 1.0 - p, -p)  # [G] d log p(answer) / d theta
            theta += args.lr * float(np.mean(adv * grad_logp))
        if step == 1 or step % 10 == 0:
            note = "  (zero std: skipped)" if rewards.std() == 0 else ""
            print(f"step {step:3d}  P(correct)={p:.3f}  rewards={rewards.astype(int).tolist()}{note}")

    p = 1.0 / (1.0 + math.exp(-theta))
    print(f"final P(correct)={p:.3f}  skipped groups={skipped}/{args.steps}")
    return p


if __name__ == "__main__":
    main()
