"""`grpo eval`: held-out metrics of checkpoints, sampled the way they were trained.

    grpo eval checkpoint=RUN_DIR/checkpoints/final            # the run's own recipe (RUN_DIR/config.yaml)
    grpo eval checkpoint=latest run=RUN_DIR                    # latest | best | base of a run
    grpo eval checkpoints=[base,RUN_DIR/checkpoints/final]     # side by side, one engine
    grpo eval checkpoint=path/to/hf_model recipe=bike_pricing  # any HF model directory, with a recipe

Where the recipe comes from: a checkpoint of a run (RUN_DIR/checkpoints/NAME) or
run=DIR makes RUN_DIR/config.yaml, the run's resolved config, the recipe, so the
task, template, rewards and sampling are the training ones; `recipe=NAME` wins
when given; command-line overrides (eval.samples_per_problem=8, ...) apply on
top of either (cli.py does the composing).

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

import json
import math
import os
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo_cli.checkpoint import COMPLETE_MARKER, is_partial, list_checkpoints
from grpo_cli.errors import UsageError

RUN_CONFIG = "config.yaml"  # a run's resolved config, written by `grpo train`
CHECKPOINTS = "checkpoints"  # a run's checkpoint folder
KEYWORDS = ("latest", "best", "base")
BEST_KEYS = ("eval/pass@1", "pass@1")  # where checkpoint.json records a held-out pass@1, if it does
EXPECTED = "a checkpoint directory (config.json + *.safetensors, + checkpoint.json for a run's checkpoint)"
NO_CHECKPOINT = ("no checkpoint given; set checkpoint=PATH (or latest|best|base with run=DIR) "
                 "or checkpoints=[A,B]")
# config.json fields that must agree for weights to be pushed into one engine
ARCH_KEYS = ("architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "rope_theta",
             "rope_parameters", "rope_scaling", "tie_word_embeddings", "max_position_embeddings")
EMBED_SUFFIXES = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight")
FULL_CREDIT = 1.0 - 1e-9  # a sample counts as correct for pass@k when its correctness reward reaches 1


# ---------------------------------------------------------------------------
# the metrics: pure functions


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with c correct among n samples: 1 - C(n-c, k) / C(n, k) (Chen et al. 2021)."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def answer_key(completion: str, answer_format: str) -> Any:
    """What a completion votes for in maj@k: its final answer at cent precision (rewards.final_answer);
    for an answer that is not a number, the single stated answer's text; None = no vote."""
    from grpo_cli import rewards

    value = rewards.final_answer(completion, answer_format)
    if value is not None:
        return value
    raw = rewards.final_answers(completion, answer_format)
    return raw[0].strip() if len(raw) == 1 and raw[0].strip() else None


def majority_vote(answers: list[Any]) -> int | None:
    """Index of the sample that represents the winning answer, or None when no sample has an answer.

    The most frequent non-None answer wins; a tie goes to the answer that appeared first,
    and the representative is that answer's first sample (deterministic, order-based).
    """
    counts = Counter(a for a in answers if a is not None)
    if not counts:
        return None
    first: dict[Any, int] = {}
    for i, a in enumerate(answers):
        if a is not None:
            first.setdefault(a, i)
    winner = max(counts, key=lambda a: (counts[a], -first[a]))
    return first[winner]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def summarise(problems: list[int], k: int, correct: list[float], per_function: dict[str, list[float]],
              lengths: list[int], truncated: list[bool], votes: list[Any]) -> dict[str, Any]:
    """The metrics of some problems (indices) from per-sample values laid out [N*k] (problem-major)."""
    samples = [p * k + j for p in problems for j in range(k)]
    num_correct = [sum(correct[p * k + j] >= FULL_CREDIT for j in range(k)) for p in problems]
    majority = []
    for p in problems:
        winner = majority_vote(votes[p * k:(p + 1) * k])
        majority.append(correct[p * k + winner] if winner is not None else 0.0)  # the vote's answer, scored
    return {
        "pass@1": _mean([correct[s] for s in samples]),
        "pass@k": _mean([pass_at_k(k, c, k) for c in num_correct]),
        "k": k,
        "maj@k": _mean(majority),
        "mean_length": _mean([lengths[s] for s in samples]),
        "truncation_rate": _mean([float(truncated[s]) for s in samples]),
        "mean_reward": {name: _mean([values[s] for s in samples]) for name, values in per_function.items()},
        "num_problems": len(problems),
    }


