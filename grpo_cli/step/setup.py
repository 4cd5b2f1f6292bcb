"""Everything before a run's first step: fail at the edge, then torch, the resume point, the run state.

The pre-run check (preflight.py) has passed by then. `resume_or_start`
finds where the run starts (a resumed run's newest complete checkpoint, refused if its config
differs), and `start_run` builds the `RunState` every stage of a step reads: the policy, the
frozen reference, the rollout engine (`build_engine`), the optimizer and its schedule, the prompt
cursor. This is the run's composition root: it imports every piece it builds, and no stage imports it
(the types they share are in state.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpo_cli.config import RewardSpec, TrainConfig, TrainerConfig
from grpo_cli.dist import Dist
from grpo_cli.dist.channel import current
from grpo_cli.dist.shard import shard_model
from grpo_cli.engines.base import Engine
from grpo_cli.engines.hf import HFEngine
from grpo_cli.engines.options import max_model_len, sleep_wanted
from grpo_cli.engines.remote import RemoteEngine
from grpo_cli.engines.served import Placement, served_model
from grpo_cli.engines.sharded import ShardedEngine
from grpo_cli.engines.tools import with_tools
from grpo_cli.engines.vllm import VLLMEngine
from grpo_cli.errors import UsageError
from grpo_cli.prompts.pool import PromptPool, column_values
from grpo_cli.rewards.load import place_reward_models
from grpo_cli.rewards.teacher import START_HINT, ServedTeacher, start_server
from grpo_cli.runtime import cpu_threads, set_threads
from grpo_cli.step.heldout import HeldoutSet
from grpo_cli.step.optim import build_optimizer
from grpo_cli.step.state import RunState, Start, Task
from grpo_cli.step.sync import push
from grpo_cli.weights.checkpoint import (
    FORMAT_VERSION,
    checkpoint_weights,
    damaged_weights,
    load_policy,
    load_trainer_state,
    read_info,
    restore_trainer_state,
)
from grpo_cli.weights.lora import with_adapters
from grpo_cli.weights.model_files import is_vision_part
from grpo_cli.weights.runs import CHECKPOINTS, step_checkpoints

if TYPE_CHECKING:
    import torch



def setup_torch(cfg: TrainerConfig) -> None:
    """Threads, seeds and determinism, before any model or engine exists."""
    import torch

    set_threads(cpu_threads(cfg.threads, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))  # before vLLM starts
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    if cfg.deterministic:
        # cuBLAS refuses deterministic mode without a fixed workspace; set before CUDA starts (harmless on CPU)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)


def agreed_checkpoint(run_dir: Path, found: list[Path], dist: Dist) -> Path | None:
    """The checkpoint every trainer rank resumes from: rank 0's newest (its disk decides, as it decided the run
    directory in the CLI). Each rank must read that same checkpoint on its own disk; where one cannot, every rank
    fails with one line naming it. A rank that went on from step 0 beside a resumed rank 0 would train other
    weights, or hang in a collective (issue 66)."""
    if dist.world_size == 1:
        return found[-1] if found else None
    name = dist.broadcast(found[-1].name if found else None)
    mine = next((p for p in found if p.name == name), None)
    lacking = [rank for rank, holds in enumerate(dist.gather(name is None or mine is not None)) if not holds]
    if lacking:
        ranks = ", ".join(map(str, lacking))
        raise UsageError(f"resume: rank {ranks} cannot read rank 0's checkpoint {run_dir / CHECKPOINTS / name} "
                         "on its own disk; every trainer rank reads it: put output_dir on storage the nodes share, "
                         "or copy the run directory to each trainer node")
    return mine


def resume_or_start(cfg: TrainConfig, run_dir: Path, model_path: str, dist: Dist) -> Start:
    """The start point; a resume reads its checkpoint (the CLI resolved resume=DIR|auto to run_dir, and every rank
    resumes from rank 0's checkpoint: `agreed_checkpoint`)."""
    chosen = agreed_checkpoint(run_dir, step_checkpoints(run_dir) if cfg.resume else [], dist)
    if chosen is None:  # a new run; resume=auto lands here where the task had no run to continue (cli._resumed_dir)
        return Start(0, model_path, None, cfg.trainer.steps)
    path = str(chosen)
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


def start_run(cfg: TrainConfig, task: Task, run_dir: Path, engine: Engine | None = None) -> RunState:
    """This process's place in the job, the start point, the models and the engine, the optimizer and the
    prompt pool, with a resumed run's trainer state put back. A given `engine` (one process only)
    takes the start point's weights instead of a new one starting."""
    dist = Dist.init(cfg.trainer.device, trainers=cfg.trainer_ranks if cfg.rollout.placement == "split" else None)
    start = resume_or_start(cfg, run_dir, task.model_path, dist)
    lora = cfg.model.lora
    if lora.enabled:  # the base, frozen, in model.dtype; the adapters on top (fp32), a resume's from its checkpoint

        weights = task.model_path
        policy = load_policy(weights, cfg.model.dtype).to(dist.device)
        policy = with_adapters(policy, lora, task.model_path, start.path if start.state is not None else None)
    else:  # fp32 master weights on CUDA (the passes autocast to model.dtype); on the CPU model.dtype itself
        weights = start.path
        policy = load_policy(weights, dist.master_dtype(cfg.model.dtype)).to(dist.device)
    policy.train()
    policy.config.use_cache = False
    if task.vision is not None and cfg.model.freeze_vision:  # the vision tower and connector stay as loaded
        for name, param in policy.named_parameters():
            if is_vision_part(name):
                param.requires_grad_(False)
    # FSDP2 at world size > 1 (each rank keeps its shard; on CUDA the gathers carry model.dtype)
    policy = shard_model(policy, dist, cfg.dist.reshard_layers, cfg.model.dtype)
    reference = None
    if cfg.trainer.kl_coef > 0 and not lora.enabled:  # frozen: stored in the compute dtype itself. With LoRA the
        # reference is the policy with its adapters off (update.reference_logprobs): no second copy
        reference = shard_model(load_policy(task.model_path, cfg.model.dtype).to(dist.device).eval()
                                .requires_grad_(False), dist, cfg.dist.reshard_layers)
    teacher = load_teacher(cfg, task, dist, run_dir)
    place_reward_models(task.reward_fns, dist.device, cfg.model.dtype, run_dir, dist)  # frozen beside the policy, or served
    engine = build_engine(cfg, task, weights, policy, dist, engine)
    if lora.enabled:  # the engine serves the base: it takes the adapters (B = 0 in a new run) before the first step
        push(engine, policy)
    trainer = cfg.trainer if lora.lr is None or not lora.enabled else dataclasses.replace(cfg.trainer, lr=lora.lr)
    optimizer, scheduler = build_optimizer(policy, trainer, start.schedule_steps)
    heldout = HeldoutSet.build(task.heldout_rows[: cfg.eval.num_problems], task.encode, task.reward_fns, cfg.data)
    state = RunState(task, dist, run_dir, start, policy, reference, engine, optimizer, scheduler,
                     PromptPool(len(task.train_rows), cfg.trainer.seed, cfg.data.sampler,
                                column_values(task.train_rows, cfg.data.sampler)), heldout, teacher)
    if start.state is not None:
        state.best_pass = restore_trainer_state(start.state, optimizer, scheduler, state.pool, Path(start.path),
                                                policy)
        if dist.is_main:
            state.history = truncate_metrics(run_dir / "metrics.jsonl", start.step)  # drop steps after the checkpoint
        dist.barrier()
    return state


def load_teacher(cfg: TrainConfig, task: Task, dist: Dist, run_dir: Path) -> torch.nn.Module | ServedTeacher | None:
    """distill.teacher: in this process (frozen, in the compute dtype, sharded like the reference), or served by
    vLLM (distill.server: a URL, or `start`: rank 0 starts one for the run and every rank of the node uses it;
    docs/distillation.md); None without distillation."""
    d = cfg.distill
    if not task.teacher_path:
        return None
    if d.server is None:
        return shard_model(load_policy(task.teacher_path, cfg.model.dtype).to(dist.device).eval()
                           .requires_grad_(False), dist, cfg.dist.reshard_layers)
    started = None
    if d.server == "start" and dist.is_main:
        started = start_server(task.teacher_path, Placement(dist.device, cfg.model.dtype, d.server_kv_cache_gib),
                               max_model_len(task.teacher_path, cfg.model), run_dir / "teacher_server.log",
                               d.server_start_timeout_s, d.request_timeout_s, d.requests_in_flight)
    url = dist.broadcast(started.url if started is not None else d.server)
    if started is not None:
        return started
    return ServedTeacher(url, served_model(url, "distill.server", START_HINT), d.request_timeout_s, d.requests_in_flight)


def teacher_engine(cfg: TrainConfig, task: Task, teacher: torch.nn.Module, dist: Dist) -> Engine:
    """An engine sampling from distill.teacher's module itself (transformers generate: any teacher the passes run,
    whatever the rollout engine holds), with the recipe's tools; at world size > 1 this rank's share. For its
    held-out reference line (train.teacher_heldout)."""
    engine = with_tools(HFEngine(teacher, task.tokenizer, lambda: dist.autocast(cfg.model.dtype)), task.tools,
                        cfg.rollout)
    return ShardedEngine(engine, dist) if dist.world_size > 1 else engine


def build_engine(cfg: TrainConfig, task: Task, weights: str, policy: torch.nn.Module, dist: Dist,
                 given: Engine | None = None) -> Engine:
    """The run's engine on `weights` (the table keeps the loop free of engine branches): rollout.engine's, or
    `given` (one process) with those weights pushed in; inside the tool loop when the recipe has tools (each
    rank runs its own samples' tools); at world size > 1 this rank's inside a ShardedEngine. A split job's is
    the generator rank's, reached over the channel (its tools run there: generator.py)."""
    if cfg.rollout.placement == "split":  # the generator starts from the base, which its node has as this one does;
        # a resume's weights are in a checkpoint on this node's disk, so they go over the channel (docs/async.md)
        remote = RemoteEngine(current(), dist, task.tokenizer)
        if weights != task.model_path:  # trainer rank 0 reads them and sends them
            remote.push_weights(checkpoint_weights(weights).items() if dist.is_main else ())
        return remote
    builders = {
        "vllm": lambda: VLLMEngine(weights, cfg.model, cfg.rollout, cfg.trainer.seed, cfg.logging.verbose_libraries,
                                   sleep=sleep_wanted(cfg.rollout, dist.device), world_size=dist.world_size,
                                   image_column=cfg.data.image_column if task.vision is not None else None),
        "hf": lambda: HFEngine(policy, task.tokenizer, lambda: dist.autocast(cfg.model.dtype)),
    }
    if given is not None:
        given.push_weights(checkpoint_weights(weights).items())
    engine = with_tools(given if given is not None else builders[cfg.rollout.engine](), task.tools, cfg.rollout)
    return ShardedEngine(engine, dist, cfg.rollout.tensor_parallel_size) if dist.world_size > 1 else engine


# Keys that may change between a run and its resume; any other difference would make the
# resumed run a different experiment, so it is refused. Where the ranks sample (rollout.placement, the number of
# generator ranks) does not change a sample: each prompt's come from its own seeds (docs/async.md).
RESUMABLE_CHANGES = ("resume", "output_dir", "trainer.steps", "logging.", "checkpoint.", "eval.every", "dist.",
                     "rollout.placement", "rollout.generator_ranks")


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
