"""The sub-commands: what each runs, whether it writes a run directory and takes a recipe."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Command:
    summary: str  # one line for `grpo --help`
    runner: str  # "module:function" taking (config dataclass, run_dir or None)
    makes_run_dir: bool  # whether the command writes a run directory with a log file
    needs_recipe: bool = True  # whether the command composes a recipe (recipe=NAME); False keeps the group out
    # "module:function" (overrides: dict, strict: bool) -> a run's saved config.yaml that stands in for the
    # recipe (recipe=NAME stays optional and wins); strict=True raises a UsageError instead of returning None
    recipe_from: str | None = None

COMMANDS: dict[str, Command] = {
    "train": Command("train a policy with GRPO on a recipe", "grpo_cli.train:run", True),
    "eval": Command("evaluate checkpoints on the held-out set", "grpo_cli.evaluate:run", False, needs_recipe=False,
                    recipe_from="grpo_cli.weights.runs:run_config_path"),
    "check": Command("print a recipe's batch arithmetic and settings that do nothing (loads no model)",
                     "grpo_cli.check:run_check", False),
    "reward": Command("score hand-written completions with a recipe's rewards", "grpo_cli.rewards.cases:run_cases", False),
    "export": Command("write a recipe's generated problems to JSONL", "grpo_cli.prompts.rows:run_export", False),
    "plot": Command("plot a run's metrics to a PNG", "grpo_cli.report.plot:run_plot", False, needs_recipe=False),
    "merge": Command("merge a LoRA checkpoint's adapters into its base model (one model directory)",
                     "grpo_cli.weights.lora:run_merge", False, needs_recipe=False),
}
