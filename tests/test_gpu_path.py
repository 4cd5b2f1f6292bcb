"""The GPU path where it can be tested without a GPU: vLLM's sleep/wake order in the real loop
(a recording engine stands in for sleep mode, which needs CUDA), the device and dtype seam, the
optimizer-state offload, and scripts/gpu_check.py (its skip line here; the CPU smoke run of the
same code). Tests that need CUDA are marked `gpu` and skipped without one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from grpo_cli.engines.base import DelegatingEngine

REPO = Path(__file__).resolve().parents[1]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")



class RecordingEngine(DelegatingEngine):
    """The transformers engine with every call written down, asleep or awake. vLLM's sleep mode needs
    CUDA memory, so its calls are checked here for order: the only stand-in for what cannot run here."""

    def __init__(self, inner):
        super().__init__(inner)
        self.inner, self.calls, self.asleep = inner, [], False

    def generate(self, *args, **kwargs):
        assert not self.asleep, "generate while asleep"
        self.calls.append("generate")
        return self.inner.generate(*args, **kwargs)

    def score(self, sequences):
        assert not self.asleep, "push check while asleep"
        self.calls.append("score")
        return self.inner.score(sequences)

    def push_weights(self, named_tensors):
        self.calls.append("push_weights")
        return self.inner.push_weights(named_tensors)

    def sleep(self):
        self.calls.append("sleep")
        self.asleep = True

    def wake_weights(self):
        self.calls.append("wake_weights")

    def wake_kv_cache(self):
        self.calls.append("wake_kv_cache")
        self.asleep = False


@pytest.mark.slow
def test_the_loop_sleeps_after_generating_and_wakes_weights_then_kv_cache_around_the_push(tmp_path, monkeypatch,
                                                                                         tiny_model_dir):
    from grpo_cli import train
    from grpo_cli.cli import load_config
    from grpo_cli.step import setup

    engines = []
    real_build = setup.build_engine

    def recording_build(*args, **kwargs):
        engines.append(RecordingEngine(real_build(*args, **kwargs)))
        return engines[-1]

    monkeypatch.setattr(setup, "build_engine", recording_build)
    cfg = load_config("train", ["recipe=bike_pricing", f"model.name_or_path={tiny_model_dir}",
                                f"output_dir={tmp_path / 'runs'}", "rollout.engine=hf", "trainer.steps=2",
                                "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=8",
                                "eval.num_problems=2", "eval.every=0", "rollout.push_check_every=1",
                                "trainer.offload_optimizer=true", "data.num_train=50", "data.num_heldout=10"])
    assert train.run(cfg, tmp_path / "run") == 0
    step = ["generate", "sleep", "wake_weights", "push_weights", "wake_kv_cache", "score"]
    assert engines[0].calls == ["generate", *step, *step, "generate"]  # eval, 2 steps, the final eval
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all("time/sleep" in m for m in metrics[1:])  # its own phase of the step split


def test_device_and_dtype_seam_on_the_cpu(monkeypatch):
    from grpo_cli.dist import Dist

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    dist = Dist.init("auto")
    expected = "cuda:0" if torch.cuda.is_available() else "cpu"
    assert str(dist.device) == expected
    cpu = Dist.init("cpu")
    assert cpu.master_dtype("bfloat16") == "bfloat16"  # the CPU keeps today's behaviour: weights in model.dtype
    with cpu.autocast("bfloat16"):
        assert not torch.is_autocast_enabled("cuda")  # no autocast on the CPU path
    assert torch.nn.Linear(2, 2)(torch.ones(1, 2)).dtype == torch.float32


def test_sleep_mode_auto_follows_the_trainer_device_and_the_hf_engine_ignores_it():
    from grpo_cli.config import RolloutConfig
    from grpo_cli.engines.hf import HFEngine
    from grpo_cli.engines.options import sleep_wanted

    assert sleep_wanted(RolloutConfig(sleep_mode="auto"), "cuda:0") is True
    assert sleep_wanted(RolloutConfig(sleep_mode="auto"), torch.device("cpu")) is False
    assert sleep_wanted(RolloutConfig(sleep_mode="off"), "cuda:0") is False
    assert sleep_wanted(RolloutConfig(placement="split"), "cuda:0") is False  # the generator's GPU holds no trainer
    engine = HFEngine(torch.nn.Linear(1, 1), tokenizer=None)
    engine.sleep(), engine.wake_weights(), engine.wake_kv_cache()  # nothing to free: no error, no state


def test_optimizer_state_moves_its_moments_and_keeps_the_step_counter():
    from grpo_cli.step.optim import move_optimizer_state

    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    before = {k: v.clone() for k, v in optimizer.state[model.weight].items()}
    move_optimizer_state(optimizer, "cpu")  # already there: the values stay as they are
    assert all(torch.equal(before[k], v) for k, v in optimizer.state[model.weight].items())
    move_optimizer_state(optimizer, "meta")  # another device (no GPU here): the moments leave...
    state = optimizer.state[model.weight]
    assert state["exp_avg"].device.type == state["exp_avg_sq"].device.type == "meta"
    assert state["step"].device.type == "cpu"  # ...the step counter stays where AdamW keeps it


def test_a_bf16_run_needs_a_push_check_tolerance_above_its_round_off():
    from grpo_cli.cli import UsageError, load_config

    with pytest.raises(UsageError, match="rollout.push_check_tol"):
        load_config("train", ["recipe=bike_pricing", "model.dtype=bfloat16"])
    assert load_config("train", ["recipe=bike_pricing", "model.dtype=bfloat16",
                                 "rollout.push_check_tol=0.05"]).model.dtype == "bfloat16"
    assert load_config("train", ["recipe=bike_pricing_qwen_instruct"]).rollout.push_check_tol >= 0.02


def test_gpu_check_skips_without_cuda_and_its_code_runs_on_a_tiny_cpu_model(tmp_path, capsys):
    import importlib.util

    script = str(REPO / "scripts" / "gpu_check.py")
    if not torch.cuda.is_available():  # the skip line, in this process (the script's main, as `python` runs it)
        spec = importlib.util.spec_from_file_location("gpu_check", script)
        gpu_check = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(gpu_check)
        assert gpu_check.main([]) == 0
        assert capsys.readouterr().out.startswith("gpu_check: skipped: no CUDA device")
    smoke = subprocess.run([sys.executable, script, "--cpu-smoke", "--out", str(tmp_path / "r.json")],
                           capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert smoke.returncode == 0, smoke.stderr[-2000:]
    report = json.loads((tmp_path / "r.json").read_text())
    assert 0 < report["bf16"]["logprob_mean_abs_diff"] < 0.05  # bf16 moves logprobs, a little
    assert report["update"]["tokens_per_s"] > 0 and report["fsdp2_world_1"]["update"]["tokens_per_s"] > 0
    assert report["gather"]["gib"] == pytest.approx(report["fsdp2_world_1"]["gather"]["gib"])  # same full tensors
    w, tokens = report["workload"], report["update"]["tokens"]
    prompt_tokens = w["P"] * w["prompt_len"]
    completion_tokens = tokens - prompt_tokens * w["G"]  # `tokens`: whole samples, each with its prompt
    assert report["update"]["computed_tokens"] == completion_tokens + prompt_tokens  # the update runs a prompt once
    assert report["fsdp2_world_1"]["update"]["computed_tokens"] == tokens  # whole sequences: once per sample


def test_gpu_check_knows_each_hopper_parts_peak():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", str(REPO / "scripts" / "gpu_check.py"))
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    names = {"NVIDIA H100 80GB HBM3": 989e12, "NVIDIA H100 PCIe": 756e12, "NVIDIA H100 NVL": 835e12,
             "NVIDIA H200": 989e12, "NVIDIA H200 NVL": 835e12, "NVIDIA A100-SXM4-80GB": 312e12, "NVIDIA L4": None}
    assert {name: gpu_check.peak_flops(name) for name in names} == names


@pytest.mark.gpu
@needs_cuda
def test_gpu_check_on_cuda(tmp_path):
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_check.py"), "--out", str(tmp_path / "r.json")],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["bf16"]["logprob_mean_abs_diff"] < 0.1 and report["update"]["peak_memory_gib"] > 0


# ---------------------------------------------------------------------------- settings that would break or misplace


def test_an_inherited_multiprocessing_setting_cannot_move_the_engine_out_of_process(monkeypatch):
    from grpo_cli.engines.vllm import in_process_engine_env

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    assert "VLLM_ENABLE_V1_MULTIPROCESSING=1 ignored" in in_process_engine_env()
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING")
    assert in_process_engine_env() is None and os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"


def test_threads_follow_the_cpu_set_not_the_machines_core_count(monkeypatch):
    from grpo_cli.runtime import cpu_threads

    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3}, raising=False)  # a container given one core
    assert cpu_threads(0) == 1 and cpu_threads(0, 2) == 1 and cpu_threads(4) == 4
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    assert cpu_threads(0) == 4 and cpu_threads(0, 2) == 2


def test_fp16_training_is_refused_before_any_model_loads(cli):
    out = cli("train", "recipe=bike_pricing", "model.dtype=float16", "rollout.push_check_tol=0.05")
    assert out.returncode == 2
    assert "model.dtype: float16 training needs loss scaling" in out.stderr and "Use bfloat16" in out.stderr


def test_deterministic_runs_get_the_cublas_workspace_cuda_needs(monkeypatch):
    from grpo_cli.config import TrainerConfig
    from grpo_cli.step.setup import setup_torch

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    threads = torch.get_num_threads()
    try:
        setup_torch(TrainerConfig(deterministic=True, threads=threads))
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(False)
        torch.set_num_threads(threads)


def test_a_second_gpu_for_the_vllm_engine_is_refused_with_the_setting_that_works():
    from grpo_cli.config import ConfigError, RewardSpec, TrainConfig, TrainerConfig

    with pytest.raises(ConfigError, match="trainer.device: cuda:1: the vLLM engine would still start on GPU 0; pick "
                                          "the GPU with CUDA_VISIBLE_DEVICES=1 and trainer.device=cuda"):
        TrainConfig(task="t", rewards=[RewardSpec(name="correct")], trainer=TrainerConfig(device="cuda:1"))
    TrainConfig(task="t", rewards=[RewardSpec(name="correct")], trainer=TrainerConfig(device="cuda:0"))  # fine


def test_the_engine_asks_a_shared_gpu_for_its_weights_cache_and_workspace_only():
    """vLLM refuses to start unless free memory >= gpu_memory_utilization x the device; with the KV cache
    sized by rollout.kv_cache_gib the engine asks for what it uses, and says in one line when that does not fit."""
    from grpo_cli.engines.options import ENGINE_WORKSPACE_GIB, engine_utilization, weight_bytes
    from grpo_cli.errors import UsageError

    gib = 2**30
    total = 141 * gib  # an H200, a third of it held by the trainer's models
    assert engine_utilization(1 * gib, 4 * gib, 94 * gib, total) == pytest.approx((5 + ENGINE_WORKSPACE_GIB) / 141)
    with pytest.raises(UsageError, match=r"rollout.kv_cache_gib: the vLLM engine needs 36.0 GiB .* 20.0 GiB"):
        engine_utilization(2 * gib, 32 * gib, 20 * gib, total)
    shipped = REPO / "grpo_cli" / "models" / "bike_base"
    params = 1_116_800  # the shipped model, tied embedding counted once
    assert weight_bytes(str(shipped), "float32") == 4 * params and weight_bytes(str(shipped), "bfloat16") == 2 * params


@pytest.mark.parametrize("utilization", [None, 0.4])
def test_on_cuda_the_kv_cache_is_sized_explicitly_unless_a_utilization_is_given(monkeypatch, utilization):
    """The vLLM engine's arguments on a (pretend) CUDA device with 100 GiB free of 141: a 4 GiB cache and the
    utilization its start-up check passes with; an explicit rollout.gpu_memory_utilization is passed as is."""
    import vllm

    from grpo_cli.config import ModelConfig, RolloutConfig
    from grpo_cli.engines.options import ENGINE_WORKSPACE_GIB, weight_bytes
    from grpo_cli.engines.vllm import VLLMEngine

    seen = {}

    class Engine:  # vllm.LLM's constructor needs CUDA here: the one stand-in
        def __init__(self, **kwargs):
            seen.update(kwargs)

        def get_tokenizer(self):
            return None

    gib = 2**30
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (100 * gib, 141 * gib))
    monkeypatch.setattr(vllm, "LLM", Engine)
    shipped = str(REPO / "grpo_cli" / "models" / "bike_base")
    VLLMEngine(shipped, ModelConfig(dtype="bfloat16"), RolloutConfig(kv_cache_gib=4, gpu_memory_utilization=utilization),
               seed=0)
    if utilization is None:
        assert seen["kv_cache_memory_bytes"] == 4 * gib
        expected = (weight_bytes(shipped, "bfloat16") + (4 + ENGINE_WORKSPACE_GIB) * gib) / (141 * gib)
        assert seen["gpu_memory_utilization"] == pytest.approx(expected)
    else:
        assert "kv_cache_memory_bytes" not in seen and seen["gpu_memory_utilization"] == 0.4
    assert "max_num_seqs" not in seen and "block_size" not in seen  # the CPU backend's settings stay on the CPU


def test_check_counts_what_a_rank_holds_with_and_without_layer_by_layer_resharding():
    """`grpo check`'s estimate for a 2-rank run of scripts/bench_reshard.py's 70.8M model: the parameter count is
    the built model's, and a rank's weights at their peak are its shard + the root group + 2 layers (or + the
    whole model without dist.reshard_layers), beside sharded gradients and AdamW moments."""
    import importlib.util

    from grpo_cli.config import DistConfig, RewardSpec, TrainConfig
    from grpo_cli.estimate import layer_parameter_count, memory_lines, parameter_count

    spec = importlib.util.spec_from_file_location("bench_reshard", REPO / "scripts" / "bench_reshard.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    with torch.device("meta"):  # shapes only
        model = bench.random_qwen2(32)
    shape = model.config.to_dict()
    params = sum(p.numel() for p in model.parameters())
    assert parameter_count(shape) == params == 70_824_320
    layer = layer_parameter_count(shape)
    root = params - 32 * layer
    gib = 2**30

    def train_gib(reshard_layers: bool, world_size: int) -> str:
        cfg = TrainConfig(task="t", rewards=[RewardSpec(name="correct")], dist=DistConfig(reshard_layers=reshard_layers))
        line = memory_lines(cfg, shape, world_size)[0]
        return line.split("policy + grads + AdamW ")[1].split(" GiB")[0]

    assert train_gib(True, 1) == f"{params * 16 / gib:.2f}"
    assert train_gib(True, 2) == f"{(params * 8 + (root + 2 * layer) * 4) / gib:.2f}"
    assert train_gib(False, 2) == f"{(params * 8 + params * 4) / gib:.2f}"


def test_fsdp_gathers_carry_the_compute_dtype_only_over_fp32_master_weights():
    """On CUDA the trainer keeps fp32 master weights and computes in model.dtype: FSDP2 then gathers bf16 and
    reduces gradients in fp32. Where the weights are stored in the compute dtype (the CPU, the frozen
    reference) there is nothing to cast. (The 2-rank job of tests/test_distributed.py runs the bf16 gathers.)"""
    from grpo_cli.dist import Dist
    from grpo_cli.dist.shard import mixed_precision

    policy = mixed_precision(Dist(device="cuda").master_dtype("bfloat16"), "bfloat16")
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert mixed_precision(Dist(device="cpu").master_dtype("float32"), "float32") is None
    assert mixed_precision("bfloat16", "bfloat16") is None  # the reference, stored in model.dtype


def test_check_counts_a_lora_run_as_a_frozen_base_in_its_dtype_and_fp32_adapters():
    """With model.lora: the base once in model.dtype (no reference copy), the adapters' count from the config,
    and their weights, gradients and AdamW moments in fp32; checked against peft's count on the built model."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM, Qwen2Config

    from grpo_cli.config import LoraConfig, ModelConfig, RewardSpec, RolloutConfig, TrainConfig
    from grpo_cli.estimate import adapter_parameter_count, memory_lines
    from grpo_cli.weights.lora import peft_config

    config = json.loads((REPO / "grpo_cli" / "models" / "bike_base" / "config.json").read_text())
    with torch.device("meta"):
        model = get_peft_model(AutoModelForCausalLM.from_config(Qwen2Config(**config)), peft_config(LoraConfig(rank=16), "base"))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert adapter_parameter_count(config, 16, LoraConfig().target_modules) == trainable == 188_416
    cfg = TrainConfig(task="t", rewards=[RewardSpec(name="correct")], rollout=RolloutConfig(push_check_tol=0.05),
                      model=ModelConfig(dtype="bfloat16", lora=LoraConfig(rank=16)))
    line = memory_lines(cfg, config, 1)[0]
    assert "1.1M base parameters in bfloat16" in line and "0.19M adapter parameters" in line
    assert "reference 0 GiB (the base with the adapters off)" in line


