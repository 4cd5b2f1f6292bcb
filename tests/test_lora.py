"""LoRA (docs/lora.md): the settings checked before any model loads, only the adapters training, the
reference as the policy with its adapters off, the push (merged into an engine without LoRA in this
process; as a vLLM LoRA request in a subprocess), adapter checkpoints that plain transformers + peft and
vLLM load, `grpo merge`, and `grpo eval` on adapter checkpoints. The 2-rank LoRA update is in
tests/test_distributed.py, SIGKILL + resume in tests/test_resume.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def test_bad_lora_settings_name_their_key_before_any_model_loads(cli, monkeypatch):
    import grpo_cli.step.setup  # imported here first, it would bind the stand-in below for the rest of the session
    import grpo_cli.weights.checkpoint

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded before the settings were checked")

    monkeypatch.setattr(grpo_cli.weights.checkpoint, "load_policy", no_model)
    monkeypatch.setattr(grpo_cli.step.setup, "load_policy", no_model)  # where the run calls it
    for args, message in [
        (["model.lora.rank=0"], "model.lora.rank: is 0; it must be >= 1"),
        (["model.lora.rank=8", "model.lora.alpha=0"], "model.lora.alpha: must be > 0"),
        (["model.lora.rank=8", "model.lora.target_modules=[]"], "model.lora.target_modules: is empty"),
        (["model.lora.rank=8", "model.lora.target_modules=[q_proj,qkv_proj]"],
         "model.lora.target_modules: qkv_proj match no module of Qwen2ForCausalLM; its layers' linear modules are "
         "down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj"),
        (["model.lora.rank=1024"], "model.lora.rank: 1024 is above vLLM's largest LoRA rank, 512"),
    ]:
        result = cli("train", "recipe=bike_pricing", *args)
        assert result.returncode == 2, (args, result.stdout[-500:])
        assert message in result.stderr, (args, result.stderr)


def lora_state(model_dir: Path, rank: int = 4):
    """A RunState for the update on `model_dir` with LoRA adapters (seeded A; B = 0) and no reference model, the
    config it runs with (kl_coef 0.1, 2 optimizer steps per batch) and a batch of the shipped tokenizer's ids."""
    from grpo_cli.config import LoraConfig, ModelConfig, RewardSpec, RolloutConfig, TrainConfig, TrainerConfig
    from grpo_cli.dist import Dist
    from grpo_cli.step.state import RunState
    from grpo_cli.weights.checkpoint import load_policy
    from grpo_cli.weights.lora import with_adapters

    lora = LoraConfig(rank=rank, alpha=2 * rank)
    cfg = TrainConfig(task="t", rewards=[RewardSpec(name="correct")], model=ModelConfig(lora=lora),
                      rollout=RolloutConfig(prompts_per_step=3, group_size=4),
                      trainer=TrainerConfig(lr=1e-2, kl_coef=0.1, minibatches=2))
    torch.manual_seed(0)
    policy = with_adapters(load_policy(str(model_dir), "float32"), lora, str(model_dir)).train()
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: 1.0)
    state = RunState(task=None, dist=Dist(), run_dir=None, start=None, policy=policy, reference=None, engine=None,
                     optimizer=optimizer, scheduler=scheduler, pool=None, heldout=None)
    return state, cfg


def one_step(state, cfg, seed: int):
    """fill_logprobs + update on a random [3, 4] batch; the batch (its micro-batches hold the reference logprobs)."""
    from grpo_cli.engines.base import Rollouts
    from grpo_cli.rewards import RewardFailures, Scores
    from grpo_cli.step.batch import TrainBatch
    from grpo_cli.step.collect import Groups
    from grpo_cli.step.update import fill_logprobs, loss_params, update

    g = torch.Generator().manual_seed(seed)
    P, G = 3, 4
    prompts = [torch.randint(3, 500, (5 + p,), generator=g).tolist() for p in range(P)]
    completions = [[torch.randint(3, 500, (3 + (p + i) % 4,), generator=g).tolist() for i in range(G)] for p in range(P)]
    rollouts = Rollouts(prompts, completions, [[[-3.0] * len(c) for c in grp] for grp in completions],
                        [["x"] * G] * P, [[False] * G] * P)
    none = torch.zeros(P, dtype=torch.bool)
    groups = Groups([{}] * P, prompts, rollouts, Scores([0.0] * 12, {"correct": [0.0] * 12}, [False] * 12),
                    RewardFailures(), torch.zeros(P, G), torch.randn(P, G, generator=g), none, none,
                    torch.ones(P, dtype=torch.bool), dropped=torch.zeros(P, G, dtype=torch.bool))
    params = loss_params(cfg)
    batch = TrainBatch.build(groups, 0, cfg.trainer, state.dist, params)
    fill_logprobs(state, batch, groups, cfg)
    update(state, batch, params, cfg)
    return batch


