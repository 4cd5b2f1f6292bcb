"""Everything before a run's first step: fail at the edge, then torch, the resume point, the run state.

`preflight` checks the data, the reward functions, the model files and the prompt lengths
before any model is loaded, so a bad recipe fails in seconds with one line. `resume_or_start`
finds where the run starts (a resumed run's newest complete checkpoint, refused if its config
differs), and `start_run` builds the `RunState` every stage of a step reads: the policy, the
frozen reference, the rollout engine, the optimizer and its schedule, the prompt cursor.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpo_cli.config import DataConfig, TrainConfig, TrainerConfig
from grpo_cli.errors import UsageError

if TYPE_CHECKING:
    import torch

    from grpo_cli.collect import PromptCursor
    from grpo_cli.dist import Dist
    from grpo_cli.heldout import HeldoutSet
    from grpo_cli.rewards import WeightedReward
    from grpo_cli.rollout import Engine
    from grpo_cli.tools import LoadedTool


@dataclass
class Task:
    """What preflight checked: the prompts, the rewards, the model and its tokenizer."""

    train_rows: list[dict[str, Any]]  # the train split, in dataset order
    heldout_rows: list[dict[str, Any]]  # the fixed held-out split
    reward_fns: list[WeightedReward]  # in recipe order (one of them is the correctness check)
    model_path: str  # the base model's directory (or hub id): the reference, and the start of a new run
    tokenizer: Any  # the model's tokenizer (a transformers tokenizer, pad token set)
    data: DataConfig  # how a row becomes a prompt (template, prompt column) and how its answer is marked
    tools: list[LoadedTool] = dataclasses.field(default_factory=list)  # rollout.tools, loaded (docs/tools.md)

    def encode(self, row: dict[str, Any]) -> list[int]:
        """A row's prompt, rendered with data.template, as token ids."""
        from grpo_cli.prompts import render_row

        return self.tokenizer(render_row(row, self.data, self.tokenizer, self.tool_schemas),
                              add_special_tokens=False)["input_ids"]

    @property
    def tool_schemas(self) -> list[dict] | None:
        """The chat-format tools' JSON schemas, shown in every prompt; None otherwise."""
        from grpo_cli.tools.load import tool_schemas

        return tool_schemas(self.tools)


def preflight(cfg: TrainConfig) -> Task:
    """Validate everything a run reads before any model loads; raises UsageError naming the key, file or row."""
    from grpo_cli import data, rewards
    from grpo_cli.checkpoint import damaged_weights, load_tokenizer, resolve_model_path

    if cfg.model.dtype == "float16":
        raise UsageError("model.dtype: float16 training needs loss scaling (a gradient scaler), which grpo_cli does "
                         "not have; small fp16 gradients underflow to 0. Use bfloat16 (or float32)")
    if cfg.trainer.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise UsageError(f"trainer.device={cfg.trainer.device}: no CUDA device here; use trainer.device=auto or cpu")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world % cfg.rollout.tensor_parallel_size:
        raise UsageError(f"rollout.tensor_parallel_size: {cfg.rollout.tensor_parallel_size} does not divide the "
                         f"{world} processes (WORLD_SIZE): each engine spans that many of them")
    if world > 1 and cfg.rollout.prompts_per_step % world:  # plain torchrun: the config did not know the count
        raise UsageError(f"rollout.prompts_per_step: {cfg.rollout.prompts_per_step} does not split over {world} "
                         "processes (WORLD_SIZE); make it a multiple of the process count")
    train_rows, heldout_rows = data.load_splits(cfg.data)
    reward_fns = rewards.load_rewards(cfg.rewards)
    rewards.validate_columns(train_rows, reward_fns)
    rewards.validate_columns(heldout_rows, reward_fns)
    try:
        model_path = resolve_model_path(cfg.model.name_or_path)
    except FileNotFoundError as e:
        raise UsageError(f"model.name_or_path: {e}") from None
    if damage := damaged_weights(model_path):
        raise UsageError(f"model.name_or_path: {damage}")
    from transformers import AutoConfig

    from grpo_cli import passes

    model_config = AutoConfig.from_pretrained(model_path)
    if reason := passes.shared_prompt_unsupported(model_config):
        raise UsageError(f"model.name_or_path: {reason}")
    if cfg.model.lora.enabled:
        from grpo_cli.lora import check_targets
        from grpo_cli.rollout import vllm_lora_rank

        check_targets(cfg.model.lora, model_config)
        if cfg.rollout.engine == "vllm":
            vllm_lora_rank(cfg.model.lora.rank)  # raises above vLLM's largest
    from grpo_cli.tools import load_tools

    tools = load_tools(cfg.rollout.tools, cfg.rollout.tool_format, cfg.rollout.environment)
    check_tool_run(tools, reward_fns, {"train": train_rows, "held-out": heldout_rows})
    task = Task(train_rows, heldout_rows, reward_fns, model_path, load_tokenizer(model_path), cfg.data, tools)
    check_prompt_lengths(task, cfg)
    return task