def _tiers(rows: list[dict[str, Any]]) -> dict[str, list[int]]:
    """tier -> problem indices, when the rows have a `tier` column (bike_pricing); else {}."""
    if not rows or "tier" not in rows[0]:
        return {}
    tiers: dict[str, list[int]] = {}
    for i, row in enumerate(rows):
        tiers.setdefault(str(row["tier"]), []).append(i)
    return dict(sorted(tiers.items()))


def heldout_metrics(engine: Any, rows: list[dict[str, Any]], encode: Any, reward_fns: list, answer_format: str,
                    k: int, temperature: float, top_p: float, max_new_tokens: int, seeds: list[int],
                    samples: list[dict[str, Any]] | None = None, prompt_column: str | None = None) -> dict[str, Any]:
    """Sample k completions per held-out row and measure them (see `summarise`), overall and per tier.

    pass@1 is the mean of the correctness reward (`rewards[i].correctness`). `samples`, when given, receives one
    record per sample (prompt, completion, rewards, length, truncated, row columns).
    For the training log, `flatten(metrics)` gives eval/... keys.
    """
    from grpo_cli import rewards

    prompt_ids = [encode(row) for row in rows]
    out = engine.generate(prompt_ids, k, temperature, top_p, max_new_tokens, seeds)
    texts = [t for group in out.texts for t in group]  # [N*k]
    columns = {key: [row[key] for row in rows for _ in range(k)] for key in rows[0]}  # each [N*k]
    lengths = [len(c) for group in out.completion_ids for c in group]  # [N*k]
    scored = rewards.score(reward_fns, texts, columns, answer_format, completion_tokens=lengths,
                           max_new_tokens=max_new_tokens, prompts=columns.get(prompt_column), group_size=k)
    correct = scored.per_function[rewards.correctness_name(reward_fns)]  # [N*k]
    truncated = [bool(t) for group in out.truncated for t in group]  # [N*k]
    votes = [answer_key(t, answer_format) for t in texts]  # [N*k]
    parts = (k, correct, scored.per_function, lengths, truncated, votes)
    metrics = summarise(list(range(len(rows))), *parts)
    metrics["per_tier"] = {tier: summarise(idx, *parts) for tier, idx in _tiers(rows).items()}
    if samples is not None:
        tokenizer = getattr(engine, "tokenizer", None)
        for s, text in enumerate(texts):
            p = s // k
            samples.append({
                "problem": p, "sample": s % k,
                "prompt": tokenizer.decode(prompt_ids[p]) if tokenizer is not None else None,
                "completion": text,
                "rewards": {name: values[s] for name, values in scored.per_function.items()},
                "length": lengths[s], "truncated": truncated[s],
                "columns": rows[p],
            })
    return metrics


def greedy_accuracy(engine: Any, rows: list[dict[str, Any]], encode: Any, reward_fns: list, answer_format: str,
                    max_new_tokens: int, prompt_column: str | None = None) -> tuple[float, dict[str, float]]:
    """Accuracy of one temperature-0 completion per row: (overall, per tier)."""
    from grpo_cli import rewards

    out = engine.generate([encode(row) for row in rows], 1, 0.0, 1.0, max_new_tokens, list(range(len(rows))))
    columns = {key: [row[key] for row in rows] for key in rows[0]}
    scored = rewards.score(reward_fns, [group[0] for group in out.texts], columns, answer_format,
                           completion_tokens=[len(group[0]) for group in out.completion_ids],
                           max_new_tokens=max_new_tokens, prompts=columns.get(prompt_column), group_size=1)
    correct = scored.per_function[rewards.correctness_name(reward_fns)]  # [N]
    return _mean(correct), {tier: _mean([correct[i] for i in idx]) for tier, idx in _tiers(rows).items()}