def test_only_the_adapters_train_and_the_reference_is_the_base_model_exactly(shipped_model_dir):
    """Three updates on the shipped model: every base weight bit-identical to the file's, the adapters moved,
    and the reference logprobs (the policy with its adapters off) equal to the plain base model's, bit for bit,
    while the policy's own differ."""
    from grpo_cli.algorithm import passes
    from grpo_cli.step.update import batch_logprobs
    from grpo_cli.weights.checkpoint import checkpoint_weights, load_policy

    state, cfg = lora_state(shipped_model_dir)
    for seed in range(3):
        batch = one_step(state, cfg, seed)
    base = checkpoint_weights(shipped_model_dir)
    trained = {k.removeprefix("base_model.model.").replace(".base_layer.", "."): v
               for k, v in state.policy.state_dict().items() if ".lora_" not in k}
    assert trained.keys() == base.keys()
    assert all(torch.equal(trained[k], base[k]) for k in base)
    lora_b = [v for k, v in state.policy.state_dict().items() if ".lora_B." in k]
    assert lora_b and min(float(v.abs().max()) for v in lora_b) > 1e-3  # every adapter moved off zero

    batch = one_step(state, cfg, seed=3)  # the reference pass of a step whose adapters are far from zero
    plain = load_policy(str(shipped_model_dir), "float32").eval()
    expected = batch_logprobs(plain, batch, cfg.trainer.logprob_chunk_tokens, cfg.rollout.temperature)
    for mb, ref in zip(batch.micro_batches, expected):
        assert torch.equal(mb.ref_logprobs, ref)
    with torch.no_grad():
        ids = torch.tensor([batch.prompt_tokens[0] + batch.completions[0]])
        policy_lp = passes.token_logprobs(state.policy, ids, torch.ones_like(ids))
        base_lp = passes.token_logprobs(plain, ids, torch.ones_like(ids))
    assert float((policy_lp - base_lp).abs().max()) > 1e-3  # with its adapters on, the policy is not the base


def test_the_merged_push_and_the_adapter_files_give_the_policy_s_logprobs(shipped_model_dir, tmp_path):
    """After two updates: the merged tensors (W + alpha/r B A) in a plain model, the adapter saved by a checkpoint
    loaded with transformers + peft, and the files merged without any model (`grpo merge`'s path) all give
    the policy's logprobs."""
    from peft import PeftModel, get_peft_model_state_dict

    from grpo_cli.algorithm import passes
    from grpo_cli.weights.checkpoint import is_adapter_dir, load_policy, load_tokenizer, save_checkpoint
    from grpo_cli.weights.lora import adapter_tensors, merged_checkpoint_tensors, merged_tensors

    state, cfg = lora_state(shipped_model_dir, rank=8)
    for seed in range(2):
        batch = one_step(state, cfg, seed)
    ids = torch.tensor([batch.prompt_tokens[1] + batch.completions[4]])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        want = passes.token_logprobs(state.policy.eval(), ids, mask)

    pushed, saved = adapter_tensors(state.policy), get_peft_model_state_dict(state.policy)  # the push's names are peft's
    assert pushed.keys() == saved.keys() and all(torch.equal(pushed[k], saved[k]) for k in saved)
    merged = load_policy(str(shipped_model_dir), "float32").eval()
    merged.load_state_dict(dict(merged_tensors(state.policy)))
    ckpt = save_checkpoint(state.policy, load_tokenizer(str(shipped_model_dir)), tmp_path / "ckpt", {"step": 2})
    assert is_adapter_dir(ckpt) and not (ckpt / "model.safetensors").exists()  # the adapters alone
    loaded = PeftModel.from_pretrained(load_policy(str(shipped_model_dir), "float32"), str(ckpt)).eval()
    from_files = load_policy(str(shipped_model_dir), "float32").eval()
    from_files.load_state_dict(dict(merged_checkpoint_tensors(shipped_model_dir, ckpt)))
    with torch.no_grad():
        for model in (merged, loaded, from_files):
            got = passes.token_logprobs(model, ids, mask)
            assert float((got - want).abs().max()) < 1e-5


