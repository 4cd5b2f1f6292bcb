"""The GPU check: the trainer's update stage on CUDA for a ~0.5B Qwen2-shaped model built from a config.

    python scripts/gpu_check.py                  # on a CUDA machine: under 5 minutes on one GPU
    python scripts/gpu_check.py --out gpu.json   # also every number as JSON
    python scripts/gpu_check.py --cpu-smoke      # the same code on a tiny model on the CPU (tests run this)

Needs only torch and transformers (no vLLM, hydra, wandb, datasets or network): it imports
`grpo_cli.algorithm.grpo` and `grpo_cli.algorithm.passes` from this checkout, which need nothing else. Measures, on one device:

- bf16 numerics: the sampled tokens' logprobs under bf16 autocast (fp32 master weights) against
  fp32, same weights and batch;
- the update: each prompt once (`prompt_states`), the completions' chunked logprobs per
  micro-batch, GRPO's loss, backward, AdamW, bf16 autocast: tokens/s, model FLOP utilisation
  (6 x parameters x the tokens the model runs, each prompt once / time / the GPU's dense bf16 peak),
  peak memory;
- the weight gather a push makes: every state-dict tensor read and copied into a bf16 engine-side
  tensor, one at a time;
- the same update and gather at world size 1 with FSDP2 (`fully_shard` per decoder layer and on
  the model, bf16 parameters, fp32 gradient reduction), whole sequences per micro-batch.

Without CUDA (and without --cpu-smoke) it prints its skip line and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # grpo_cli from this checkout, not installed

# Qwen2.5-0.5B's shape (no download: the weights are random, the cost is the same).
QWEN_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True)
TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=256, tie_word_embeddings=True)
# Dense bf16 peak per GPU from the vendors' data sheets, matched against torch.cuda.get_device_name() in this order:
# the PCIe and NVL parts run at lower clocks and power than the SXM ones the bare names report.
PEAK_BF16_FLOPS = (
    (("H100", "PCIe"), 756e12), (("H100", "NVL"), 835e12), (("H200", "NVL"), 835e12),
    (("H100",), 989e12), (("H200",), 989e12), (("A100",), 312e12),
)


def peak_flops(device_name: str) -> float | None:
    """The dense bf16 peak of the GPU named `device_name`; None when the table does not know it."""
    return next((peak for parts, peak in PEAK_BF16_FLOPS if all(p in device_name for p in parts)), None)


def workload(full: bool) -> dict[str, int]:
    """P prompts x G completions, as a GRPO step on a 0.5B model would have them."""
    if full:
        return dict(P=8, G=8, prompt_len=128, completion_len=256, micro_batch=16, chunk=4096, repeats=5)
    return dict(P=2, G=4, prompt_len=6, completion_len=10, micro_batch=3, chunk=16, repeats=2)


def build_model(shape: dict[str, Any], device: Any) -> Any:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**shape)).to(device)  # fp32 master weights
    model.config.use_cache = False
    return model.train()


def make_batch(w: dict[str, int], vocab: int, device: Any) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(1)
    P, G = w["P"], w["G"]
    prompt_ids = torch.randint(1, vocab, (P, w["prompt_len"]), generator=g)  # [P, Tp]
    lengths = torch.randint(w["completion_len"] // 2, w["completion_len"] + 1, (P * G,), generator=g)  # [P*G]
    completion_ids = torch.randint(1, vocab, (P * G, w["completion_len"]), generator=g)  # [P*G, Tc]
    completion_mask = (torch.arange(w["completion_len"])[None] < lengths[:, None]).float()  # [P*G, Tc]
    return {"prompt_ids": prompt_ids.to(device), "prompt_mask": torch.ones(P, w["prompt_len"], device=device),
            "completion_ids": completion_ids.to(device), "completion_mask": completion_mask.to(device),
            "prompt_index": torch.arange(P).repeat_interleave(G).to(device),  # [P*G]
            "advantages": torch.randn(P * G, generator=g).to(device)}  # [P*G]


def autocast(device: Any, on: bool) -> Any:
    import contextlib

    import torch

    return torch.autocast(device.type, dtype=torch.bfloat16) if on else contextlib.nullcontext()


def sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def bf16_numerics(model: Any, batch: dict[str, Any], w: dict[str, int], device: Any) -> dict[str, float]:
    """The same weights' logprobs of the sampled tokens with bf16 autocast vs fp32."""
    import torch

    from grpo_cli.algorithm import passes

    out = {}
    with torch.no_grad():
        for name, on in (("fp32", False), ("bf16", True)):
            with autocast(device, on):
                prompts = passes.prompt_states(model, batch["prompt_ids"], batch["prompt_mask"])
                out[name] = passes.completion_logprobs(model, prompts, batch["prompt_index"], batch["completion_ids"],
                                                     batch["completion_mask"], w["chunk"])  # [P*G, Tc]
    mask = batch["completion_mask"].bool()
    diff = (out["bf16"] - out["fp32"]).abs()[mask]
    return {"logprob_max_abs_diff": float(diff.max()), "logprob_mean_abs_diff": float(diff.mean()),
            "logprob_dtype": str(out["bf16"].dtype)}