def check_tool_run(tools: list, reward_fns: list, splits: dict[str, list[dict[str, Any]]]) -> None:
    """What the rewards receive from the trajectories: no column takes one of those names, a reward that needs
    one has it (tools, an environment), the environment's columns are in every row, and the `environment`
    reward has a reward() to return."""
    import inspect

    from grpo_cli.rewards.score import TOOL_RUN_ONLY
    from grpo_cli.tools.environment import check_rows
    from grpo_cli.tools.load import environment_of

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


def check_prompt_lengths(task: Task, cfg: TrainConfig) -> None:
    """Every prompt + rollout.max_new_tokens (a tool run's whole trajectory) must fit the model's context
    (vLLM would refuse it mid-run)."""
    from grpo_cli.prompts import render_row
    from grpo_cli.rollout import max_model_len

    context = max_model_len(task.model_path, cfg.model)
    for name, rows in (("train", task.train_rows), ("held-out", task.heldout_rows)):
        texts = [render_row(row, cfg.data, task.tokenizer, task.tool_schemas) for row in rows]
        lengths = [len(ids) for ids in task.tokenizer(texts, add_special_tokens=False)["input_ids"]]
        worst = max(range(len(rows)), key=lengths.__getitem__)
        key = "rollout.max_trajectory_tokens" if cfg.rollout.multi_turn else "rollout.max_new_tokens"
        if lengths[worst] + cfg.rollout.trajectory_tokens > context:
            raise UsageError(f"{name} row {worst}: its prompt of {lengths[worst]} tokens + {key}="
                             f"{cfg.rollout.trajectory_tokens} exceeds the model's context of {context} tokens; lower "
                             f"{key}, set model.max_context_tokens, or drop long prompts")


def setup_torch(cfg: TrainerConfig) -> None:
    """Threads, seeds and determinism, before any model or engine exists."""
    import torch

    from grpo_cli.runtime import cpu_threads, set_threads

    set_threads(cpu_threads(cfg.threads, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))  # before vLLM starts
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    if cfg.deterministic:
        # cuBLAS refuses deterministic mode without a fixed workspace; set before CUDA starts (harmless on CPU)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)


@dataclass
class Start:
    """Where a run starts: step 0 from the base model, or a resumed run's newest checkpoint."""

    step: int  # the last step already done (0 for a new run)
    path: str  # the weights the policy (and the engine) load
    state: dict[str, Any] | None  # the checkpoint's trainer state (None for a new run)
    schedule_steps: int  # the training steps the lr schedule spans: the original run's trainer.steps
    info: dict[str, Any] = dataclasses.field(default_factory=dict)  # the checkpoint's checkpoint.json