def test_grpo_merge_writes_a_whole_model_and_names_what_is_wrong(cli, shipped_model_dir, tmp_path):
    from grpo_cli.algorithm import passes
    from grpo_cli.weights.checkpoint import checkpoint_info, load_policy, load_tokenizer, save_checkpoint

    state, cfg = lora_state(shipped_model_dir)
    one_step(state, cfg, seed=0)
    info = checkpoint_info(1, cfg, str(shipped_model_dir), None, 1)
    ckpt = save_checkpoint(state.policy, load_tokenizer(str(shipped_model_dir)), tmp_path / "ckpt", info)
    out = tmp_path / "merged"
    result = cli("merge", f"checkpoint={ckpt}", f"out={out}")
    assert result.returncode == 0, result.stderr
    merged = load_policy(str(out), "float32").eval()  # config.json, model.safetensors, tokenizer: a plain model
    ids = torch.tensor([load_tokenizer(str(out))("3 days of e-bike at 18 per day")["input_ids"]])
    with torch.no_grad():
        got = passes.token_logprobs(merged, ids, torch.ones_like(ids))
        want = passes.token_logprobs(state.policy.eval(), ids, torch.ones_like(ids))
    assert float((got - want).abs().max()) < 1e-5
    again = cli("merge", f"checkpoint={ckpt}", f"out={out}")
    assert again.returncode == 2 and f"out={out} exists" in again.stderr
    whole = cli("merge", f"checkpoint={shipped_model_dir}", f"out={tmp_path / 'x'}")
    assert whole.returncode == 2 and "not a LoRA checkpoint" in whole.stderr


def test_a_lora_run_pushes_merged_weights_into_an_engine_without_lora_and_its_checkpoints_evaluate(
        vllm_engine, shipped_weights, tmp_path, cli, capsys):
    """`grpo train ... model.lora.rank=16` on the session's engine, which was started without LoRA: the merged
    weights go in at every step, the push check (every step) holds, and the run's adapter checkpoints evaluate
    with `grpo eval` (on an engine serving LoRA: in a subprocess, since a second engine cannot live here)."""
    from conftest import TRAINED_RUN_OVERRIDES

    from grpo_cli import train
    from grpo_cli.cli import load_config

    cfg = load_config("train", TRAINED_RUN_OVERRIDES + ["model.lora.rank=16", "trainer.lr=1e-2", f"output_dir={tmp_path}"])
    run_dir = tmp_path / "run"
    try:
        assert train.run(cfg, run_dir, engine=vllm_engine) == 0
    finally:
        vllm_engine.push_weights(shipped_weights.items())
    out = capsys.readouterr().out
    assert "LoRA rank 16 (alpha 32) on q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj" in out
    assert "push: the base weights with the adapters merged in (rollout.lora_push; vLLM's LoRA is off)" in out
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    checks = [m["push_check/max_abs_diff"] for m in logged if "push_check/max_abs_diff" in m]
    assert len(checks) == 4 and max(checks) < cfg.rollout.push_check_tol
    assert (run_dir / "checkpoints" / "final" / "adapter_model.safetensors").is_file()


