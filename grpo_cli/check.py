"""`grpo check recipe=X [overrides]`: the run's own pre-run check, then the batch arithmetic of a config and the
settings that do nothing.

It runs `grpo train`'s pre-run check (preflight.py: data, rewards, tools, model files, templates, prompt
lengths), which reads tokenizers and model configs but never weights; the numbers come from the config and the
model's config.json (estimate.py: parameters, memory by GPU role, started servers). What needs the hub (a hub
model or dataset) is reported as not checked.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from grpo_cli.config import SamplerConfig, TrainConfig
from grpo_cli.engines.options import (
    logprob_groups,
)
from grpo_cli.estimate import gpu_lines, memory_lines, model_shape, placement_line, reward_model_lines, teacher_line
from grpo_cli.prompts.rows import hub_sources
from grpo_cli.tools.builtin import BUILTIN_TOOLS, PYTHON_MEMORY_BYTES, PYTHON_PROCESSES, runs_untrusted_code
from grpo_cli.tools.chat import CALL_FORMS, call_syntax, template_source
from grpo_cli.tools.load import call_strings, require_sandbox
from grpo_cli.weights.checkpoint import resolve_model_path


def batch_lines(cfg: TrainConfig, world_size: int) -> list[str]:
    """The step's arithmetic: prompts, completions, optimizer steps, tokens."""
    r, t = cfg.rollout, cfg.trainer
    P, G = r.prompts_per_step, r.group_size
    rounds = r.max_sampling_rounds if r.dynamic_sampling else 1
    updates = t.ppo_epochs * t.minibatches
    sampled = f"{P} prompts" + (f" (up to {P * rounds} over {rounds} dynamic-sampling rounds)" if rounds > 1 else "")
    return [
        f"per step: {sampled} x {G} samples = {P * G} completions in the loss; "
        f"per rank ({world_size}): {P // world_size} prompts, {P * G // world_size} completions",
        f"optimizer steps: {t.ppo_epochs} epoch(s) x {t.minibatches} minibatch(es) = {updates} per rollout batch, "
        f"{updates * t.steps} in {t.steps} steps (the lr schedule counts these)",
        f"completion tokens per step: at most {P * G * r.trajectory_tokens} (P x G x "
        f"{'the trajectory cap' if r.multi_turn else 'rollout.max_new_tokens'}={r.trajectory_tokens}); micro-batches of "
        f"<= {t.micro_batch_size} completions" + (f" and <= {t.micro_batch_tokens} padded tokens" if t.micro_batch_tokens else ""),
        logprob_line(cfg),
        *tool_lines(cfg),
        *sandbox_lines(cfg),
        *staleness_lines(cfg),
    ]

def logprob_line(cfg: TrainConfig) -> str:
    """Which groups bring the engine's sampling logprobs back (the run's own rule, engines.options.logprob_groups)."""
    groups, correction = logprob_groups(cfg), cfg.trainer.mismatch_correction
    if groups is None:
        why = f"trainer.mismatch_correction={correction} reads them" if correction != "none" else "rollout.mismatch_groups=-1"
        return f"sampling logprobs: every group's ({why})"
    if groups == 0:
        return "sampling logprobs: none (rollout.mismatch_groups=0: no train/inference mismatch metric)"
    return (f"sampling logprobs: the first {groups} group(s) of each sampling round, for the train/inference mismatch "
            f"metric (rollout.mismatch_groups; vLLM's logprobs cost ~9% of its throughput)")

def staleness_lines(cfg: TrainConfig) -> list[str]:
    """rollout.max_staleness: which weights sample each batch, and where the sampling runs."""
    r = cfg.rollout
    if not r.max_staleness:
        return []
    where = {"thread": "in a thread beside the update", "off": "after the update, in the loop's thread",
             "auto": "in a thread beside the update on CUDA, after it on the CPU"}[r.overlap]
    if r.placement == "split":
        where = "on the generator ranks while the trainers step"
    overlap = f" (rollout.overlap={r.overlap})" if r.placement != "split" else ""
    return [f"off-policy: the batch of step t is sampled from the weights after step t-1-{r.max_staleness} (the "
            f"start's for steps 1-{r.max_staleness + 1}), {where}{overlap}; the engine does not sleep; "
            f"trainer.mismatch_correction={cfg.trainer.mismatch_correction}"]

