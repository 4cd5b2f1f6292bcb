"""The pre-run check: everything a run reads, validated before any model loads (fail at the edge).

`preflight` checks the data, the reward functions and tools, the model files and templates, the teacher, and
the prompt lengths, so a bad recipe fails in seconds with one line (a UsageError naming the key, file or row).
`grpo train` runs it before building anything, and `grpo check` runs the same function, so the check refuses
what the run refuses (issue 65); it loads tokenizers and model configs, never weights. (`grpo eval` reads a
checkpoint's saved config and checks its held-out rows and tools with `check_tool_run`.)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from grpo_cli import hub, rewards
from grpo_cli.algorithm import passes
from grpo_cli.config import TrainConfig
from grpo_cli.engines.options import max_model_len, vllm_lora_rank
from grpo_cli.engines.served import served_model
from grpo_cli.errors import UsageError
from grpo_cli.prompts import rows as data
from grpo_cli.prompts.images import Vision, row_images
from grpo_cli.prompts.pool import column_values
from grpo_cli.prompts.templates import is_conversation, render_row
from grpo_cli.rewards.load import TOOL_RUN_ONLY
from grpo_cli.rewards.teacher import START_HINT
from grpo_cli.step.state import Task
from grpo_cli.tools import load_tools
from grpo_cli.tools.chat import ChatFormat
from grpo_cli.tools.environment import check_rows
from grpo_cli.tools.load import environment_of
from grpo_cli.weights.checkpoint import load_processor, load_tokenizer
from grpo_cli.weights.lora import check_targets
from grpo_cli.weights.model_files import checked_model_path, is_vision_language


def preflight(cfg: TrainConfig, checking: bool = False) -> Task | None:
    """Validate everything a run reads before any model loads; raises UsageError naming the key, file or row.
    `grpo check` runs it too (`checking`): there a hub id cannot be read without the hub, so what needs the
    policy's files (its config, tokenizer, prompt lengths, chat format, teacher) is left to the run, and it
    returns None; `not_checked` says so."""
    if cfg.model.dtype == "float16":
        raise UsageError("model.dtype: float16 training needs loss scaling (a gradient scaler), which grpo_cli does "
                         "not have; small fp16 gradients underflow to 0. Use bfloat16 (or float32)")
    if cfg.trainer.device.startswith("cuda") and not checking:  # check may look at a GPU recipe from a laptop
        import torch

        if not torch.cuda.is_available():
            raise UsageError(f"trainer.device={cfg.trainer.device}: no CUDA device here; use trainer.device=auto or cpu")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if cfg.rollout.placement == "split":  # the trainer ranks share the prompts; the generator ranks only generate
        world = cfg.trainer_ranks
    if world % cfg.rollout.tensor_parallel_size:
        raise UsageError(f"rollout.tensor_parallel_size: {cfg.rollout.tensor_parallel_size} does not divide the "
                         f"{world} processes (WORLD_SIZE): each engine spans that many of them")
    if world > 1 and cfg.rollout.prompts_per_step % world:  # plain torchrun: the config did not know the count
        raise UsageError(f"rollout.prompts_per_step: {cfg.rollout.prompts_per_step} does not split over {world} "
                         "processes (WORLD_SIZE); make it a multiple of the process count")
    if checking and data.hub_sources(cfg.data):  # a hub dataset: its rows (and what reads them) wait for the run
        rewards.load_rewards(cfg.rewards)
        load_tools(cfg.rollout.tools, cfg.rollout.tool_format, cfg.rollout.environment)
        checked_model_path("model.name_or_path", cfg.model.name_or_path)
        return None
    train_rows, heldout_rows = data.load_splits(cfg.data)
    column_values(train_rows, cfg.data.sampler)  # data.sampler.column is a column of every train row
    reward_fns = rewards.load_rewards(cfg.rewards)
    rewards.validate_columns(train_rows, reward_fns)
    rewards.validate_columns(heldout_rows, reward_fns)
    model_path = checked_model_path("model.name_or_path", cfg.model.name_or_path)
    if checking and not Path(model_path).is_dir():  # a hub id: what needs its files waits for the run
        tools = load_tools(cfg.rollout.tools, cfg.rollout.tool_format, cfg.rollout.environment)
        check_tool_run(tools, reward_fns, {"train": train_rows, "held-out": heldout_rows})
        return None
    model_config = model_config_of("model.name_or_path", model_path)
    if reason := passes.shared_prompt_unsupported(model_config):
        raise UsageError(f"model.name_or_path: {reason}")
    if cfg.model.lora.enabled:
        check_targets(cfg.model.lora, model_config)
        if cfg.rollout.engine == "vllm":
            vllm_lora_rank(cfg.model.lora.rank)  # raises above vLLM's largest

    tools = load_tools(cfg.rollout.tools, cfg.rollout.tool_format, cfg.rollout.environment)
    check_tool_run(tools, reward_fns, {"train": train_rows, "held-out": heldout_rows})
    tokenizer = load_tokenizer(model_path)
    if cfg.data.template == "chat" and not getattr(tokenizer, "chat_template", None):
        raise UsageError(f"data.template: chat, and {cfg.model.name_or_path}'s tokenizer has no chat template; set "
                         "data.template=plain (the question as it is) or use a model that has one")
    teacher_path = check_teacher(cfg.distill.teacher, cfg.model.name_or_path, tokenizer) if cfg.distill.teacher else None
    if cfg.distill.server not in (None, "start"):
        served_model(cfg.distill.server, "distill.server", START_HINT)  # a server given by URL answers, before any model loads
    vision = check_vision(cfg, model_path, model_config, {"train": train_rows, "held-out": heldout_rows})
    if vision is not None:
        tokenizer = vision.processor.tokenizer  # the processor's own: its image tokens are the model's
    task = Task(train_rows, heldout_rows, reward_fns, model_path, tokenizer, cfg.data, tools, teacher_path, vision)
    check_prompt_lengths(task, cfg)
    if tools and cfg.rollout.tool_format == "chat":  # its tool role and its call syntax, before any model loads
        ChatFormat.from_tokenizer(task.tokenizer, {t.schema["function"]["name"]: t.name for t in tools},
                                  cfg.rollout.tool_call_syntax, cfg.rollout.max_tool_calls)
    return task


def check_vision(cfg: TrainConfig, model_path: str, model_config: Any, splits: dict[str, list[dict[str, Any]]]
                 ) -> Vision | None:
    """Rows with images (data.image_column) before any weights load: a vision-language model with its processor,
    sampled by vLLM, single-turn, each prompt text. Returns the processor's `Vision`, or None for text rows."""
    with_images = [name for name, rows in splits.items() if rows and row_images(rows[0], cfg.data.image_column)]
    if not with_images:
        return None
    where = f"the {with_images[0]} rows of '{cfg.data.source}' carry images (data.image_column={cfg.data.image_column})"
    if not is_vision_language(model_config):
        kind = ", ".join(getattr(model_config, "architectures", None) or [model_config.model_type])
        raise UsageError(f"model.name_or_path: {where}, and {cfg.model.name_or_path} is a text-only model ({kind}); "
                         "use a vision-language model (docs/vision.md) or set data.image_column=null")
    if len(with_images) < len(splits):
        raise UsageError(f"data: {where}, and the {[n for n in splits if n not in with_images][0]} rows carry none; "
                         "give both splits their images")
    if cfg.rollout.multi_turn:
        raise UsageError(f"rollout.tools: {where}; tool runs and environments with images are not supported "
                         "(docs/vision.md): set rollout.tools=[] or data.image_column=null")
    if cfg.rollout.placement == "split" or cfg.rollout.max_staleness:
        key = "rollout.placement" if cfg.rollout.placement == "split" else "rollout.max_staleness"
        raise UsageError(f"{key}: {where}; rollouts ahead of the trainer or on ranks of their own do not carry "
                         "images yet (docs/vision.md): set rollout.placement=colocated rollout.max_staleness=0")
    if cfg.rollout.engine != "vllm":
        raise UsageError(f"rollout.engine: {cfg.rollout.engine} does not sample with images; {where}, which "
                         "rollout.engine=vllm samples")
    if cfg.model.lora.enabled:
        raise UsageError(f"model.lora.rank: {where}; LoRA on a vision-language model is not supported yet "
                         "(docs/vision.md): set model.lora.rank=0 (model.freeze_vision keeps the tower as it is)")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UsageError(f"dist: {where}; a vision-language run on several processes is not supported yet "
                         "(docs/vision.md): run it as one process")
    for name, rows in splits.items():
        if (i := next((i for i, r in enumerate(rows) if is_conversation(r[cfg.data.prompt_column])), None)) is not None:
            raise UsageError(f"data.prompt_column: {name} row {i} holds chat messages, and rows with images take "
                             "their question as text (the images go before it)")
    try:
        return Vision(load_processor(model_path), cfg.data.image_column)
    except (OSError, ValueError, AttributeError) as e:
        raise UsageError(f"model.name_or_path: cannot load the processor of {cfg.model.name_or_path} "
                         f"({' '.join(str(e).split())[:200]}); a vision-language model needs its processor files "
                         "(preprocessor_config.json, processor_config.json)") from None