def resume_or_start(cfg: TrainConfig, run_dir: Path, model_path: str) -> Start:
    """The start point; a resume reads its checkpoint (the CLI resolved resume=DIR|auto to run_dir)."""
    from grpo_cli.checkpoint import FORMAT_VERSION, damaged_weights, load_trainer_state, read_info
    from grpo_cli.runs import step_checkpoints

    if not cfg.resume:
        return Start(0, model_path, None, cfg.trainer.steps)
    path = str(step_checkpoints(run_dir)[-1])
    if damage := damaged_weights(path):
        raise UsageError(f"resume: {damage}")
    info = read_info(Path(path))  # a complete checkpoint's: list_checkpoints read it already
    if info.get("format_version") != FORMAT_VERSION:  # a checkpoint from before the format had a number: 0
        raise UsageError(f"resume: {path} is in checkpoint format {info.get('format_version', 0)}, and this "
                         f"grpo_cli resumes format {FORMAT_VERSION} only; its weights still load: start a new run "
                         f"from them with model.name_or_path={path}")
    check_same_run(info["config"], dataclasses.asdict(cfg))
    if info["step"] >= cfg.trainer.steps:
        raise UsageError(f"nothing to resume: {path} is at step {info['step']} and trainer.steps="
                         f"{cfg.trainer.steps}; pass a larger trainer.steps to train further")
    state = load_trainer_state(Path(path))
    t_cfg, schedule_steps = cfg.trainer, state["schedule_steps"]
    if t_cfg.lr_schedule != "constant" and t_cfg.steps > schedule_steps:  # it would train at lr 0 past its end
        raise UsageError(f"trainer.steps={t_cfg.steps} runs past the end of the run's {t_cfg.lr_schedule} lr schedule, "
                         f"which reaches 0 at step {schedule_steps}; resume with trainer.steps <= {schedule_steps}, "
                         f"or start a new run from the checkpoint (model.name_or_path={path})")
    return Start(info["step"], path, state, schedule_steps, info)


@dataclass
class RunState:
    """What a run holds from its first step to its last, built once by `start_run`. Every stage of a step
    takes it and the config section it reads (the whole TrainConfig when it reads several)."""

    task: Task  # the prompts, the rewards, the base model and its tokenizer
    dist: Dist  # this process's rank, the world size, the device; the loop's collectives
    run_dir: Path  # where metrics, logs and checkpoints go
    start: Start  # step 0 from the base model, or the checkpoint a resume continues from
    policy: torch.nn.Module  # the model being trained (inside its FSDP2 root at world size > 1)
    reference: torch.nn.Module | None  # the frozen reference for the KL term; None when trainer.kl_coef = 0 or with LoRA
    engine: Engine  # the rollout engine (rollout.engine), holding a copy of the policy's weights
    optimizer: torch.optim.Optimizer  # AdamW over the policy's parameters
    scheduler: torch.optim.lr_scheduler.LambdaLR  # warm-up and trainer.lr_schedule, over optimizer steps
    cursor: PromptCursor  # the train rows' seeded order and position (saved for an exact resume)
    heldout: HeldoutSet  # the eval.num_problems held-out problems every evaluation samples
    best_pass: float = -1.0  # the best held-out pass@1 so far; checkpoints/best holds that model
    history: list[dict[str, Any]] = field(default_factory=list)  # every step's metrics, for the summary