def tool_lines(cfg: TrainConfig) -> list[str]:
    """A tool run's budgets: the tools and their call strings, the turn, call and token caps; with the chat
    format, the call syntax parsed (read off the model's chat template with rollout.tool_call_syntax=auto: a
    template that shows none is refused here, as the run refuses it, rather than trained with zero calls)."""
    r = cfg.rollout
    if not r.multi_turn:
        return []
    syntax = []
    if r.tool_format == "chat":
        try:
            where = resolve_model_path(cfg.model.name_or_path)
        except FileNotFoundError:  # the pre-run check names the missing model
            where = None
        if where is None or not Path(where).is_dir():  # a hub id: its files are fetched when the run starts
            syntax = [f"tool calls: not checked: hub id {cfg.model.name_or_path} (the chat template is read when the "
                      "run loads the tokenizer)"]
        else:
            template = template_source(where)
            chosen = call_syntax(template, r.tool_call_syntax)
            how = "read off the chat template" if r.tool_call_syntax == "auto" else "rollout.tool_call_syntax"
            syntax = [f"tool calls: {chosen} syntax ({how}), {CALL_FORMS[chosen]}; every call of a turn, run in order"]

    if r.tool_format == "chat":  # schemas shown and calls parsed by the chat template: no tags are written
        tools = ", ".join(spec.function for spec in r.tools) or "none"
        shown = (f"tools: {tools}, each shown to the model as a JSON schema through the chat template; results go "
                 "back as the template's tool messages")
    else:
        tools = ", ".join(f"{spec.function} ({call_strings(spec)[0]}...)" for spec in r.tools) or "none"
        shown = f"tools: {tools}; results between {r.tool_result_tags[0]!r} and {r.tool_result_tags[1]!r}"
    env = r.environment
    env_line = [f"environment: {env.cls}, one instance per sample built from its row; its public methods are "
                "tools" + (f" (tags: {', '.join(f'{m} {t[0]}...' for m, t in env.tags.items())})" if env.tags else "")
                + (f"; {env.timeout_s:g} s per call" if env.timeout_s else "")] if env.cls else []
    return [shown, *env_line,
            f"tool budgets per trajectory: <= {r.max_turns} model turns of <= {r.max_new_tokens} tokens, "
            f"<= {r.max_tool_calls} calls, <= {r.max_tool_result_tokens} tokens per result, <= {r.trajectory_tokens} "
            "tokens after the prompt (rollout.max_trajectory_tokens); tool replies are attended but leave the loss",
            f"tool calls: up to {r.tool_workers} at once beside decoding (rollout.tool_workers); "
            + (f"{r.tool_budget_s:g} s of tool time per step (rollout.tool_budget_s)" if r.tool_budget_s else
               "no tool time budget per step")
            + f"; a trajectory is cut at {r.max_tool_timeouts} calls out of time (rollout.max_tool_timeouts)",
            "replies rejoin decoding " + ("at engine steps the run fixes: it replays bit for bit"
                                          if r.tool_rejoin == "wave" else "as they return: the run follows the "
                                          "clock and does not replay") + f" (rollout.tool_rejoin={r.tool_rejoin})",
            *syntax]

def sandbox_lines(cfg: TrainConfig) -> list[str]:
    """The sandbox of each built-in tool that runs model-written code; one that cannot be made here fails the
    check, as it would fail the run (docs/sandbox.md). A custom tool's module is imported by the run, not here."""
    out = []
    for i, spec in enumerate(cfg.rollout.tools):
        if runs_untrusted_code(BUILTIN_TOOLS.get(spec.function)) and spec.sandbox != "none":
            require_sandbox(f"rollout.tools[{i}]")
            out.append(f"rollout.tools[{i}] ({spec.function}): model-written code runs in the sandbox (bwrap: no "
                       f"network, no host files or processes; {PYTHON_MEMORY_BYTES // 2**20} MiB and "
                       f"{PYTHON_PROCESSES} processes a call, all together)")
        elif spec.sandbox == "bwrap":
            require_sandbox(f"rollout.tools[{i}]", opt_out="auto")
            out.append(f"rollout.tools[{i}] ({spec.function}): its worker lives in a sandbox (bwrap: no network, no "
                       "host files but its code's, no host processes; 512 MiB and 32 processes)")
    return out