def check_teacher(teacher: str, student: str, tokenizer: Any) -> str:
    """distill.teacher before any model loads: its files, a causal LM the passes can run, and the student's
    tokenizer (the same vocabulary and special tokens, so a token id means the same token to both; across
    tokenizers a per-token logprob compares nothing). Returns its directory (or hub id)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    path = checked_model_path("distill.teacher", teacher)
    config = model_config_of("distill.teacher", path)
    architectures = config.architectures or []
    causal = any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in architectures) if architectures \
        else config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    if not causal:
        raise UsageError(f"distill.teacher: {teacher} is not a causal LM ({', '.join(architectures) or config.model_type}); "
                         "a teacher scores each sampled token with its next-token logprob")
    if reason := passes.shared_prompt_unsupported(config):
        raise UsageError(f"distill.teacher: {reason}")
    if differs := tokenizer_difference(tokenizer, load_tokenizer(path)):
        raise UsageError(f"distill.teacher: its tokenizer differs from the student's ({differs}): student "
                         f"{student}, teacher {teacher}; distillation across tokenizers is not supported")
    return path


def model_config_of(key: str, path: str) -> Any:
    """A model's config (the first file a run reads of it); a hub id that cannot be fetched is one line naming
    `key`, not transformers' traceback."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path)
    except OSError as e:
        if Path(path).is_dir():
            raise
        first = str(e).strip().splitlines()[0].rstrip(".") if str(e).strip() else type(e).__name__
        raise UsageError(f"{key}: cannot load hub model '{path}': {first}{hub.offline_note()}") from None


