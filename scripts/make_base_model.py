"""Build the small base models shipped in grpo_cli/models: bike_base, countdown_base and bike_tools_base.

    .venv/bin/python scripts/make_base_model.py      # bike_base: ~8 minutes on 2 CPU cores (7-8 training, <1 measuring)
    .venv/bin/python scripts/make_base_model.py --generator grpo_cli.tasks.countdown \
        --out grpo_cli/models/countdown_base --steps 2400 --target 0.2 --max-new-tokens 96   # ~6 minutes
    .venv/bin/python scripts/make_base_model.py --generator grpo_cli.tasks.bike_pricing_tools \
        --out grpo_cli/models/bike_tools_base --tool-share 0.3 --max-greedy 1 --target 1 \
        --recipe bike_pricing_tools --max-new-tokens 256   # ~8 minutes (6.5 training, 1.5 measuring)

bike_tools_base (recipe=bike_pricing_tools, issue 24) learns prices to the cent from solutions of
which 30% (--tool-share) call the calculator for every computation (`<calc>7 x 17.35</calc>`, the
result tokenized apart and kept out of the loss, as in a rollout) and 70% work it out in their own
tokens. No output temperature (--target 1). Measured from disk through `grpo eval` with the recipe's
calculator, 200 held-out problems, 8 samples at T=1 and greedy: sampled pass@1 0.471, greedy 0.060;
45% of the sampled solutions call the tool and none of the greedy ones; pass@1 0.953 of the samples
that call it against 0.070 of those that do not. 1,116,800 parameters, 4.3 MiB.

The generator module gives the problems (`splits`) and, as CHECK_REWARDS, the names of the
built-in (correctness, format) rewards the from-disk measurement uses. Countdown problems have
many solutions, so the teacher-forced dev proxies below (which follow the one worked solution)
read well under the real accuracies: --target 0.2 there gave held-out sampled pass@1 0.33 (and
greedy 0.58) from vLLM.

What it does, top to bottom:
1. draws the bike_pricing problems with the recipe's defaults (DataConfig:
   num_train=20000, num_heldout=200, seed=1234) and trains on the train split
   only; the last `--dev` train problems are kept out of training as a dev set;
2. trains a byte-level BPE tokenizer (512 tokens) on the training texts;
3. builds a tiny Qwen2 causal LM (1.1M parameters) and trains it on
   `render_plain(question) + " " + solution + EOS`, loss on every token
   (question tokens included: it learns to copy numbers from the question
   much sooner) for a fixed number of steps with a cosine learning rate;
4. every `--eval-every` steps scores the dev set by teacher forcing (one
   forward pass: greedy = every gold token is the argmax; sampled = the
   probability of sampling the gold solution at T=1) and keeps the latest
   checkpoint whose greedy accuracy is <= `--max-greedy`;
5. raises the kept model's output temperature until its dev sampled accuracy
   drops to `--target`, by dividing the final norm's weight (logits scale with
   it; greedy decoding is unchanged). A small model trained this briefly is
   nearly as good sampled as greedy; the deliberate gap between greedy (~70%)
   and sampled pass@1 at T=1 (~30%) is the room GRPO gets: sharpening the
   distribution alone can gain ~35 points, learning more arithmetic the rest;
6. saves it in Hugging Face format and measures it FROM DISK: the tokenizer
   round-trip through AutoTokenizer, transformers load and greedy agreement
   with vLLM, vLLM's detokenized text, and held-out sampled (n=8, T=1) and
   greedy pass@1 per tier with vLLM, with the all-wrong/mixed/all-right split.

The tokenizer trap (docs/design.md): `AutoTokenizer.from_pretrained` on a
directory whose config.json says model_type=qwen2 returns a `Qwen2Tokenizer`
whatever tokenizer_config.json says, and that class rebuilds its normalizer and
pre-tokenizer from scratch (NFC + Qwen2's split regex + byte-level), keeping
only the vocabulary and merges. vLLM loads tokenizers the same way. So this
tokenizer is trained with exactly that pipeline (its regex already splits
digits one by one), and "Qwen2Tokenizer" is recorded as its class: every
loader builds the same tokenizer, which the script then checks from disk.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from grpo_cli.prompts.templates import render_plain  # noqa: E402

EOS, PAD = "<|endoftext|>", "<|pad|>"
# Qwen2Tokenizer's own pre-tokenizer regex (transformers' models/qwen2/tokenization_qwen2.py).
QWEN2_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "grpo_cli/models/bike_base"), help="output directory (HF format)")
    p.add_argument("--seed", type=int, default=0, help="torch seed: init, data order, dev sampling")
    p.add_argument("--data-seed", type=int, default=1234, help="bike_pricing generator seed (DataConfig.seed)")
    p.add_argument("--num-train", type=int, default=20000, help="train problems drawn (DataConfig.num_train)")
    p.add_argument("--num-heldout", type=int, default=200, help="held-out problems (DataConfig.num_heldout)")
    p.add_argument("--dev", type=int, default=200, help="train problems kept out of training to pick the checkpoint")
    p.add_argument("--vocab-size", type=int, default=512, help="BPE vocabulary size, special tokens included")
    p.add_argument("--hidden", type=int, default=128, help="hidden size")
    p.add_argument("--layers", type=int, default=4, help="decoder layers")
    p.add_argument("--heads", type=int, default=4, help="attention heads (head_dim = hidden / heads; vLLM CPU wants 32 or 64)")
    p.add_argument("--kv-heads", type=int, default=4, help="key/value heads (grouped-query attention)")
    p.add_argument("--intermediate", type=int, default=512, help="MLP intermediate size")
    p.add_argument("--max-positions", type=int, default=512, help="max_position_embeddings")
    p.add_argument("--steps", type=int, default=1400, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=32, help="sequences per step")
    p.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate")
    p.add_argument("--warmup", type=int, default=50, help="linear warm-up steps, then cosine decay to 10%%")
    p.add_argument("--completion-loss-only", dest="prompt_loss", action="store_false",
                   help="train on the solution tokens only (without it the question tokens are trained on too, which speeds learning)")
    p.add_argument("--schedule", choices=("cosine", "constant"), default="cosine", help="LR after warm-up")
    p.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay")
    p.add_argument("--eval-every", type=int, default=100, help="dev evaluation (and candidate checkpoint) every N steps")
    p.add_argument("--max-greedy", type=float, default=0.70, help="keep the latest checkpoint with dev greedy <= this")
    p.add_argument("--target", type=float, default=0.30,
                   help="dev sampled accuracy (T=1) that the output temperature brings the kept checkpoint down to")
    p.add_argument("--max-new-tokens", type=int, default=160, help="completion cap for every evaluation")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--generator", default="grpo_cli.tasks.bike_pricing", help="module providing splits(...)")
    p.add_argument("--tool-share", type=float, default=0.0,
                   help="share of training solutions written with the calculator (the generator's tool_segments); "
                        "0 = none")
    p.add_argument("--recipe", default=None,
                   help="measure held-out pass@1 with this recipe's tools, through grpo eval (e.g. bike_pricing_tools); "
                        "default: single-turn sampling with vLLM")
    p.add_argument("--skip-measure", action="store_true", help="save without the from-disk vLLM measurement")
    p.add_argument("--measure-only", action="store_true", help="only measure the model already in --out")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------
# correctness: the project's own reward functions


# The task's (correctness, format) rewards: the generator module's CHECK_REWARDS, set in main().
CHECK_REWARDS = ("correct", "format")


def _check(name: str, completions: list[str], problems) -> list[bool]:
    from grpo_cli.rewards import load_reward

    rows = [p.to_row() for p in problems]
    columns = {k: [row[k] for row in rows] for k in rows[0] if k not in ("question", "solution")}
    return [r == 1.0 for r in load_reward(name)(completions, **columns)]


def is_correct(completions: list[str], problems) -> list[bool]:
    return _check(CHECK_REWARDS[0], completions, problems)


def is_well_formed(completions: list[str], problems) -> list[bool]:
    return _check(CHECK_REWARDS[1], completions, problems)


# ---------------------------------------------------------------------------
# tokenizer


def build_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS, PAD],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD, unk_token=EOS,
                                   model_max_length=1 << 30)


def save_tokenizer(tokenizer, out: Path) -> None:
    tokenizer.save_pretrained(out)
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "Qwen2Tokenizer"  # what AutoTokenizer builds for qwen2 anyway; see module docstring
    cfg["add_bos_token"] = False
    cfg["add_eos_token"] = False
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")


# ---------------------------------------------------------------------------
# data


def encode(tokenizer, problems, tool_segments=None, use_tool=None) -> list[tuple[list[int], int, list[int]]]:
    """(prompt ids + completion ids + EOS, prompt length, positions without loss). Prompt and completion
    are encoded separately, exactly as the policy sees them at rollout time. A problem with `use_tool`
    is written with the calculator (`tool_segments`, the generator's): each turn is encoded on its own,
    as the rollout engine tokenizes them, and the tool's results carry no loss (the model never writes them)."""
    eos = tokenizer.eos_token_id
    out = []
    for i, p in enumerate(problems):
        prompt = tokenizer.encode(render_plain(p.question), add_special_tokens=False)
        if use_tool is None or not use_tool[i]:
            completion = tokenizer.encode(" " + p.solution, add_special_tokens=False)
            out.append((prompt + completion + [eos], len(prompt), []))
            continue
        ids, silent = list(prompt), []
        for j, (text, by_model) in enumerate(tool_segments(p)):
            piece = tokenizer.encode((" " if j == 0 else "") + text, add_special_tokens=False)
            if not by_model:
                silent += range(len(ids), len(ids) + len(piece))
            ids += piece
        out.append((ids + [eos], len(prompt), silent))
    return out


def training_texts(problems, tool_segments=None) -> list[str]:
    """What the tokenizer is trained on: every question with its solution, and with a calculator the
    tool-using solutions' turns as separate texts (a merge across a turn's edge is never used)."""
    texts = [render_plain(p.question) + " " + p.solution for p in problems]
    if tool_segments is not None:
        texts += [(" " if j == 0 else "") + text for p in problems for j, (text, _) in enumerate(tool_segments(p))]
    return texts


def make_batch(examples, pad_id: int, prompt_loss: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded input ids and labels (-100 on prompt, tool results and padding). Causal attention
    means right padding never reaches a real position, so no attention mask is needed."""
    width = max(len(ids) for ids, _, _ in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)  # [B, T]
    labels = torch.full((len(examples), width), -100, dtype=torch.long)  # [B, T]
    for i, (ids, n_prompt, silent) in enumerate(examples):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        first = 0 if prompt_loss else n_prompt
        labels[i, first : len(ids)] = torch.tensor(ids[first:])
        labels[i, silent] = -100  # a tool's result: not the model's to write
    return input_ids, labels


def length_bucketed_batches(examples, batch_size: int, gen: torch.Generator, window: int = 64) -> list[list[int]]:
    """One epoch of batches in a seeded order. Within each window of `window` batches the
    examples are sorted by length, so a batch holds similar lengths and pads little."""
    perm = torch.randperm(len(examples), generator=gen).tolist()
    batches = []
    for start in range(0, len(perm), batch_size * window):
        chunk = sorted(perm[start : start + batch_size * window], key=lambda i: len(examples[i][0]))
        batches += [chunk[j : j + batch_size] for j in range(0, len(chunk), batch_size)]
    shuffled = torch.randperm(len(batches), generator=gen).tolist()
    return [batches[i] for i in shuffled]


# ---------------------------------------------------------------------------
# model


def build_model(args, tokenizer):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, intermediate_size=args.intermediate,
        max_position_embeddings=args.max_positions, tie_word_embeddings=True, rms_norm_eps=1e-6,
        bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        use_cache=True,
    )
    return Qwen2ForCausalLM(config)


def lr_at(step: int, args) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    if args.schedule == "constant":
        return args.lr
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def dev_eval(model, examples, pad_id: int, temperature: float = 1.0, batch_size: int = 64) -> dict:
    """Teacher-forced accuracy proxies on held-out-like examples, one forward pass each.

    greedy: every completion token is the argmax (greedy decoding reproduces the gold
    solution). sampled: exp(sum of completion logprobs), the probability that sampling
    at temperature 1 writes the gold solution token for token. Both track real decoding
    closely because the solution format is fixed; the final numbers come from vLLM.
    """
    model.eval()
    sums = [0.0, 0.0, 0.0, 0]
    for i in range(0, len(examples), batch_size):
        input_ids, labels = make_batch(examples[i : i + batch_size], pad_id)  # [B, T]
        add_teacher_forced(sums, model(input_ids=input_ids).logits, labels, temperature)
    model.train()
    return teacher_forced_metrics(sums, len(examples))


def add_teacher_forced(sums: list, logits: torch.Tensor, labels: torch.Tensor, temperature: float) -> None:
    """Add one batch's [greedy hits, sampled probability, nll, tokens] into `sums` (dev_eval's proxies)."""
    logits = logits[:, :-1].float() / temperature  # [B, T-1, V]
    target = labels[:, 1:]  # [B, T-1]
    mask = target != -100  # [B, T-1]
    logp = logits.log_softmax(-1).gather(-1, target.clamp(min=0)[..., None])[..., 0] * mask  # [B, T-1]
    hit = (logits.argmax(-1) == target) | ~mask  # [B, T-1]
    sums[0] += hit.all(-1).sum().item()
    sums[1] += logp.sum(-1).exp().sum().item()
    sums[2] -= logp.sum().item()
    sums[3] += mask.sum().item()


def teacher_forced_metrics(sums: list, n: int) -> dict:
    return {"greedy": sums[0] / n, "sampled": sums[1] / n, "loss": sums[2] / sums[3]}


def train(args, tokenizer, train_set, dev_set, tool_segments=None):
    torch.manual_seed(args.seed)
    model = build_model(args, tokenizer)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: Qwen2 {args.layers} layers x {args.hidden} hidden, {args.heads} heads "
          f"(head_dim {args.hidden // args.heads}), {n_params:,} parameters", flush=True)
    # Which training solutions use the calculator: a seeded coin per problem, at --tool-share.
    coin = random.Random(f"tool-share/{args.seed}")
    use_tool = [coin.random() < args.tool_share for _ in train_set] if tool_segments else None
    if use_tool:
        print(f"solutions with the calculator: {sum(use_tool)} of {len(use_tool)}", flush=True)
    examples = encode(tokenizer, train_set, tool_segments, use_tool)
    dev_examples = encode(tokenizer, dev_set)  # without the tool: what picks the checkpoint and its temperature
    dev_tool_examples = encode(tokenizer, dev_set, tool_segments, [True] * len(dev_set)) if tool_segments else None
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.99))
    order_gen = torch.Generator().manual_seed(args.seed)
    order: list[list[int]] = []  # upcoming batches, each a list of example indices
    candidates = []  # (step, dev metrics, state_dict)
    t0, seen_tokens, loss_sum = time.time(), 0, 0.0
    for step in range(args.steps):
        if not order:
            order = length_bucketed_batches(examples, args.batch_size, order_gen)
        batch = [examples[i] for i in order.pop()]
        input_ids, labels = make_batch(batch, tokenizer.pad_token_id, args.prompt_loss)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args)
        loss = model(input_ids=input_ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_sum += loss.item()
        seen_tokens += input_ids.numel()
        if (step + 1) % 25 == 0:
            print(f"step {step + 1:5d}  loss {loss_sum / 25:.4f}  lr {lr_at(step, args):.2e}  "
                  f"{seen_tokens / (time.time() - t0):,.0f} tok/s  {time.time() - t0:.0f}s", flush=True)
            loss_sum = 0.0
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            te = time.time()
            metrics = dev_eval(model, dev_examples, tokenizer.pad_token_id)
            with_tool = ""
            if dev_tool_examples:
                metrics["with_tool"] = dev_eval(model, dev_tool_examples, tokenizer.pad_token_id)
                with_tool = (f"  with the calculator: greedy {metrics['with_tool']['greedy']:.3f} "
                             f"sampled {metrics['with_tool']['sampled']:.3f}")
            candidates.append((step + 1, metrics, copy.deepcopy(model.state_dict())))
            print(f"  dev @ {step + 1}: loss {metrics['loss']:.4f}  greedy {metrics['greedy']:.3f}  "
                  f"sampled {metrics['sampled']:.3f}{with_tool}  "
                  f"({time.time() - te:.0f}s)", flush=True)
    # The kept checkpoint: the latest whose dev greedy accuracy stays under the cap.
    step, metrics, state = max((c for c in candidates if c[1]["greedy"] <= args.max_greedy),
                               key=lambda c: c[0], default=candidates[0])
    model.load_state_dict(state)
    print(f"kept checkpoint @ step {step}: dev greedy {metrics['greedy']:.3f}, sampled {metrics['sampled']:.3f}; "
          f"training took {time.time() - t0:.0f}s", flush=True)
    # Its output temperature: the lowest on the grid that brings dev sampled accuracy down to the target.
    temperature, tempered = 1.0, metrics
    for t in [1.0 + 0.05 * i for i in range(41)]:
        temperature, tempered = t, dev_eval(model, dev_examples, tokenizer.pad_token_id, temperature=t)
        if tempered["sampled"] <= args.target:
            break
    apply_output_temperature(model, temperature)
    print(f"output temperature {temperature:.2f}: dev greedy {tempered['greedy']:.3f}, "
          f"sampled {tempered['sampled']:.3f}", flush=True)
    model.generation_config.bos_token_id = None
    return model, {"kept_step": step, "dev": metrics, "output_temperature": round(temperature, 2),
                   "dev_tempered": tempered, "train_seconds": round(time.time() - t0, 1),
                   "curve": [(s, m) for s, m, _ in candidates], "parameters": n_params}


@torch.no_grad()
def apply_output_temperature(model, temperature: float) -> None:
    """Divide every logit by `temperature`, in the weights: logits = (w * rmsnorm(h)) @ E^T with
    tied embeddings E, so scaling the final norm's weight w scales the logits exactly. Greedy
    decoding is unchanged; sampling at T=1 now behaves like the trained model at T=temperature."""
    model.model.norm.weight.div_(temperature)


def save(model, tokenizer, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for f in out.iterdir():
        if f.is_file():
            f.unlink()
    model.save_pretrained(out, safe_serialization=True)
    save_tokenizer(tokenizer, out)
    for f in out.iterdir():
        f.chmod(0o644)  # safetensors writes 0600


# ---------------------------------------------------------------------------
# measuring from disk


def tokenizer_round_trip(out: Path, reference, texts: list[str]) -> None:
    """The tokenizer on disk, through AutoTokenizer, encodes and decodes like the in-memory one."""
    from transformers import AutoTokenizer

    loaded = AutoTokenizer.from_pretrained(out)
    assert len(loaded) == len(reference), (len(loaded), len(reference))
    assert loaded.eos_token_id == reference.eos_token_id and loaded.pad_token_id == reference.pad_token_id
    for text in texts:
        ids = reference.encode(text, add_special_tokens=False)
        assert loaded.encode(text) == ids, f"encodings differ on {text!r}"
        assert loaded.decode(ids) == text, f"decode differs on {text!r}"
    print(f"tokenizer round-trip from disk ({type(loaded).__name__}): {len(texts)} strings identical", flush=True)


def hf_greedy_from_disk(out: Path, prompts: list[str], max_new_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(out)
    outs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = tok(prompt, return_tensors="pt")
            gen = model.generate(**ids, do_sample=False, max_new_tokens=max_new_tokens,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
            outs.append(gen[0, ids["input_ids"].shape[1] :].tolist())
    return outs


def make_llm(path: str | Path, kv_cache_gib: float = 1.0, seed: int = 0, max_model_len: int | None = None):
    """An in-process vLLM engine that works on the CPU backend (see docs/design.md)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))  # else vLLM drops torch to 1 thread
    from vllm import LLM

    kwargs = {}
    if not torch.cuda.is_available():
        kwargs["kv_cache_memory_bytes"] = int(kv_cache_gib * 2**30)
    # No chunked prefill: on the CPU backend a seeded request whose prompt is split across two
    # engine steps crashes vLLM 0.32 ("CPU Generator does not use offset", gpu_model_runner.py).
    return LLM(model=str(path), dtype="float32", seed=seed, max_model_len=max_model_len, enforce_eager=True,
               enable_chunked_prefill=False, **kwargs)