def saved_bytes_per_token(model: torch.nn.Module, autocast: bool) -> float:
    """What autograd keeps for the backward of `model`'s body per input token: the growth of the saved tensors
    from 2 to 4 sequences of 64 tokens (what does not grow with the batch, such as autocast's bf16 copies of the
    weights, cancels), each storage counted once, parameters left out."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def saved(batch: int) -> int:
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.untyped_storage().data_ptr() not in params:
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        ids = torch.randint(0, model.config.vocab_size, (batch, 64), generator=torch.Generator().manual_seed(batch))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            model.model(input_ids=ids)
        return sum(seen.values())

    return (saved(4) - saved(2)) / (2 * 64)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_check_activation_estimate_matches_what_autograd_saves(dtype, lora):
    """`grpo check`'s activations per token (estimate.ACTIVATION_BYTES) against the tensors autograd saves in a
    Qwen2-shaped model of a shape the table was not fitted on: fp32 as on the CPU, and bf16 as the trainer runs on
    CUDA (autocast over fp32 master weights; with LoRA a bf16 base and fp32 adapters), here under the CPU's
    autocast."""
    from peft import get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from grpo_cli.config import LoraConfig
    from grpo_cli.estimate import activation_bytes_per_token
    from grpo_cli.weights.lora import peft_config

    shape = dict(vocab_size=300, hidden_size=384, intermediate_size=1536, num_hidden_layers=2, num_attention_heads=6,
                 num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**shape, attn_implementation="sdpa"))
    if lora:
        model = get_peft_model(model.to(torch.bfloat16) if dtype == "bfloat16" else model,
                               peft_config(LoraConfig(rank=16), "base")).base_model.model
    measured = saved_bytes_per_token(model, autocast=dtype == "bfloat16")
    estimate = activation_bytes_per_token(shape, dtype, lora)
    assert estimate == pytest.approx(measured, rel=0.1), (estimate, measured)


def test_the_7b_lora_recipe_fits_an_80_gb_gpu_and_sleeps_at_level_1(cli):
    """`grpo check` on the 7B LoRA recipe (its shape from estimate.HUB_SHAPES: no download) prints each phase's GPU
    memory, under 80 GiB at the peak; sleep level 2 would drop the base weights the adapter push never sends
    again, so a LoRA run that pushes adapters sleeps at level 1."""
    import re

    out = cli("check", "recipe=bike_pricing_qwen7b_lora").stdout
    assert "7615.6M base parameters in bfloat16" in out and "80.74M adapter parameters" in out
    peak, generating, updating = map(float, re.search(r"peak ([\d.]+) GiB: ([\d.]+) while vLLM generates, ([\d.]+) "
                                                      r"while the trainer updates", out).groups())
    assert peak == max(generating, updating) < 80
    assert "(sleep level 1)" in cli("check", "recipe=bike_pricing_qwen7b_lora", "rollout.sleep_level=2").stdout
    assert "(sleep level 2)" in cli("check", "recipe=bike_pricing_qwen7b_lora", "rollout.sleep_level=2",
                                    "rollout.lora_push=merged").stdout
    assert "awake throughout" in cli("check", "recipe=bike_pricing_qwen7b_lora", "rollout.sleep_mode=off").stdout
    assert "on a GPU" not in cli("check", "recipe=bike_pricing").stdout  # a CPU recipe: no GPU lines


def test_check_counts_the_engine_where_the_run_puts_it_and_awake_when_it_samples_ahead(cli):
    """With max_staleness > 0 the engine samples while the trainer updates, so it never sleeps (the run's
    sleep_wanted): the update's peak holds the whole engine. Split: the trainer rank's GPU holds no engine, the
    generator's holds one, awake throughout; sleep_mode=on there is refused (issue 39)."""
    import re

    def phases(out):
        return map(float, re.search(r"peak ([\d.]+) GiB: ([\d.]+) while vLLM generates, ([\d.]+) while the trainer "
                                    r"updates", out).groups())

    base = cli("check", "recipe=bike_pricing_qwen7b_lora").stdout
    ahead = cli("check", "recipe=bike_pricing_qwen7b_lora", "rollout.max_staleness=1").stdout
    engine = float(re.search(r"vLLM ([\d.]+) GiB awake", ahead).group(1))
    trainer = float(re.search(r"the trainer holds ([\d.]+) GiB while it updates", ahead).group(1))
    assert "awake throughout (it samples while the trainer steps)" in ahead and "asleep" not in ahead
    peak, _, updating = phases(ahead)
    assert updating == pytest.approx(trainer + engine, abs=0.15) and peak == updating > max(phases(base))  # each to 0.1
    split = cli("check", "recipe=bike_pricing_qwen7b_lora", "rollout.placement=split", "dist.nproc_per_node=2",
                "rollout.max_staleness=1").stdout
    assert "GPUs (GPU 0 trains, GPU 1 generates; each rank its node's LOCAL_RANK-th)" in split
    assert f"peak {trainer:.1f} GiB on each trainer rank's GPU (no engine there)" in split
    assert f"each generator rank's GPU: vLLM {engine:.1f} GiB awake" in split \
           and "throughout (a split job's engine never sleeps)" in split
    assert "GPUs (node 0: GPU 0 trains; node 1: GPU 0 generates;" in cli(
        "check", "recipe=bike_pricing_qwen7b_lora", "rollout.placement=split", "dist.nnodes=2").stdout
    scaled = cli("check", "recipe=bike_pricing_qwen7b_lora", "rollout.placement=split", "dist.nproc_per_node=4",
                 "rollout.generator_ranks=2", "rollout.max_staleness=1").stdout
    assert "GPUs (GPUs 0-1 train, GPUs 2-3 generate;" in scaled
    sharded = float(re.search(r"peak ([\d.]+) GiB on each trainer rank's GPU", scaled).group(1))
    assert sharded < trainer  # FSDP2 over the two trainer ranks
    assert f"each generator rank's GPU: vLLM {engine:.1f} GiB awake" in scaled  # each engine holds the whole model
    refused = cli("check", "recipe=bike_pricing_qwen7b_lora", "rollout.placement=split", "dist.nproc_per_node=2",
                  "rollout.sleep_mode=on")
    assert refused.returncode == 2 and "rollout.sleep_mode: on: a split job's engine" in refused.stderr