def tokenizer_difference(student: Any, teacher: Any) -> str | None:
    """What differs between two tokenizers that a per-token logprob depends on, or None: the vocabulary (token
    strings and their ids) and the special tokens."""
    mine, theirs = student.get_vocab(), teacher.get_vocab()
    if mine != theirs:
        by_id = [{i: token for token, i in vocab.items()} for vocab in (mine, theirs)]
        first = min(i for i in set(by_id[0]) | set(by_id[1]) if by_id[0].get(i) != by_id[1].get(i))
        return (f"vocabularies of {len(mine)} and {len(theirs)} tokens; token {first} is {by_id[0].get(first)!r} in the "
                f"student's, {by_id[1].get(first)!r} in the teacher's")
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        if getattr(student, name) != getattr(teacher, name):
            return f"{name} {getattr(student, name)} vs {getattr(teacher, name)}"
    if set(student.all_special_ids) != set(teacher.all_special_ids):
        return f"special token ids {sorted(student.all_special_ids)} vs {sorted(teacher.all_special_ids)}"
    return None


def check_tool_run(tools: list, reward_fns: list, splits: dict[str, list[dict[str, Any]]]) -> None:
    """What the rewards receive from the trajectories: no column takes one of those names, a reward that needs
    one has it (tools, an environment), the environment's columns are in every row, and the `environment`
    reward has a reward() to return."""
    import inspect

    env = environment_of(tools)
    given = {"tool_calls": bool(tools), "environment_state": env is not None,
             "environment_reward": env is not None and env.has_reward}
    for name, rows in splits.items():
        columns = set().union(*rows) if rows else set()
        if tools and (taken := sorted(columns & set(TOOL_RUN_ONLY))):
            raise UsageError(f"data: a {name} column is named '{taken[0]}', which a tool run's rewards receive from "
                             "the trajectories; rename the column")
        check_rows(env, rows, name)
    for i, r in enumerate(reward_fns):
        try:
            params = inspect.signature(r.fn).parameters.values()
        except (TypeError, ValueError):
            continue
        needed = [p.name for p in params if p.name in given and not given[p.name] and p.default is p.empty]
        if r.name == "environment" and not given["environment_reward"]:
            needed = ["environment_reward"]
        if needed:
            has = ("no tools" if not tools else "no rollout.environment.cls" if env is None else
                   f"{env.name} defines no reward()")
            raise UsageError(f"rewards[{i}]: '{r.name}' needs {needed[0]}, which this run cannot give it ({has})")