def flatten(metrics: dict[str, Any], prefix: str = "eval/") -> dict[str, float]:
    """heldout_metrics' dict -> flat log keys: eval/pass@1, eval/reward/NAME, eval/pass@1_tier1, ..."""
    flat: dict[str, float] = {}
    for key, value in metrics.items():
        if key == "mean_reward":
            flat.update({f"{prefix}reward/{name}": v for name, v in value.items()})
        elif key == "per_tier":
            for tier, sub in value.items():
                flat.update({f"{prefix}{name}_tier{tier}": v for name, v in sub.items()
                             if isinstance(v, float) and name != "mean_reward"})
        elif key not in ("k", "num_problems"):
            flat[f"{prefix}{key}"] = value
    return flat


# ---------------------------------------------------------------------------
# which checkpoints: names on the command line -> checked model directories


def _names(checkpoint: Any, checkpoints: Any) -> list[str]:
    if checkpoint not in (None, ""):
        return [str(checkpoint)]
    if isinstance(checkpoints, (list, tuple)):
        return [str(c) for c in checkpoints]
    return [str(checkpoints)] if checkpoints not in (None, "") else []


def run_dir_of(names: list[str], run: str | None) -> Path | None:
    """The run an eval refers to: run=DIR, else the run of the first checkpoint path inside one."""
    if run:
        return Path(run)
    for name in names:
        if name in KEYWORDS:
            continue
        path = Path(os.path.abspath(name))  # so that "." inside a checkpoint still knows its run
        if (path / RUN_CONFIG).is_file():  # a run directory given as the checkpoint; resolve() says what to pick
            return path
        if path.parent.name == CHECKPOINTS and (path.parent.parent / RUN_CONFIG).is_file():
            return path.parent.parent
    return None


def run_config_path(overrides: dict[str, Any], strict: bool) -> Path | None:
    """For cli.py: the saved config of the run being evaluated, which stands in for recipe=NAME.

    strict=True (no recipe given) raises a one-line UsageError instead of returning None.
    """
    names = _names(overrides.get("checkpoint"), overrides.get("checkpoints"))
    run = overrides.get("run")
    run = str(run) if run not in (None, "") else None
    run_dir = run_dir_of(names, run)
    if run_dir is not None and (run_dir / RUN_CONFIG).is_file():
        return run_dir / RUN_CONFIG
    if not strict:
        return None
    if run is not None:
        _check_run(Path(run), run)
        raise UsageError(f"run={run}: no {RUN_CONFIG} there (a run directory written by grpo train has one); "
                         "add recipe=NAME to evaluate with a recipe")
    if not names:
        raise UsageError(NO_CHECKPOINT)
    paths = [n for n in names if n not in KEYWORDS]
    if not paths:
        raise UsageError(f"checkpoint={names[0]} needs run=DIR, the run directory it refers to"
                         + (" (or recipe=NAME: base is the recipe's model)" if names[0] == "base" else ""))
    check_checkpoint(Path(paths[0]), paths[0])
    raise UsageError(f"'{paths[0]}' is not a checkpoint of a run (RUN_DIR/{CHECKPOINTS}/NAME beside "
                     f"RUN_DIR/{RUN_CONFIG}), so no recipe says how to evaluate it; add recipe=NAME")


def _check_run(run_dir: Path, name: str) -> None:
    if not run_dir.exists():
        raise UsageError(f"run={name}: no such directory; expected a run directory of grpo train "
                         f"({RUN_CONFIG}, {CHECKPOINTS}/)")
    if not run_dir.is_dir():
        raise UsageError(f"run={name}: is a file; expected a run directory of grpo train ({RUN_CONFIG}, {CHECKPOINTS}/)")


def _run_listing(run_dir: Path) -> str:
    """What a run's checkpoints folder holds, for error messages."""
    root = run_dir / CHECKPOINTS
    complete = [p.name for p, _ in list_checkpoints(run_dir)]
    if complete:
        return f"checkpoints in {root}: {', '.join(complete)}"
    entries = sorted(p.name for p in root.iterdir()) if root.is_dir() else []
    if entries:
        return f"{root} holds no complete checkpoint, only: {', '.join(e + ' (partial)' for e in entries)}"
    return f"it has no checkpoints ({root} is {'empty' if root.is_dir() else 'missing'})"


