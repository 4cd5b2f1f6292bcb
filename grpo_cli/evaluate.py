"""`grpo eval`: held-out metrics of checkpoints, sampled the way they were trained.

    grpo eval checkpoint=RUN_DIR/checkpoints/final            # the run's own recipe (RUN_DIR/config.yaml)
    grpo eval checkpoint=latest run=RUN_DIR                    # latest | best | base of a run
    grpo eval checkpoints=[base,RUN_DIR/checkpoints/final]     # side by side, one engine
    grpo eval checkpoint=path/to/hf_model recipe=bike_pricing  # any HF model directory, with a recipe

Where the recipe comes from: a checkpoint of a run (RUN_DIR/checkpoints/NAME) or
run=DIR makes RUN_DIR/config.yaml, the run's resolved config, the recipe, so the
task, template, rewards and sampling are the training ones; `recipe=NAME` wins
when given; command-line overrides (eval.samples_per_problem=8, ...) apply on
top of either (cli/ does the composing).

Several checkpoints share ONE vLLM engine: it starts on the first, and each next
one's safetensors are pushed into it (`VLLMEngine.push_weights`). Every checkpoint
is sampled with the same per-problem seeds (those of the run's step-0 held-out
evaluation), so differences between columns are the weights', not the dice's.

Metrics over eval.num_problems held-out problems, k = eval.samples_per_problem
samples each at eval.temperature: pass@1 (mean of the recipe's correctness reward,
`rewards[i].correctness`), unbiased pass@k, maj@k, mean reward per function, mean
completion length (tokens), truncation rate, the same per difficulty tier when
the rows have a `tier` column, and greedy accuracy with eval.greedy=true.

Output, written only after every checkpoint is evaluated (nothing on failure):
- one checkpoint: CHECKPOINT/eval.json, or `out`; `base` is not a directory of
  the run, so it goes where several do;
- several: one JSON {"checkpoints": [eval.json of each, in order]} into `out`,
  else RUN_DIR/eval_TIMESTAMP.json, else ./eval.json when no run is involved;
- `out` is a .json file path, or a directory that gets eval.json;
- samples_jsonl=true: every sample (prompt, completion, rewards, ...) in
  the same place with the suffix .samples.jsonl.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

from grpo_cli.config import EvalCommandConfig, ModelConfig
from grpo_cli.engines.base import NO_LOGPROBS, Sampling
from grpo_cli.engines.tools import with_tools
from grpo_cli.engines.vllm import VLLMEngine
from grpo_cli.errors import UsageError
from grpo_cli.preflight import check_tool_run, check_vision, model_config_of
from grpo_cli.prompts import rows as data
from grpo_cli.prompts.templates import render_row
from grpo_cli.report.loggers import jsonable
from grpo_cli.rewards import WeightedReward, load_rewards, validate_columns
from grpo_cli.rewards.load import close_reward_models
from grpo_cli.runtime import cpu_threads, quiet_third_party, set_threads
from grpo_cli.step.heldout import HeldoutSet, add_greedy_metrics, heldout_metrics
from grpo_cli.step.rollout import sample_seeds
from grpo_cli.tools import load_tools
from grpo_cli.tools.load import close_tools, tool_schemas
from grpo_cli.weights import runs
from grpo_cli.weights.checkpoint import adapter_rank, checkpoint_weights, load_tokenizer
from grpo_cli.weights.lora import merged_checkpoint_tensors

# config.json fields that must agree for weights to be pushed into one engine
ARCH_KEYS = ("architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "rope_theta",
             "rope_parameters", "rope_scaling", "tie_word_embeddings", "max_position_embeddings")


def check_compatible(targets: list[runs.Target]) -> None:
    """Every checkpoint's architecture (config.json) matches the first's, whose engine they share."""
    first = targets[0]
    reference = json.loads((first.model_dir / "config.json").read_text())
    for target in targets[1:]:
        config = json.loads((target.model_dir / "config.json").read_text())
        for key in ARCH_KEYS:
            if config.get(key) != reference.get(key):
                raise UsageError(f"'{target.name}' does not fit the engine started on '{first.name}': config.json "
                                 f"{key} is {config.get(key)!r}, not {reference.get(key)!r}; checkpoints compared "
                                 "in one call must share the architecture and tokenizer (evaluate it separately)")


def engine_model(model: ModelConfig, targets: list[runs.Target]) -> ModelConfig:
    """The engine's model settings: LoRA serving on when some checkpoint is an adapter, at the largest rank of
    those adapters (a recipe without model.lora still evaluates a LoRA run's checkpoints)."""
    ranks = [adapter_rank(t.path) for t in targets if t.base is not None]
    if not ranks:
        return model
    return dataclasses.replace(model, lora=dataclasses.replace(model.lora, rank=max(ranks)))


def check_tokenizers(targets: list[runs.Target], tokenizer: Any) -> None:
    """Every checkpoint's tokenizer has the first's vocabulary (prompts are encoded once, with the first's)."""
    vocab = tokenizer.get_vocab()
    for target in targets[1:]:
        try:
            other = load_tokenizer(str(target.path))
        except Exception as e:
            raise UsageError(f"'{target.name}': cannot load its tokenizer ({type(e).__name__}: {e})") from None
        if other.get_vocab() != vocab or other.eos_token_id != tokenizer.eos_token_id:
            raise UsageError(f"'{target.name}' has a different tokenizer from '{targets[0].name}'; checkpoints "
                             "compared in one call must share the architecture and tokenizer (evaluate it separately)")


# ---------------------------------------------------------------------------
# where results go


def output_path(out: str | None, targets: list[runs.Target], run_dir: Path | None) -> Path:
    """The JSON file: `out` (a .json file, or a directory for eval.json), else the defaults in the module doc."""
    if out:
        path = Path(out)
        path = path if path.suffix == ".json" else path / "eval.json"
        for parent in [path.parent, *path.parent.parents]:
            if parent.exists() and not parent.is_dir():
                raise UsageError(f"out: '{parent}' is a file, so '{path}' cannot be written")
        if path.is_dir():
            raise UsageError(f"out: '{path}' is a directory; give a .json file or a directory without the .json suffix")
        return path
    if len(targets) == 1 and targets[0].beside:
        return targets[0].path / "eval.json"
    if run_dir is not None:
        return run_dir / f"eval_{time.strftime('%Y-%m-%d_%H-%M-%S')}.json"
    return Path("eval.json")


def _write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


# ---------------------------------------------------------------------------
# the command


def run(cfg: EvalCommandConfig, run_dir: Path | None = None, engine: VLLMEngine | None = None) -> int:
    """`grpo eval`: resolve and check every checkpoint, evaluate them on one engine, print, then write.
    `engine`: a vLLM engine already serving this architecture (a notebook's, a test's); every checkpoint's
    weights are pushed into it, the first's too, instead of one starting."""
    quiet_third_party(cfg.logging.verbose_libraries)  # before vLLM/datasets/transformers are imported

    # --- fail at the edge: checkpoints, output path, data and rewards before any model loads
    names = runs.checkpoint_names(cfg.checkpoint, cfg.checkpoints)
    if not names:
        raise UsageError(runs.NO_CHECKPOINT)
    if cfg.run:
        runs.check_run_dir(Path(cfg.run), cfg.run)
    the_run = runs.run_dir_of(names, cfg.run)
    targets = [runs.resolve(name, the_run, cfg.model.name_or_path) for name in names]
    check_compatible(targets)
    out_path = output_path(cfg.out, targets, the_run)
    samples_path = out_path.with_suffix(".samples.jsonl") if cfg.samples_jsonl else None
    rows = data.load_splits(cfg.data)[1][: cfg.eval.num_problems]
    reward_fns = load_rewards(cfg.rewards)
    validate_columns(rows, reward_fns)

    try:
        results, all_samples = evaluate_targets(cfg, targets, rows, reward_fns, the_run, samples_path is not None,
                                                engine)
    finally:
        close_reward_models(reward_fns)  # a server started for a reward model (rewards[i].server=start)
    print_table(cfg, targets, results)
    payload: Any = results[0] if len(results) == 1 else {"checkpoints": results}
    _write_atomically(out_path, json.dumps(payload, indent=2) + "\n")
    print(f"eval.json: {out_path}")
    if samples_path is not None:
        _write_atomically(samples_path, "".join(json.dumps(s, ensure_ascii=False, default=jsonable) + "\n"
                                                for s in all_samples))
        print(f"samples: {samples_path}")
    return 0


def evaluate_targets(cfg: EvalCommandConfig, targets: list[runs.Target], rows: list[dict[str, Any]],
                     reward_fns: list[WeightedReward], the_run: Path | None,
                     keep_samples: bool, engine: VLLMEngine | None = None
                     ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every checkpoint's held-out metrics on one vLLM engine (each next one's weights pushed into it),
    with the same per-problem seeds; also every sample when `keep_samples`."""
    # the run's tools and environment: pass@k measures the model with them
    tools = load_tools(cfg.rollout.tools, cfg.rollout.tool_format, cfg.rollout.environment)
    check_tool_run(tools, reward_fns, {"held-out": rows})  # before any model loads, as the rest of the edge checks
    schemas = tool_schemas(tools)
    set_threads(cpu_threads(cfg.trainer.threads))  # before the engine starts
    tokenizer = load_tokenizer(str(targets[0].path))
    check_tokenizers(targets, tokenizer)
    model_dir = str(targets[0].model_dir)
    vision = check_vision(cfg, model_dir, model_config_of("checkpoint", model_dir), {"held-out": rows})
    heldout = HeldoutSet.build(rows, lambda row: tokenizer(render_row(row, cfg.data, tokenizer, schemas, vision),
                                                           add_special_tokens=False)["input_ids"],
                               reward_fns, cfg.data)
    k = cfg.eval.samples_per_problem
    sampling = Sampling(k, cfg.eval.temperature, cfg.rollout.top_p, cfg.rollout.max_new_tokens,
                        logprob_seeds=NO_LOGPROBS)  # evaluation reads no sampling logprobs
    seeds = sample_seeds(cfg.trainer.seed, 0, len(rows), stream=1, group_size=k)  # the run's step-0 held-out seeds
    print(f"grpo eval: {cfg.task} | {len(rows)} held-out problems x {k} samples at T={cfg.eval.temperature:g} | "
          f"{len(targets)} checkpoint(s)" + (f" | recipe of run {the_run}" if the_run else ""), flush=True)
    holds = None if engine is not None else targets[0].model_dir  # the whole model in the engine (a given one: unknown)
    if engine is None:
        print(f"grpo eval: starting the vLLM engine on {holds}", flush=True)
        engine = VLLMEngine(str(holds), engine_model(cfg.model, targets), cfg.rollout, cfg.trainer.seed,
                            show_progress=cfg.logging.verbose_libraries,
                            image_column=cfg.data.image_column if vision is not None else None)
    engine = with_tools(engine, tools, cfg.rollout)
    results, all_samples = [], []
    for i, target in enumerate(targets):
        tick = time.time()
        if target.base is not None and engine.adapters == "merged":  # this engine serves no LoRA
            engine.push_weights(merged_checkpoint_tensors(target.base, target.path))
            holds = None
        else:
            if target.model_dir != holds:
                engine.push_weights(checkpoint_weights(target.model_dir).items())
                holds = target.model_dir
            if engine.adapters == "request":  # an adapter checkpoint's adapter, or none for a whole model
                engine.load_adapter(target.path if target.base is not None else None)
        samples: list[dict[str, Any]] | None = [] if keep_samples else None
        metrics = heldout_metrics(engine, heldout, sampling, seeds, samples=samples,
                                  max_tokens=cfg.rollout.trajectory_tokens)
        if cfg.eval.greedy:
            add_greedy_metrics(metrics, engine, heldout, cfg.rollout.max_new_tokens, cfg.rollout.trajectory_tokens)
        metrics["checkpoint"] = os.path.abspath(target.path)
        results.append(metrics)
        all_samples += [{"checkpoint": metrics["checkpoint"], **s} for s in samples or []]
        print(f"grpo eval: [{i + 1}/{len(targets)}] {target.label}: pass@1 {metrics['pass@1']:.3f} "
              f"({time.time() - tick:.0f}s)", flush=True)
    close_tools(tools)
    return results, all_samples


def _table_rows(results: list[dict[str, Any]]) -> list[tuple[str, list[str]]]:
    k = results[0]["k"]
    fmt = lambda v: f"{v:.3f}" if isinstance(v, float) else "-"  # noqa: E731

    def row(title: str, get: Any) -> tuple[str, list[str]]:
        values = []
        for m in results:
            try:
                values.append(fmt(get(m)))
            except KeyError:
                values.append("-")
        return title, values

    # With one sample a problem, pass@k and maj@k are pass@1 again: print them only for k > 1.
    rows = [row("pass@1", lambda m: m["pass@1"])]
    if k > 1:
        rows += [row(f"pass@{k}", lambda m: m["pass@k"]), row(f"maj@{k}", lambda m: m["maj@k"])]
    if "greedy_accuracy" in results[0]:
        rows.append(row("greedy accuracy", lambda m: m["greedy_accuracy"]))
    for title, key in (("greedy: samples calling a tool", "greedy_call_share"), ("samples calling a tool", "tools/call_share"),
                       ("pass@1 of samples calling", "tools/pass@1_calling"),
                       ("pass@1 of samples not calling", "tools/pass@1_not_calling")):
        if any(key in m for m in results):  # a tool run
            rows.append(row(title, lambda m, key=key: m[key]))
    rows += [row(f"mean reward: {name}", lambda m, n=name: m["mean_reward"][n]) for name in results[0]["mean_reward"]]
    rows += [(title, [f"{m[key]:.1f}" if key == "mean_length" else f"{m[key]:.3f}" for m in results])
             for title, key in (("mean length (tokens)", "mean_length"), ("truncation rate", "truncation_rate"))]
    for tier in results[0]["per_tier"]:
        rows.append(row(f"tier {tier} pass@1", lambda m, t=tier: m["per_tier"][t]["pass@1"]))
        if k > 1:
            rows += [row(f"tier {tier} pass@{k}", lambda m, t=tier: m["per_tier"][t]["pass@k"]),
                     row(f"tier {tier} maj@{k}", lambda m, t=tier: m["per_tier"][t]["maj@k"])]
        if "greedy_accuracy" in results[0]:
            rows.append(row(f"tier {tier} greedy", lambda m, t=tier: m["per_tier"][t]["greedy_accuracy"]))
    return rows


def print_table(cfg: EvalCommandConfig, targets: list[runs.Target], results: list[dict[str, Any]]) -> None:
    """One column per checkpoint, one row per metric."""
    from rich.console import Console
    from rich.table import Table

    title = (f"{cfg.task}: {results[0]['num_problems']} held-out problems, k={results[0]['k']}, "
             f"T={cfg.eval.temperature:g}")
    table = Table(title=title)
    table.add_column("metric")
    labels = [t.label for t in targets]
    if len(set(labels)) < len(labels):
        labels = [t.name for t in targets]
    for label in labels:
        table.add_column(label, justify="right")
    for title_, values in _table_rows(results):
        table.add_row(title_, *values)
    console = Console()
    if not console.is_terminal:
        console = Console(width=max(100, 28 + 14 * len(targets)))
    console.print(table)