def image_token_counts(task: Task, rows: list[dict[str, Any]]) -> list[int]:
    """[rows] how many tokens each row's images add to its prompt beyond their one image token each (the
    processor's count for an image depends on its size only, so each size is asked once)."""
    if task.vision is None:
        return [0] * len(rows)
    by_size: dict[tuple[int, int], int] = {}
    counts = []
    for row in rows:
        added = 0
        for image in task.images(row):
            if image.size not in by_size:
                by_size[image.size] = len(task.vision.image_tokens(image)) - 1
            added += by_size[image.size]
        counts.append(added)
    return counts


def check_prompt_lengths(task: Task, cfg: TrainConfig) -> None:
    """Every prompt + rollout.max_new_tokens (a tool run's whole trajectory) must fit the model's context
    (vLLM would refuse it mid-run)."""
    context = max_model_len(task.model_path, cfg.model)
    budget = context - cfg.rollout.trajectory_tokens  # a prompt's tokens may be at most this
    for name, rows in (("train", task.train_rows), ("held-out", task.heldout_rows)):
        texts = [render_row(row, cfg.data, task.tokenizer, task.tool_schemas, task.vision) for row in rows]
        image_tokens = image_token_counts(task, rows)  # [rows] the tokens its images add past their image tokens
        # A token covers at least one byte of its text, so a prompt of at most budget bytes fits (8 to spare for a
        # tokenizer's leading marker): only longer ones are tokenized, not the 20,000 rows of a built-in task at
        # every start and every `grpo check`.
        longer = [i for i, text in enumerate(texts) if len(text.encode()) + image_tokens[i] + 8 > budget]
        if not longer:
            continue
        counted = task.tokenizer([texts[i] for i in longer], add_special_tokens=False)["input_ids"]
        lengths = {i: len(ids) + image_tokens[i] for i, ids in zip(longer, counted)}
        worst = max(longer, key=lengths.__getitem__)
        key = "rollout.max_trajectory_tokens" if cfg.rollout.multi_turn else "rollout.max_new_tokens"
        if lengths[worst] > budget:
            raise UsageError(f"{name} row {worst}: its prompt of {lengths[worst]} tokens + {key}="
                             f"{cfg.rollout.trajectory_tokens} exceeds the model's context of {context} tokens; lower "
                             f"{key}, set model.max_context_tokens, or drop long prompts")