def _holds(path: Path) -> str:
    names = sorted(p.name for p in path.iterdir())
    return ", ".join(names[:12]) + (f", ... ({len(names)} entries)" if len(names) > 12 else "") if names else "nothing"


def check_checkpoint(path: Path, name: str) -> None:
    """A usable model directory, or a one-line UsageError naming what was expected (reads headers only)."""
    if not path.exists():
        raise UsageError(f"checkpoint '{name}' does not exist; expected {EXPECTED}, or latest|best|base with run=DIR")
    if not path.is_dir():
        raise UsageError(f"checkpoint '{name}' is a file; expected {EXPECTED}")
    parent = Path(os.path.abspath(path)).parent
    in_run = parent.name == CHECKPOINTS  # RUN_DIR/checkpoints/NAME
    if not (path / "config.json").is_file() and ((path / CHECKPOINTS).is_dir() or (path / RUN_CONFIG).is_file()):
        raise UsageError(f"'{name}' is a run directory, not a checkpoint; {_run_listing(path)} "
                         f"(pass checkpoint=RUN_DIR/{CHECKPOINTS}/NAME, or checkpoint=latest run={name})")
    if is_partial(path) or (in_run and not (path / COMPLETE_MARKER).is_file()):
        where = f"; {_run_listing(parent.parent)}" if in_run else ""
        raise UsageError(f"'{name}' is a partial checkpoint (an interrupted save: no {COMPLETE_MARKER}, which a "
                         f"complete save writes last){where}")
    shards = sorted(path.glob("*.safetensors"))
    missing = [what for what, ok in (("config.json", (path / "config.json").is_file()), ("*.safetensors", shards))
               if not ok]
    if missing:
        raise UsageError(f"'{name}' is not a checkpoint: no {' and no '.join(missing)}; expected {EXPECTED}; "
                         f"it holds: {_holds(path)}")
    try:
        json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"'{name}/config.json' is not valid JSON ({e}); the checkpoint is corrupted") from None
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            wanted = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, AttributeError) as e:
            raise UsageError(f"'{index}' is unreadable ({e}); the checkpoint is corrupted") from None
        if lost := sorted(w for w in wanted if not (path / w).is_file()):
            raise UsageError(f"'{name}' is a partial checkpoint: shard {lost[0]} listed in {index.name} is missing")
    from safetensors import safe_open

    for shard in shards:
        try:
            with safe_open(str(shard), framework="pt"):
                pass  # the header, and that the file covers every tensor it declares
        except Exception as e:
            raise UsageError(f"'{shard}' is corrupted or truncated (safetensors: {' '.join(str(e).split())}); "
                             "re-save it or pick another checkpoint") from None


@dataclass(frozen=True)
class Target:
    name: str  # as written on the command line: latest | best | base | a path
    path: Path  # the model directory holding config.json and *.safetensors
    beside: bool  # whether a lone eval's eval.json goes into `path` (not for base: it is not the run's)

    @property
    def label(self) -> str:
        return self.name if self.name in KEYWORDS else self.path.name


def _base_path(name_or_path: str) -> Path:
    """The run's (or recipe's) starting model as a local directory; a hub id must already be in the local cache."""
    from grpo_cli.checkpoint import resolve_model_path

    try:
        resolved = resolve_model_path(name_or_path)
    except FileNotFoundError as e:
        raise UsageError(f"base: {e}") from None
    if Path(resolved).is_dir():
        return Path(resolved)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(resolved, local_files_only=True))
    except Exception:
        raise UsageError(f"base: model.name_or_path='{name_or_path}' is neither a local directory nor in the local "
                         "hub cache; download it and pass checkpoint=DIR") from None