def sampler_line(cfg: TrainConfig) -> str:
    """data.sampler: which training prompts a step draws, with the settings the named sampler reads."""
    s = cfg.data.sampler
    band = f"a group is settled at pass rate <= {s.band[0]:g} or >= {s.band[1]:g}"
    kept = f"taken anyway with probability {s.floor:g}, and always after {s.max_skips} passes in a row"
    return {"uniform": "prompts: data.sampler.name=uniform, every train row at its turn in a seeded order, reshuffled "
                       "each epoch",
            "skip_settled": f"prompts: data.sampler.name=skip_settled, a row whose last {s.visits} group(s) were settled "
                            f"is passed over ({band}); {kept}",
            "signal_by_column": f"prompts: data.sampler.name=signal_by_column on column '{s.column}', each value taken "
                                f"in proportion to its recent share of unsettled groups (EMA decay {s.decay:g}; "
                                f"{band}); {kept}"}[s.name]

def correctness_line(cfg: TrainConfig) -> str:
    """Which reward is the correctness check, and what it decides."""
    i, spec = next((i, s) for i, s in enumerate(cfg.rewards) if s.correctness or len(cfg.rewards) == 1)
    return (f"correctness check: rewards[{i}] {spec.name} (held-out pass@1, the all-correct/all-wrong groups, "
            "the best checkpoint)")

def warnings(cfg: TrainConfig) -> list[str]:
    """Settings that change nothing in this config, each with the reason."""
    r, t = cfg.rollout, cfg.trainer
    one_update = t.ppo_epochs * t.minibatches == 1
    out = []
    if one_update and t.mismatch_correction == "none":
        ratio_knobs = [k for k, on in (("trainer.clip_eps_high", t.clip_eps_high is not None),
                                       ("trainer.clip_ratio_c", t.clip_ratio_c is not None),
                                       ("trainer.policy_loss=gspo", t.policy_loss == "gspo")) if on]
        if ratio_knobs:
            out.append(f"{', '.join(ratio_knobs)}: with one optimizer step per batch the ratio is exactly 1, so "
                       "clipping never acts; set trainer.ppo_epochs or trainer.minibatches > 1")
    if t.policy_loss == "gspo" and t.clip_eps >= 0.05:
        out.append(f"trainer.policy_loss=gspo with clip_eps={t.clip_eps}: sequence ratios rarely leave that band; "
                   "the GSPO paper clips at 3e-4 / 4e-4")
    if t.kl_coef == 0 and t.kl_estimator != "k3":
        out.append(f"trainer.kl_estimator={t.kl_estimator} with trainer.kl_coef=0: there is no KL term")
    if r.group_size == 2 and t.advantage == "group_std":
        out.append("rollout.group_size=2 with trainer.advantage=group_std: every advantage is +1, -1 or 0 whatever "
                   "the reward gap; use a larger group or trainer.advantage=group_mean")
    if t.filter_zero_variance and t.kl_coef == 0 and t.entropy_coef == 0:
        out.append("trainer.filter_zero_variance without a KL or entropy term: all-equal groups already have zero "
                   "advantage, so the filter only changes the loss's normalizer")
    if r.dynamic_sampling and t.filter_zero_variance:
        out.append("trainer.filter_zero_variance with rollout.dynamic_sampling: dynamic sampling keeps only groups "
                   "with reward variance already")
    if t.mismatch_correction == "none" and (t.tis_cap != 2.0 or (t.seq_mask_low, t.seq_mask_high) != (0.5, 2.0)):
        out.append("trainer.tis_cap / seq_mask_*: unused with trainer.mismatch_correction=none")
    for i, spec in enumerate(r.tools):
        if runs_untrusted_code(BUILTIN_TOOLS.get(spec.function)) and spec.sandbox == "none":
            out.append(f"rollout.tools[{i}].sandbox=none: {spec.function} runs model-written code as your user, "
                       "with your files, processes and network")
    s, default_sampler = cfg.data.sampler, SamplerConfig()
    unused = {"uniform": ("visits", "band", "floor", "max_skips", "column", "decay"),
              "skip_settled": ("column", "decay"), "signal_by_column": ("visits",)}[s.name]
    changed = [f"data.sampler.{k}" for k in unused if getattr(s, k) != getattr(default_sampler, k)]
    if changed:
        out.append(f"{', '.join(changed)}: unused with data.sampler.name={s.name}")
    draws = t.steps * r.prompts_per_step * (r.max_sampling_rounds if r.dynamic_sampling else 1)  # at most
    builtin_rows = cfg.data.num_train if cfg.data.source.startswith("builtin:") else None  # a file's count is unread here
    if s.name == "skip_settled" and builtin_rows is not None and draws <= builtin_rows:
        out.append(f"data.sampler.name=skip_settled: the run draws at most {draws} of "
                   f"{builtin_rows} train rows, so no prompt comes back and it never acts; use signal_by_column, "
                   "or a smaller data.num_train (docs/sampling.md)")
    if r.dynamic_sampling and r.max_sampling_rounds == 1:
        out.append("rollout.dynamic_sampling with max_sampling_rounds=1: no further round is ever sampled")
    return out + unused_settings(cfg)