def update_step(model: Any, optimizer: Any, batch: dict[str, Any], w: dict[str, int], device: Any) -> float:
    """One GRPO update as the trainer runs it: prompts once, micro-batches, one backward through the prompts."""
    import torch

    from grpo_cli.algorithm import grpo, passes

    optimizer.zero_grad(set_to_none=True)
    mask = batch["completion_mask"]
    normalizer = grpo.NORMALIZERS["grpo"](mask, grpo.DEFAULT_PARAMS)
    with autocast(device, True):
        prompts = passes.prompt_states(model, batch["prompt_ids"], batch["prompt_mask"])
    leaves = passes.prompt_leaves(prompts)
    total = 0.0
    for start in range(0, mask.shape[0], w["micro_batch"]):
        rows = slice(start, start + w["micro_batch"])
        with autocast(device, True):
            logp = passes.completion_logprobs(model, leaves, batch["prompt_index"][rows], batch["completion_ids"][rows],
                                            mask[rows], w["chunk"])  # [b, Tc] float32
        loss, _ = grpo.grpo_loss(grpo.LossInputs(logp, mask[rows], batch["advantages"][rows], normalizer=normalizer))
        loss.backward()
        total += float(loss.detach())
    passes.prompt_backward(prompts, leaves)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return total


def fsdp_step(model: Any, optimizer: Any, batch: dict[str, Any], w: dict[str, int], device: Any) -> float:
    """One update under FSDP2: whole sequences (prompt + completion) per micro-batch through the root
    module, so FSDP's hooks gather and reduce every parameter; logprobs chunked from the last hidden state."""
    import torch

    from grpo_cli.algorithm import grpo, passes

    optimizer.zero_grad(set_to_none=True)
    mask = batch["completion_mask"]
    normalizer = grpo.NORMALIZERS["grpo"](mask, grpo.DEFAULT_PARAMS)
    prompts = batch["prompt_ids"][batch["prompt_index"]]  # [P*G, Tp]
    ids = torch.cat([prompts, batch["completion_ids"]], dim=1)  # [P*G, Tp + Tc]
    attn = torch.cat([torch.ones_like(prompts, dtype=mask.dtype), mask], dim=1)  # [P*G, Tp + Tc]
    Tp, total = prompts.shape[1], 0.0
    starts = list(range(0, ids.shape[0], w["micro_batch"]))
    for i, start in enumerate(starts):
        rows = slice(start, start + w["micro_batch"])
        model.set_requires_gradient_sync(i == len(starts) - 1)  # reduce once, after the last micro-batch
        hidden = model(input_ids=ids[rows], attention_mask=attn[rows], output_hidden_states=True,
                       logits_to_keep=1).hidden_states[-1]  # [b, T, H] after the final norm
        head = model.get_output_embeddings().weight
        weight = head.full_tensor() if hasattr(head, "full_tensor") else head
        logp = passes.logprobs_from_hidden(hidden[:, Tp - 1:-1], weight, ids[rows, Tp:],
                                         chunk_tokens=w["chunk"])  # [b, Tc]
        loss, _ = grpo.grpo_loss(grpo.LossInputs(logp, mask[rows], batch["advantages"][rows], normalizer=normalizer))
        loss.backward()
        total += float(loss.detach())
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return total


def computed_tokens(step: Any, batch: dict[str, Any], w: dict[str, int]) -> int:
    """The tokens `step` runs through the model: the completions' own, and each prompt once (the trainer's
    update, `prompt_states`) or once per sample (FSDP2's whole sequences). Model FLOPs are 6 x parameters x
    these, so counting a prompt G times where the update runs it once would inflate the MFU."""
    completion = int(batch["completion_mask"].sum())
    prompt_runs = w["G"] if step is fsdp_step else 1
    return completion + batch["prompt_ids"].numel() * prompt_runs