def vllm_eval(llm, problems, *, n: int, max_new_tokens: int, seed: int = 0) -> dict:
    """Held-out pass@1 from a vLLM engine: sampled (n per prompt, T=1) and greedy, per tier."""
    from vllm import SamplingParams

    prompts = [render_plain(p.question) for p in problems]
    sampled_params = [SamplingParams(n=n, temperature=1.0, top_p=1.0, max_tokens=max_new_tokens, seed=seed + i)
                      for i in range(len(prompts))]
    sampled = llm.generate(prompts, sampled_params, use_tqdm=False)
    greedy = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_new_tokens), use_tqdm=False)
    rows = []
    for p, s, g in zip(problems, sampled, greedy, strict=True):
        ok = is_correct([c.text for c in s.outputs], [p] * n)
        rows.append({
            "tier": p.tier, "sampled": sum(ok) / n, "greedy": float(is_correct([g.outputs[0].text], [p])[0]),
            "group": "all_right" if all(ok) else "all_wrong" if not any(ok) else "mixed",
            "truncated": sum(c.finish_reason == "length" for c in s.outputs) / n,
            "well_formed": sum(is_well_formed([c.text for c in s.outputs], [p] * n)) / n,
            "greedy_well_formed": float(is_well_formed([g.outputs[0].text], [p])[0]),
            "tokens": sum(len(c.token_ids) for c in s.outputs) / n,
        })

    def summary(rs):
        k = len(rs)
        return {"n": k, "sampled": sum(r["sampled"] for r in rs) / k, "greedy": sum(r["greedy"] for r in rs) / k,
                **{g: sum(r["group"] == g for r in rs) / k for g in ("all_wrong", "mixed", "all_right")},
                "truncated": sum(r["truncated"] for r in rs) / k, "well_formed": sum(r["well_formed"] for r in rs) / k,
                "greedy_well_formed": sum(r["greedy_well_formed"] for r in rs) / k,
                "mean_tokens": sum(r["tokens"] for r in rs) / k}

    result = {"overall": summary(rows)}
    for tier in sorted({r["tier"] for r in rows}):
        result[f"tier{tier}"] = summary([r for r in rows if r["tier"] == tier])
    return result