def resolve(name: str, run_dir: Path | None, model_name_or_path: str) -> Target:
    """One command-line name -> a checked Target."""
    if name in ("latest", "best"):
        if run_dir is None:
            raise UsageError(f"checkpoint={name} needs run=DIR, the run directory whose checkpoints it picks from")
        found = list_checkpoints(run_dir)
        if not found:
            raise UsageError(f"run directory '{run_dir}' has no complete checkpoint for checkpoint={name}; "
                             f"{_run_listing(run_dir)}")
        if name == "latest":
            path = found[-1][0]
        else:
            scored = []  # (pass@1, position by step, path); a tie goes to the later checkpoint
            for position, (path, info) in enumerate(found):
                value = next((info[key] for key in BEST_KEYS if isinstance(info.get(key), (int, float))), None)
                if value is not None:
                    scored.append((float(value), position, path))
            if not scored:
                raise UsageError(f"no best checkpoint is recorded in '{run_dir}': no {COMPLETE_MARKER} there holds a "
                                 f"held-out pass@1 ({' or '.join(BEST_KEYS)}); use checkpoint=latest or a path "
                                 f"({_run_listing(run_dir)})")
            path = max(scored)[2]
        check_checkpoint(path, str(path))
        return Target(name, path, beside=True)
    if name == "base":
        path = _base_path(model_name_or_path)
        check_checkpoint(path, str(path))
        return Target(name, path, beside=False)
    path = Path(name)
    check_checkpoint(path, name)
    return Target(name, path, beside=True)


def check_compatible(targets: list[Target]) -> None:
    """Every checkpoint's architecture (config.json) matches the first's, whose engine they share."""
    first = targets[0]
    reference = json.loads((first.path / "config.json").read_text())
    for target in targets[1:]:
        config = json.loads((target.path / "config.json").read_text())
        for key in ARCH_KEYS:
            if config.get(key) != reference.get(key):
                raise UsageError(f"'{target.name}' does not fit the engine started on '{first.name}': config.json "
                                 f"{key} is {config.get(key)!r}, not {reference.get(key)!r}; checkpoints compared "
                                 "in one call must share the architecture and tokenizer (evaluate it separately)")


def check_tokenizers(targets: list[Target], tokenizer: Any) -> None:
    """Every checkpoint's tokenizer has the first's vocabulary (prompts are encoded once, with the first's)."""
    from grpo_cli.checkpoint import load_tokenizer

    vocab = tokenizer.get_vocab()
    for target in targets[1:]:
        try:
            other = load_tokenizer(str(target.path))
        except Exception as e:
            raise UsageError(f"'{target.name}': cannot load its tokenizer ({type(e).__name__}: {e})") from None
        if other.get_vocab() != vocab or other.eos_token_id != tokenizer.eos_token_id:
            raise UsageError(f"'{target.name}' has a different tokenizer from '{targets[0].name}'; checkpoints "
                             "compared in one call must share the architecture and tokenizer (evaluate it separately)")


def checkpoint_weights(path: Path) -> dict[str, Any]:
    """Every tensor of a checkpoint, in checkpoint format, from safetensors only (never pickle).

    A model with tied embeddings stores no `lm_head.weight`; it is added as the embedding,
    because the engine's layer-wise reload silently leaves a model half-updated when a key
    is missing (see VLLMEngine.push_weights).
    """
    from safetensors.torch import load_file

    tensors: dict[str, Any] = {}
    for shard in sorted(path.glob("*.safetensors")):
        try:
            tensors.update(load_file(str(shard)))
        except Exception as e:
            raise UsageError(f"'{shard}' is corrupted or truncated (safetensors: {' '.join(str(e).split())})") from None
    if "lm_head.weight" not in tensors:
        embed = next((key for key in tensors if key.endswith(EMBED_SUFFIXES)), None)
        if embed is None:
            raise UsageError(f"'{path}' has neither lm_head.weight nor an input embedding to tie it to")
        tensors["lm_head.weight"] = tensors[embed]
    return tensors


# ---------------------------------------------------------------------------
# where results go


def output_path(out: str | None, targets: list[Target], run_dir: Path | None) -> Path:
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