def test_vllm_serves_the_pushed_adapters_and_evaluates_adapter_checkpoints(tmp_path):
    """A real LoRA engine, in subprocesses (one vLLM engine per process): `grpo train ... model.lora.rank=16`
    pushes the adapters alone as vLLM LoRA requests and its push check (every step, the engine with the adapter
    applied against the trainer) holds after each of 3 steps; then `grpo eval checkpoints=[base,latest]` serves the
    run's adapter checkpoint on the base model."""
    from conftest import TRAINED_RUN_OVERRIDES

    overrides = [o for o in TRAINED_RUN_OVERRIDES if not o.startswith(("trainer.steps", "eval.every", "trainer.lr"))]
    train = subprocess.run([sys.executable, "-m", "grpo_cli", "train", *overrides, "trainer.steps=3", "eval.every=0",
                            "model.lora.rank=16", "trainer.lr=1e-2", "rollout.lora_push=adapter", "rollout.enforce_eager=true",
                            f"output_dir={tmp_path}"],
                           capture_output=True, text=True, timeout=600, cwd=REPO)
    assert train.returncode == 0, train.stderr[-3000:]
    assert "push: the adapters alone, as a vLLM LoRA request" in train.stdout
    run_dir = next((tmp_path / "bike_pricing").iterdir())
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    checks = [m["push_check/max_abs_diff"] for m in logged if "push_check/max_abs_diff" in m]
    assert len(checks) == 3 and max(checks) < 1e-3  # rollout.push_check_tol of the fp32 recipe
    assert [m["time/push"] for m in logged if "time/push" in m]

    evaluated = subprocess.run([sys.executable, "-m", "grpo_cli", "eval", "checkpoints=[base,latest]", f"run={run_dir}",
                                "eval.num_problems=16", "rollout.lora_push=adapter", "rollout.enforce_eager=true", f"out={tmp_path / 'eval.json'}"],
                               capture_output=True, text=True, timeout=600, cwd=REPO)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    rows = json.loads((tmp_path / "eval.json").read_text())["checkpoints"]
    assert [Path(r["checkpoint"]).name for r in rows] == ["bike_base", "final"]  # latest: the final checkpoint
    assert all(0 <= r["pass@1"] <= 1 for r in rows)


# In its own process (one vLLM engine a process): a LoRA engine takes an adapter push; an update the engine
# did not get is seen by the exact check and the logprob check, and the next push clears both.
STALE_ADAPTER = r"""
import sys, torch
from grpo_cli.weights.checkpoint import load_policy, resolve_model_path
from grpo_cli.config import LoraConfig, ModelConfig, RolloutConfig
from grpo_cli.weights.lora import with_adapters
from grpo_cli.engines.vllm import VLLMEngine
from grpo_cli.step.sync import exact_push_check, push, push_check

path = resolve_model_path("builtin:bike_base")
lora = LoraConfig(rank=8)
engine = VLLMEngine(path, ModelConfig(lora=lora), RolloutConfig(lora_push="adapter", enforce_eager=True), seed=0)
torch.manual_seed(0)
policy = with_adapters(load_policy(path, "float32"), lora, path).eval()
seq = [[5, 17, 40, 41, 80, 90, 33, 21, 7, 9]]
with torch.no_grad():
    for name, p in policy.named_parameters():
        if ".lora_B." in name:
            p.normal_(std=0.05)
push(engine, policy)
fresh = (exact_push_check(engine, policy), push_check(engine, policy, seq, [3]))
with torch.no_grad():
    for name, p in policy.named_parameters():
        if ".lora_B." in name:
            p.mul_(1.5)  # an update the engine did not receive
stale = (exact_push_check(engine, policy), push_check(engine, policy, seq, [3]))
push(engine, policy)
again = (exact_push_check(engine, policy), push_check(engine, policy, seq, [3]))
print("RESULT", fresh, stale, again)
"""


def test_the_exact_push_check_sees_an_adapter_the_engine_did_not_get():
    done = subprocess.run([sys.executable, "-c", STALE_ADAPTER], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(ln for ln in done.stdout.splitlines() if ln.startswith("RESULT"))
    fresh, stale, again = eval(line[len("RESULT"):].replace(") (", "), ("))  # three ((differ, compared), diff)
    (differ, compared), diff = fresh
    assert differ == 0 and compared > 0 and diff < 1e-3
    (differ, compared), diff = stale
    assert differ > 0 and diff > 1e-3  # both checks see it
    (differ, _), diff = again
    assert differ == 0 and diff < 1e-3