def _changed(section: Any, name: str) -> bool:
    """Whether a config section's field differs from the schema's default."""
    field = next(f for f in dataclasses.fields(section) if f.name == name)
    default = field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default
    return getattr(section, name) != default

def unused_settings(cfg: TrainConfig) -> list[str]:
    """Keys set away from their default that this config never reads, and what they wait for (issue 65)."""
    r, lora, distill = cfg.rollout, cfg.model.lora, cfg.distill
    table = [  # (section, field, the key's name, read only when, what would make it act)
        (r, "max_sampling_rounds", "rollout.max_sampling_rounds", r.dynamic_sampling, "rollout.dynamic_sampling=true"),
        (lora, "alpha", "model.lora.alpha", lora.enabled, "model.lora.rank"),
        (r, "lora_push", "rollout.lora_push", lora.enabled, "model.lora.rank"),
        (distill, "objective", "distill.objective", bool(distill.teacher), "distill.teacher"),
        (cfg.data, "instruction", "data.instruction", cfg.data.template == "chat", "data.template=chat"),
        (r, "max_turns", "rollout.max_turns", r.multi_turn, "rollout.tools or rollout.environment"),
    ]
    return [f"{key}: unused without {needs}" for section, name, key, read, needs in table
            if not read and _changed(section, name)]

def not_checked(cfg: TrainConfig) -> list[str]:
    """What `grpo check` leaves to the run on this machine: a hub model's files, a CUDA device."""
    lines = [f"not checked: hub dataset {source} (its rows, columns and prompt lengths are read when the run "
             "fetches it)" for source in hub_sources(cfg.data)]
    if not Path(resolve_model_path(cfg.model.name_or_path)).is_dir():
        lines.append(f"not checked: hub id {cfg.model.name_or_path} (its config, tokenizer, prompt lengths and chat "
                     "template are read when the run fetches it)")
    if cfg.trainer.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            lines.append(f"not checked: trainer.device={cfg.trainer.device} (no CUDA device here)")
    return lines

def run_check(cfg: TrainConfig, run_dir: Any) -> int:
    """`grpo check`: the run's own pre-run check (preflight.preflight: data, rewards, tools, model files, templates,
    prompt lengths; no weights loaded), then the batch, memory and settings it would run with."""
    import time

    from grpo_cli.preflight import preflight  # not at the top: `grpo check` imports torch only when it runs

    started = time.perf_counter()
    preflight(cfg, checking=True)  # a mistake: UsageError, one line and exit 2, as `grpo train` says it
    checked_s = time.perf_counter() - started
    world_size = max(cfg.dist.world_size, int(os.environ.get("WORLD_SIZE", "1")))  # dist.* or plain torchrun
    print(f"grpo check: {cfg.task} | model {cfg.model.name_or_path} | {cfg.trainer.steps} steps")
    print(f"  the run's pre-run check passed in {checked_s:.1f} s (data, rewards, tools, model files, prompt lengths)")
    for line in not_checked(cfg):
        print(f"  warning: {line}")
    shape = model_shape(cfg.model.name_or_path)
    split = cfg.rollout.placement == "split"
    trainers = cfg.trainer_ranks if split else world_size
    lines = batch_lines(cfg, trainers) + memory_lines(cfg, shape, trainers) + gpu_lines(cfg, shape, trainers)
    if split:
        lines.append(placement_line(cfg, shape))
    if cfg.distill.teacher:
        lines.append(teacher_line(cfg, trainers))
    lines += reward_model_lines(cfg)
    lines.append(sampler_line(cfg))
    lines.append(correctness_line(cfg))
    for line in lines:
        print(f"  {line}")
    found = warnings(cfg)
    for line in found:
        print(f"  warning: {line}")
    if not found:
        print("  no setting without effect found")
    return 0