def run(cfg: Any, run_dir: Path | None = None) -> int:
    """`grpo eval`: resolve and check every checkpoint, evaluate them on one engine, print, then write."""
    from grpo_cli import data, monitor, rewards

    monitor.quiet_third_party(cfg.logging.verbose_libraries)  # before vLLM/datasets/transformers are imported

    # --- fail at the edge: checkpoints, output path, data and rewards before any model loads
    names = _names(cfg.checkpoint, cfg.checkpoints)
    if not names:
        raise UsageError(NO_CHECKPOINT)
    if cfg.run:
        _check_run(Path(cfg.run), cfg.run)
    the_run = run_dir_of(names, cfg.run)
    targets = [resolve(name, the_run, cfg.model.name_or_path) for name in names]
    check_compatible(targets)
    out_path = output_path(cfg.out, targets, the_run)
    samples_path = out_path.with_suffix(".samples.jsonl") if cfg.samples_jsonl else None
    _, heldout = data.load_splits(cfg.data)
    rows = heldout[: cfg.eval.num_problems]
    reward_fns = rewards.load_rewards(cfg.rewards)
    rewards.validate_columns(rows, reward_fns)

    import torch

    from grpo_cli import rollout
    from grpo_cli.checkpoint import load_tokenizer
    from grpo_cli.prompts import render_row

    threads = cfg.trainer.threads or os.cpu_count() or 1
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))  # before the engine starts (see train.py)
    torch.set_num_threads(threads)
    tokenizer = load_tokenizer(str(targets[0].path))
    check_tokenizers(targets, tokenizer)

    def encode(row: dict[str, Any]) -> list[int]:
        return tokenizer(render_row(row, cfg.data, tokenizer),
                         add_special_tokens=False)["input_ids"]

    k, answer_format = cfg.eval.samples_per_problem, cfg.data.answer_format
    seeds = rollout.sample_seeds(cfg.trainer.seed, 0, len(rows), stream=1)  # the run's step-0 held-out seeds
    print(f"grpo eval: {cfg.task} | {len(rows)} held-out problems x {k} samples at T={cfg.eval.temperature:g} | "
          f"{len(targets)} checkpoint(s)" + (f" | recipe of run {the_run}" if the_run else ""), flush=True)
    print(f"grpo eval: starting the vLLM engine on {targets[0].path}", flush=True)
    engine = rollout.VLLMEngine(str(targets[0].path), cfg.model, cfg.rollout, cfg.trainer.seed,
                                show_progress=cfg.logging.verbose_libraries)
    results, all_samples = [], []
    for i, target in enumerate(targets):
        tick = time.time()
        if i > 0:
            engine.push_weights(checkpoint_weights(target.path).items())
        samples: list[dict[str, Any]] | None = [] if samples_path else None
        metrics = heldout_metrics(engine, rows, encode, reward_fns, answer_format, k, cfg.eval.temperature,
                                  cfg.rollout.top_p, cfg.rollout.max_new_tokens, seeds, samples=samples,
                                  prompt_column=cfg.data.prompt_column)
        if cfg.eval.greedy:
            overall, per_tier = greedy_accuracy(engine, rows, encode, reward_fns, answer_format,
                                                cfg.rollout.max_new_tokens, cfg.data.prompt_column)
            metrics["greedy_accuracy"] = overall
            for tier, value in per_tier.items():
                metrics["per_tier"][tier]["greedy_accuracy"] = value
        metrics["checkpoint"] = os.path.abspath(target.path)
        results.append(metrics)
        all_samples += [{"checkpoint": metrics["checkpoint"], **s} for s in samples or []]
        print(f"grpo eval: [{i + 1}/{len(targets)}] {target.label}: pass@1 {metrics['pass@1']:.3f} "
              f"({time.time() - tick:.0f}s)", flush=True)

    print_table(cfg, targets, results)
    payload: Any = results[0] if len(results) == 1 else {"checkpoints": results}
    _write_atomically(out_path, json.dumps(payload, indent=2) + "\n")
    print(f"eval.json: {out_path}")
    if samples_path is not None:
        _write_atomically(samples_path, "".join(json.dumps(s, ensure_ascii=False, default=str) + "\n"
                                                for s in all_samples))
        print(f"samples: {samples_path}")
    return 0


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


def print_table(cfg: Any, targets: list[Target], results: list[dict[str, Any]]) -> None:
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