def tool_eval(out: Path, args) -> dict:
    """Held-out pass@1 of the model on disk with the recipe's tools, by `grpo eval` itself (8 samples a
    problem at T=1, and greedy): how often it calls the tool, and how often it is right when it does."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "grpo_cli", "eval", f"checkpoint={out}", f"recipe={args.recipe}",
               "eval.samples_per_problem=8", "eval.greedy=true", f"eval.num_problems={args.num_heldout}",
               f"out={tmp}/eval.json"]
        t = time.time()
        subprocess.run(cmd, check=True, cwd=ROOT)
        metrics = json.loads(Path(tmp, "eval.json").read_text())
    keys = ("pass@1", "greedy_accuracy", "tools/call_share", "greedy_call_share", "tools/pass@1_calling",
            "tools/pass@1_not_calling", "truncation_rate", "mean_length")
    result = {k: metrics[k] for k in keys if k in metrics}
    result["per_tier"] = {tier: {k: m[k] for k in ("pass@1", "greedy_accuracy")} for tier, m in metrics["per_tier"].items()}
    print(f"grpo eval with the tools of recipe={args.recipe} took {time.time() - t:.0f}s:", flush=True)
    for k, v in result.items():
        print(f"  {k}: {v}", flush=True)
    return result


def measure(out: Path, tokenizer, train_set, heldout, args) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    texts = [render_plain(p.question) + " " + p.solution for p in train_set[:2000]]
    texts += ["$48.60 is 10% off\n\n  two  spaces, tabs\tand 1,250.50", " Answer: 0.05\n", "a\nb\r\nc  d   e"]
    tokenizer_round_trip(out, tokenizer, texts)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    n_params = sum(p.numel() for p in model.parameters())
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"transformers load OK: {type(model).__name__}, {n_params:,} parameters; directory {size / 2**20:.2f} MiB",
          flush=True)
    probe = [render_plain(p.question) for p in heldout[:6]]
    hf_ids = hf_greedy_from_disk(out, probe, args.max_new_tokens)

    t = time.time()
    llm = make_llm(out, seed=args.seed)
    from vllm import SamplingParams

    vl = llm.generate(probe, SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens), use_tqdm=False)
    eos = AutoTokenizer.from_pretrained(out).eos_token_id
    agree = sum([x for x in hf_ids[i] if x != eos] == [x for x in o.outputs[0].token_ids if x != eos]
                for i, o in enumerate(vl))
    print(f"greedy transformers vs vLLM: {agree}/{len(probe)} identical", flush=True)
    for i, o in enumerate(vl):
        assert o.outputs[0].text == tokenizer.decode(list(o.outputs[0].token_ids), skip_special_tokens=True), \
            "vLLM's detokenized text differs from the tokenizer's decode"
        if i == 0:
            print("example greedy completion:\n" + probe[0] + o.outputs[0].text, flush=True)
    if args.recipe:
        del llm
        return {"hf_vllm_greedy_agree": f"{agree}/{len(probe)}", "parameters": n_params, "dir_bytes": size,
                **tool_eval(out, args)}
    result = vllm_eval(llm, heldout, n=8, max_new_tokens=args.max_new_tokens, seed=args.seed)
    print(f"vLLM held-out measurement took {time.time() - t:.0f}s (max_new_tokens={args.max_new_tokens})")
    for name, r in result.items():
        print(f"  {name:8s} n={r['n']:3d}  sampled pass@1 {r['sampled']:.3f}  greedy {r['greedy']:.3f}  "
              f"groups all-wrong {r['all_wrong']:.2f} mixed {r['mixed']:.2f} all-right {r['all_right']:.2f}  "
              f"truncated {r['truncated']:.3f}  well-formed {r['well_formed']:.3f} (greedy {r['greedy_well_formed']:.2f})  "
              f"tokens {r['mean_tokens']:.1f}")
    return {"hf_vllm_greedy_agree": f"{agree}/{len(probe)}", "parameters": n_params, "dir_bytes": size, **result}


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    t_start = time.time()
    out = Path(args.out)
    gen = importlib.import_module(args.generator)
    global CHECK_REWARDS
    CHECK_REWARDS = getattr(gen, "CHECK_REWARDS", CHECK_REWARDS)
    train_all, heldout = gen.splits(args.num_train, args.num_heldout, args.data_seed)
    train_set, dev_set = train_all[: -args.dev], train_all[-args.dev :]
    print(f"data: {len(train_set)} train, {len(dev_set)} dev (from train), {len(heldout)} held-out", flush=True)
    if args.measure_only:
        from transformers import PreTrainedTokenizerFast

        # The reference is tokenizer.json exactly as written, not what a loader makes of it.
        reference = PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer.json"), eos_token=EOS, pad_token=PAD)
        measure(out, reference, train_all, heldout, args)
        return
    tool_segments = None
    if args.tool_share > 0:
        tool_segments = getattr(gen, "tool_segments", None)
        if tool_segments is None:
            sys.exit(f"--tool-share: {args.generator} has no tool_segments(problem) to write a solution with the tool")
    tokenizer = build_tokenizer(training_texts(train_set, tool_segments), args.vocab_size)
    print(f"tokenizer: byte-level BPE, {len(tokenizer)} tokens", flush=True)
    model, info = train(args, tokenizer, train_set, dev_set, tool_segments)
    save(model, tokenizer, out)
    print(f"saved to {out}  (build {time.time() - t_start:.0f}s)", flush=True)
    if not args.skip_measure:
        info["heldout"] = measure(out, tokenizer, train_all, heldout, args)
    info["total_seconds"] = round(time.time() - t_start, 1)
    print(json.dumps({k: v for k, v in info.items() if k != "curve"}, indent=1, default=str))


if __name__ == "__main__":
    main()