def test_a_split_job_s_generator_rank_sees_only_its_own_gpu(monkeypatch):
    """vLLM's one-process worker runs on cuda:0 of the GPUs it sees, so the generator rank of a split job is shown
    only its node's LOCAL_RANK-th GPU (of CUDA_VISIBLE_DEVICES' list where one is set); a node of one GPU keeps it."""
    from grpo_cli.dist import launch

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert launch.bind_generator_gpu() == "1" and os.environ["CUDA_VISIBLE_DEVICES"] == "1"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4, 6")
    assert launch.bind_generator_gpu() == "6" and os.environ["CUDA_VISIBLE_DEVICES"] == "6"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    assert launch.bind_generator_gpu() is None and os.environ["CUDA_VISIBLE_DEVICES"] == "3"
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(RuntimeError, match="CUDA already started"):
        launch.bind_generator_gpu()


def test_the_cli_binds_each_generator_s_gpu_before_it_opens_the_channel(monkeypatch):
    """Under the launcher, each generator rank of a split job chooses its GPU (its node's LOCAL_RANK-th) before
    anything of CUDA or vLLM starts in it (its lines are the first thing it opens); a trainer rank keeps every GPU
    (Dist.init takes cuda:LOCAL_RANK). Split 1+1 on two GPUs, 1 trainer + 2 generators and 2 + 1 on three."""
    from grpo_cli import cli
    from grpo_cli.dist import channel, launch

    seen = []

    class Line:
        def send(self, obj):
            pass

        def recv(self):
            return "run-name", (None,)  # the run directory's name, and rank 0's resume decision (a new run)

    def connect(rank, trainers, world_size, timeout_s):
        seen.append((rank, trainers, os.environ.get("CUDA_VISIBLE_DEVICES")))
        return channel.Links([Line()] * (world_size - trainers if rank == 0 else rank >= trainers), None)

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(channel, "connect", connect)
    monkeypatch.setattr(launch, "die_with_parent", lambda: None)
    monkeypatch.setattr(launch, "share_from_rank0", lambda value: value)  # the trainers' broadcast, one process here
    monkeypatch.setattr(cli, "_run_hydra", lambda command, rest: 0)
    monkeypatch.setattr(cli, "_RUN_NAME", cli._RUN_NAME)
    monkeypatch.setattr(cli, "_SHARED_RESUME", None)
    for world, generators, want in [(2, 1, [(0, 1, None), (1, 1, "1")]),
                                    (3, 2, [(0, 1, None), (1, 1, "1"), (2, 1, "2")]),
                                    (3, 1, [(0, 2, None), (1, 2, None), (2, 2, "2")])]:
        seen.clear()
        monkeypatch.setattr(torch.cuda, "device_count", lambda world=world: world)
        args = ["train", "recipe=bike_pricing", "rollout.placement=split", f"dist.nproc_per_node={world}",
                f"rollout.generator_ranks={generators}", "rollout.prompts_per_step=4"]
        for rank in map(str, range(world)):
            monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
            for key, value in {"WORLD_SIZE": str(world), "RANK": rank, "LOCAL_RANK": rank}.items():
                monkeypatch.setenv(key, value)
            assert cli.main(args) == 0
        assert seen == want