def timed_updates(step: Any, model: Any, batch: dict[str, Any], w: dict[str, int], device: Any,
                  params: int) -> dict[str, float]:
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    step(model, optimizer, batch, w, device)  # warm-up: kernels, allocator, optimizer state
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(w["repeats"]):
        tick = time.perf_counter()
        step(model, optimizer, batch, w, device)
        sync(device)
        times.append(time.perf_counter() - tick)
    seconds = sorted(times)[len(times) // 2]
    tokens = int(batch["completion_mask"].sum()) + batch["prompt_ids"].numel() * w["G"]  # whole samples trained on
    computed = computed_tokens(step, batch, w)
    out = {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds, "computed_tokens": computed,
           "model_tflops_per_s": 6 * params * computed / seconds / 1e12}
    if device.type == "cuda":
        out["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        peak = peak_flops(torch.cuda.get_device_name())
        out["mfu"] = 6 * params * computed / seconds / peak if peak else None
    return out


def timed_gather(model: Any, device: Any) -> dict[str, float]:
    """What a weight push does: every state-dict tensor, full (DTensors gathered), one at a time, copied into
    an engine-side tensor of the engine's dtype (bf16) allocated beforehand, as vLLM's reload copies into its
    own parameters. (Reading a tensor that is already contiguous copies nothing, so it would time nothing.)"""
    import torch

    engine = {name: torch.empty(tuple(t.shape), dtype=torch.bfloat16, device=device)
              for name, t in model.state_dict().items()}
    sync(device)
    tick = time.perf_counter()
    total = 0
    for name, tensor in model.state_dict().items():
        full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        engine[name].copy_(full.detach())  # the cast and the copy a push makes
        total += full.numel() * full.element_size()
        del full
    sync(device)
    seconds = time.perf_counter() - tick
    checked = next(iter(engine))  # the copy happened: the engine's tensor holds the trainer's values
    source = model.state_dict()[checked]
    source = source.full_tensor() if hasattr(source, "full_tensor") else source
    assert torch.equal(engine[checked], source.detach().to(torch.bfloat16)), "the gather copied nothing"
    return {"seconds": seconds, "gib": total / 2**30, "gib_per_s": total / 2**30 / max(seconds, 1e-9)}


def fsdp_world_of_one(shape: dict[str, Any], batch: dict[str, Any], w: dict[str, int], device: Any,
                      params: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    model = build_model(shape, device)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    result = {"update": timed_updates(fsdp_step, model, batch, w, device, params),
              "gather": timed_gather(model, device)}
    dist.barrier()  # end with a barrier, not destroy_process_group (docs/design.md: it aborted both ranks)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="JSON file for every number")
    parser.add_argument("--cpu-smoke", action="store_true", help="run the same code on a tiny model on the CPU")
    args = parser.parse_args(argv)
    import torch

    if not args.cpu_smoke and not torch.cuda.is_available():
        print("gpu_check: skipped: no CUDA device (torch.cuda.is_available() is False); nothing measured")
        return 0
    device = torch.device("cpu" if args.cpu_smoke else "cuda:0")
    shape, w = (TINY, workload(False)) if args.cpu_smoke else (QWEN_05B, workload(True))
    started = time.time()
    model = build_model(shape, device)
    params = sum(p.numel() for p in model.parameters())
    batch = make_batch(w, shape["vocab_size"], device)
    report: dict[str, Any] = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                              "torch": torch.__version__, "params": params, "workload": w}
    report["bf16"] = bf16_numerics(model, batch, w, device)
    report["update"] = timed_updates(update_step, model, batch, w, device, params)
    report["gather"] = timed_gather(model, device)
    del model
    report["fsdp2_world_1"] = fsdp_world_of_one(shape, batch, w, device, params)
    report["wall_s"] = time.time() - started
    for line in summary(report):
        print(line)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    return 0


def summary(r: dict[str, Any]) -> list[str]:
    def upd(u: dict[str, Any]) -> str:
        mfu = f", MFU {u['mfu']:.1%}" if u.get("mfu") else ""
        mem = f", peak {u['peak_memory_gib']:.1f} GiB" if "peak_memory_gib" in u else ""
        return (f"{u['tokens_per_s']:,.0f} tokens/s ({u['tokens']} sample tokens in {u['seconds']:.3f} s; "
                f"{u['computed_tokens']} through the model, "
                f"{u['model_tflops_per_s']:.1f} model TFLOP/s{mfu}{mem})")

    f = r["fsdp2_world_1"]
    return [
        f"gpu_check: {r['device']} | torch {r['torch']} | {r['params'] / 1e6:.0f}M parameters | {r['wall_s']:.0f} s",
        f"  bf16 autocast vs fp32 logprobs: max |diff| {r['bf16']['logprob_max_abs_diff']:.3g}, "
        f"mean {r['bf16']['logprob_mean_abs_diff']:.3g} ({r['bf16']['logprob_dtype']})",
        f"  update (prompt once, bf16 autocast, fp32 master + AdamW): {upd(r['update'])}",
        f"  weight gather (copied into bf16): {r['gather']['gib']:.2f} GiB in {r['gather']['seconds']:.3f} s",
        f"  FSDP2 world 1 update (whole sequences, bf16 params, fp32 reduce): {upd(f['update'])}",
        f"  FSDP2 world 1 gather (full_tensor per tensor): {f['gather']['gib']:.2f} GiB in {f['gather']['seconds']:.3f} s",
    ]


if __name__ == "__main__":
    sys.exit(main())