def start_run(cfg: TrainConfig, task: Task, run_dir: Path, engine: Engine | None = None) -> RunState:
    """This process's place in the job, the start point, the models and the engine, the optimizer and the
    prompt cursor, with a resumed run's trainer state put back. A given `engine` (one process only)
    takes the start point's weights instead of a new one starting."""
    from grpo_cli.checkpoint import checkpoint_weights, load_policy, restore_trainer_state
    from grpo_cli.collect import PromptCursor
    from grpo_cli.dist import Dist
    from grpo_cli.dist.shard import shard_model
    from grpo_cli.heldout import HeldoutSet
    from grpo_cli.optim import build_optimizer
    from grpo_cli.rollout import build_engine

    dist = Dist.init(cfg.trainer.device, alone=cfg.rollout.placement == "split")
    start = resume_or_start(cfg, run_dir, task.model_path)
    lora = cfg.model.lora
    if lora.enabled:  # the base, frozen, in model.dtype; the adapters on top (fp32), a resume's from its checkpoint
        from grpo_cli.lora import with_adapters

        weights = task.model_path
        policy = load_policy(weights, cfg.model.dtype).to(dist.device)
        policy = with_adapters(policy, lora, task.model_path, start.path if start.state is not None else None)
    else:  # fp32 master weights on CUDA (the passes autocast to model.dtype); on the CPU model.dtype itself
        weights = start.path
        policy = load_policy(weights, dist.master_dtype(cfg.model.dtype)).to(dist.device)
    policy.train()
    policy.config.use_cache = False
    # FSDP2 at world size > 1 (each rank keeps its shard; on CUDA the gathers carry model.dtype)
    policy = shard_model(policy, dist, cfg.dist.reshard_layers, cfg.model.dtype)
    reference = None
    if cfg.trainer.kl_coef > 0 and not lora.enabled:  # frozen: stored in the compute dtype itself. With LoRA the
        # reference is the policy with its adapters off (update.reference_logprobs): no second copy
        reference = shard_model(load_policy(task.model_path, cfg.model.dtype).to(dist.device).eval()
                                .requires_grad_(False), dist, cfg.dist.reshard_layers)
    from grpo_cli.sync import push
    from grpo_cli.tools.trajectories import with_tools

    tool_loop = lambda e: with_tools(e, task.tools, cfg.rollout)  # noqa: E731 - the engine itself without tools
    if cfg.rollout.placement == "split":  # the generator rank's engine; its tools run there too (generator.py)
        from grpo_cli.dist.channel import current
        from grpo_cli.generator import RemoteEngine

        engine = RemoteEngine(current(), task.tokenizer, weights)
    elif engine is None:
        engine = build_engine(cfg, weights, policy, task.tokenizer, dist, wrap=tool_loop)
    else:
        engine.push_weights(checkpoint_weights(weights).items())
        engine = tool_loop(engine)
    if lora.enabled:  # the engine serves the base: it takes the adapters (B = 0 in a new run) before the first step
        push(engine, policy)
    trainer = cfg.trainer if lora.lr is None or not lora.enabled else dataclasses.replace(cfg.trainer, lr=lora.lr)
    optimizer, scheduler = build_optimizer(policy, trainer, start.schedule_steps)
    heldout = HeldoutSet.build(task.heldout_rows[: cfg.eval.num_problems], task.encode, task.reward_fns, cfg.data)
    state = RunState(task, dist, run_dir, start, policy, reference, engine, optimizer, scheduler,
                     PromptCursor(len(task.train_rows), cfg.trainer.seed), heldout)
    if start.state is not None:
        state.best_pass = restore_trainer_state(start.state, optimizer, scheduler, state.cursor, Path(start.path),
                                                policy)
        if dist.is_main:
            state.history = truncate_metrics(run_dir / "metrics.jsonl", start.step)  # drop steps after the checkpoint
        dist.barrier()
    return state


# Keys that may change between a run and its resume; any other difference would make the
# resumed run a different experiment, so it is refused.
RESUMABLE_CHANGES = ("resume", "output_dir", "trainer.steps", "logging.", "checkpoint.", "eval.every", "dist.")


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config as dotted keys; a list of sections (rewards) by index: rewards.0.name, ..."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        elif isinstance(v, list) and v and all(isinstance(item, dict) for item in v):
            out[f"{prefix}{k}.count"] = len(v)
            for i, item in enumerate(v):
                out.update(_flat(item, f"{prefix}{k}.{i}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def check_same_run(saved: dict[str, Any], current: dict[str, Any]) -> None:
    """Refuse a resume whose config differs from the run's, except in RESUMABLE_CHANGES. A key the
    saved run predates (the schema gained it since) counts as unchanged when the current value is
    the schema's default."""
    from grpo_cli.config import RewardSpec

    a, b = _flat(saved), _flat(current)
    defaults = _flat(dataclasses.asdict(TrainConfig(task="-", rewards=[RewardSpec(name="-")])))
    for k in set(b) - set(a):
        default_key = re.sub(r"\.\d+\.", ".0.", k)  # every reward has the same fields as the first
        if default_key in defaults and b[k] == defaults[default_key]:
            a[k] = b[k]
    changed = [k for k in sorted(set(a) | set(b))
               if a.get(k) != b.get(k) and not any(k == c or k.startswith(c) for c in RESUMABLE_CHANGES)]
    if changed:
        diffs = ", ".join(f"{k} ({a.get(k)!r} -> {b.get(k)!r})" for k in changed[:5])
        raise UsageError(f"resume: the config differs from the run's: {diffs}; only "
                         f"{', '.join(RESUMABLE_CHANGES[2:])} may change")


def truncate_metrics(path: Path, last_step: int) -> list[dict[str, Any]]:
    """Keep metrics up to `last_step` (steps logged after the checkpoint are replayed) and return them."""
    if not path.is_file():
        return []
    kept = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    kept = [m for m in kept if m.get("step", 0) <= last_step]
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(m) + "\n" for m in kept))
    tmp.replace(path)
    return kept
