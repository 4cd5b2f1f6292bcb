"""Session-scoped fixtures shared by the test suite.

- `shipped_model_dir`: the small model committed in grpo_cli/models/bike_base.
- `vllm_engine`: ONE in-process vLLM rollout engine (`grpo_cli.engines.vllm.VLLMEngine`) on the shipped model
  for the whole session; starting one costs tens of seconds on CPU. Its raw `vllm.LLM` is
  `vllm_engine.llm`. A test that pushes weights into it must push `shipped_weights` back before it
  returns. A second in-process engine would break this one when it is torn down (docs/design.md), so a
  run on another model with vLLM goes to a subprocess.
- `trained_run`: one short real run of the default recipe on that engine, shared by the end-to-end,
  resume and eval checks.
- `bike_splits`: the recipe's default bike_pricing (train, heldout) problems.
- `tiny_model_dir`: a tiny randomly initialised Qwen2 saved with the shipped tokenizer, for
  runs that need a real model with a real gradient but not the shipped model's accuracy.
- `tiny_chat_model_dir`: the same model with a ChatML chat template in its tokenizer, for the
  chat recipes (gsm8k, math).
- `tiny_tool_model_dir`: a tiny Qwen2 with a tool-taking chat template (`tool_chat_tokenizer`), taught to
  answer any prompt with two native `<tool_call>`s in one message, for the chat tool format (gsm8k_tools);
  committed in tests/fixtures (`build_tiny_tool_model`);
  `tool_chat_model_dir` the same files untrained, for what reads a model's files only (`grpo check`).
- `cli`: `grpo ARGS` in this process, with its exit code and output.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHIPPED_MODEL_DIR = REPO / "grpo_cli" / "models" / "bike_base"


@pytest.fixture(scope="session")
def shipped_model_dir() -> Path:
    if not (SHIPPED_MODEL_DIR / "model.safetensors").exists():
        pytest.fail(f"no shipped model in {SHIPPED_MODEL_DIR}; build it with scripts/make_base_model.py")
    return SHIPPED_MODEL_DIR


@pytest.fixture(scope="session")
def vllm_engine(shipped_model_dir):
    """The session's shared vLLM engine on the shipped model (recipe defaults: float32, 1 GiB KV cache)."""
    pytest.importorskip("vllm")
    import torch

    from grpo_cli.config import ModelConfig, RolloutConfig
    from grpo_cli.engines.vllm import VLLMEngine

    # Set before the engine starts: vLLM binds its OpenMP threads at start-up (one thread
    # without this) and then turns torch.set_num_threads into a no-op for the whole process.
    os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
    return VLLMEngine(str(shipped_model_dir), ModelConfig(), RolloutConfig(), seed=0)


@pytest.fixture(scope="session")
def bike_splits():
    """(train, heldout) with the recipe defaults (DataConfig: 20000 / 200 / seed 1234)."""
    from grpo_cli.config import DataConfig
    from grpo_cli.tasks.bike_pricing import splits

    data = DataConfig()
    return splits(data.num_train, data.num_heldout, data.seed, tiers=tuple(data.tiers))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A 2-layer, 64-wide Qwen2 (seed 0, tied embeddings) with the shipped tokenizer, saved once a session."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    path = tmp_path_factory.mktemp("tiny_model")
    tokenizer = AutoTokenizer.from_pretrained(SHIPPED_MODEL_DIR)
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    Qwen2ForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


# ChatML, as Qwen2 instruct models write it (system, user and assistant turns, then the generation cue).
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="session")
def tiny_chat_model_dir(tmp_path_factory, tiny_model_dir) -> Path:
    """`tiny_model_dir` with a chat template, saved through the tokenizer as a chat model ships it."""
    import shutil

    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tiny_chat_model")
    for f in tiny_model_dir.iterdir():
        shutil.copy(f, path / f.name)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = CHATML_TEMPLATE
    tokenizer.save_pretrained(path)
    return path


# A template that takes tools the way Qwen2.5's does (their schemas in the system turn, calls as
# <tool_call>JSON</tool_call>, results in a user turn as <tool_response>), written small for the tests.
TOOL_CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n"
    "{% endif %}Tools you may call, as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>:\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}<|im_end|>\n"
    "{% elif messages[0]['role'] == 'system' %}<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}{% if message['role'] == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ message['content'] }}\n</tool_response><|im_end|>\n"
    "{% elif message['role'] != 'system' %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOL_CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>'
TOOL_CALLS = TOOL_CALL + '\n<tool_call>{"name": "calculator", "arguments": {"expression": "4*5"}}</tool_call><|im_end|>'


def tool_chat_tokenizer():
    """The shipped tokenizer made like Qwen2.5-Instruct's: <|im_start|> and <|im_end|> special tokens, <|im_end|>
    its end of sequence (a message ends there), <tool_call> and </tool_call> added (not special) tokens, and
    TOOL_CHAT_TEMPLATE."""
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(SHIPPED_MODEL_DIR)
    tokenizer.add_special_tokens({"eos_token": "<|im_end|>", "additional_special_tokens": ["<|im_start|>"]})
    tokenizer.add_tokens([AddedToken("<tool_call>", special=False), AddedToken("</tool_call>", special=False)])
    tokenizer.chat_template = TOOL_CHAT_TEMPLATE
    return tokenizer


def untrained_tool_model(tokenizer):
    """A 2-layer, 64-wide Qwen2 (seed 0, tied embeddings) for `tool_chat_tokenizer`."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    return Qwen2ForCausalLM(config)


@pytest.fixture(scope="session")
def tool_chat_model_dir(tmp_path_factory) -> Path:
    """`untrained_tool_model` with `tool_chat_tokenizer`, saved: for what reads a tool model's files, not its calls."""
    path = tmp_path_factory.mktemp("tool_chat_model")
    tokenizer = tool_chat_tokenizer()
    untrained_tool_model(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


TINY_TOOL_MODEL_DIR = Path(__file__).parent / "fixtures" / "tiny_tool_model"  # build_tiny_tool_model's files


@pytest.fixture(scope="session")
def tiny_tool_model_dir() -> Path:
    """`build_tiny_tool_model`'s model, committed in tests/fixtures (training it takes ~40 s of every suite)."""
    return TINY_TOOL_MODEL_DIR


def build_tiny_tool_model(path: Path) -> None:
    """A tiny Qwen2 with `tool_chat_tokenizer`, taught in 600 steps (about 40 s) to answer any prompt showing the
    calculator with one message of two calls of it in that syntax (TOOL_CALLS), so a run on it makes real native
    calls, several in a turn. The committed fixture was made by
    `.venv/bin/python -c "import sys; sys.path.insert(0, 'tests'); import conftest; conftest.build_tiny_tool_model(conftest.TINY_TOOL_MODEL_DIR)"`
    (a change to the tokenizer, the template or TOOL_CALLS needs it run again: test_tools.py checks they match)."""
    import torch
    from transformers.utils import get_json_schema

    from grpo_cli.tools import calculator

    tokenizer = tool_chat_tokenizer()
    model = untrained_tool_model(tokenizer)
    schemas = [get_json_schema(calculator)]
    call = tokenizer(TOOL_CALLS, add_special_tokens=False)["input_ids"]
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    # A linear decay to zero: at a constant rate a few sampled calls still come out garbled (28 of 32 exact
    # at temperature 0.2 after 300 steps), with it all 32 do, so the native-call test does not hang on luck.
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 - s / 600)
    for step in range(600):  # after any chat prompt showing the calculator, the calls (104 tokens)
        g = torch.Generator().manual_seed(step)
        split = 4 + step % 37
        words = torch.randint(0, 500, (4, 48), generator=g)  # questions, and system prompts, of any length
        messages = [[{"role": "system", "content": tokenizer.decode(w[split:])}] * (step % 2)
                    + [{"role": "user", "content": tokenizer.decode(w[:split])}] for w in words]
        prompts = [tokenizer(tokenizer.apply_chat_template(m, tools=schemas, tokenize=False, add_generation_prompt=True),
                             add_special_tokens=False)["input_ids"] for m in messages]
        width = min(map(len, prompts))
        ids = torch.tensor([p[-width:] + call for p in prompts])  # [4, width + T]
        labels = ids.clone()
        labels[:, :width] = -100
        loss = model(input_ids=ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


@pytest.fixture(scope="session")
def shipped_weights(shipped_model_dir):
    """The shipped model's tensors, as a push gives them to the engine."""
    from grpo_cli.weights.checkpoint import checkpoint_weights

    return checkpoint_weights(shipped_model_dir)


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory, vllm_engine, shipped_weights):
    """ONE short real run of the default recipe for the session, in this process on the session's vLLM
    engine (no engine start): 4 steps, a push check every step, held-out evaluations at steps 0, 2 and
    4, resumable checkpoints at steps 2 and 4 (final) and best. Returns (config, run directory); the
    engine holds the shipped weights again afterwards."""
    from grpo_cli import train
    from grpo_cli.cli import load_config

    out = tmp_path_factory.mktemp("trained")
    cfg = load_config("train", TRAINED_RUN_OVERRIDES + [f"output_dir={out}"])
    run_dir = out / "run"
    try:
        assert train.run(cfg, run_dir, engine=vllm_engine) == 0
    finally:
        vllm_engine.push_weights(shipped_weights.items())
    return cfg, run_dir


# The trained_run fixture's command line: `grpo train` with these overrides does the same in a subprocess.
TRAINED_RUN_OVERRIDES = ["recipe=bike_pricing", "trainer.steps=4", "rollout.prompts_per_step=4",
                         "rollout.group_size=4", "eval.num_problems=16", "eval.every=2", "checkpoint.every=2",
                         "rollout.push_check_every=1", "trainer.lr=1e-3", "logging.samples_every=2"]


ENGINE_FIXTURES = {"vllm_engine", "trained_run"}  # a test that needs one starts (or shares) a vLLM engine


def pytest_configure(config):
    """Under `make test`'s workers (pytest-xdist), each worker, and every process it starts, runs on a core set
    of its own: the product sizes its threads from the cores it may run on (runtime.usable_cpus), so without
    this two workers would each run two threads on two cores, and OpenMP threads spin-waiting on a shared core
    cost more than the second thread gains (docs/testing.md)."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if worker is None or count < 2 or not hasattr(os, "sched_setaffinity"):
        return
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) >= count:
        os.sched_setaffinity(0, cores[int(worker.removeprefix("gw")) % count::count])


# The long tier (docs/testing.md): the multi-process jobs and real servers that take a minute or more each, run by
# `make test-long`, not by `make test` (held to 12 minutes of pytest on 2 cores). One home for the list: file ->
# its tests in the tier, with what each took in a fresh clone's `make test` (seconds, setup of a shared run included).
LONG_TESTS: dict[str, dict[str, float]] = {
    "test_split.py": {  # its module's split run (67 s) goes with them
        "test_a_split_job_trains_as_one_process_with_the_same_schedule": 41 + 67,
        "test_a_split_job_over_two_simulated_nodes_with_a_run_root_each_resumes_to_the_one_node_job": 122,
        "test_a_split_job_with_its_trainer_killed_stops_at_once_and_resumes_bit_exactly": 115,
        "test_two_generators_sample_what_one_does_and_a_killed_one_resumes_on_one": 133,
        "test_two_trainers_beside_a_generator_train_as_two_colocated_ranks": 172,
        "test_a_kill_9_of_the_launcher_takes_every_trainer_and_generator_rank_with_it": 62,
    },
    "test_async.py": {  # the module's K=1 run (79 s)
        "test_the_batch_of_step_3_came_from_the_weights_after_step_1": 79,
        "test_sampling_after_the_update_gives_the_same_run_as_beside_it": 15,
        "test_a_k1_run_killed_after_its_step_2_checkpoint_resumes_bit_exactly": 95,
    },
    "test_distributed.py": {  # the module's 2-rank jobs (55 s and 48 s)
        "test_the_update_does_not_depend_on_how_the_batch_is_split": 55,
        "test_layer_by_layer_resharding_holds_a_layer_or_two_and_changes_no_number": 1,
        "test_two_simulated_nodes_and_plain_torchrun_run_the_same_job_as_two_processes": 98 + 48,
        "test_the_prompt_pool_chooses_the_same_prompts_at_one_and_two_ranks": 1,
        "test_kill_9_then_resume_at_two_ranks_is_bit_exact_at_one_rank_works_and_back_at_two": 100,
        "test_a_two_rank_lora_run_with_a_teacher_ends_with_the_adapters_of_a_one_rank_run": 60,
    },
    "test_distributed_engines.py": {
        "test_two_ranks_with_an_engine_each_train_countdown_on_its_shipped_model": 85,
        "test_two_ranks_can_share_one_tensor_parallel_vllm_engine": 106,
    },
    "test_tool_replay.py": {"test_a_tool_of_random_latency_replays_bit_for_bit_after_sigkill_and_resume": 121},
    "test_reward_model.py": {
        "test_a_served_reward_model_scores_as_in_process_and_a_run_whose_server_dies_ends_with_one_line": 97},
    "test_lora.py": {"test_vllm_serves_the_pushed_adapters_and_evaluates_adapter_checkpoints": 92},
    "test_bike_pricing_tools.py": {
        "test_a_few_steps_of_the_recipe_call_the_calculator_and_log_the_tool_and_greedy_curves": 64},
    "test_distill.py": {"test_a_teacher_served_by_a_real_vllm_server_grades_as_the_teacher_in_process": 55},
    "test_vision.py": {
        "test_a_vision_run_checkpoints_with_its_processor_resumes_bit_exactly_and_evaluates_on_images": 70},
}


def _mark_long(items: list) -> None:
    """Mark LONG_TESTS `long` (and `slow`); a listed name that its collected file no longer has is an error, not a
    test silently back in `make test`."""
    for item in items:
        if item.originalname in LONG_TESTS.get(item.path.name, {}):
            item.add_marker(pytest.mark.long)
            item.add_marker(pytest.mark.slow)
    modules = {item.path.name: item.module for item in items if getattr(item, "module", None) is not None}
    stale = [f"{f}::{name}" for f, names in LONG_TESTS.items() if f in modules for name in names
             if not callable(getattr(modules[f], name, None))]
    if stale:
        raise pytest.UsageError(f"tests/conftest.py LONG_TESTS names tests that do not exist: {', '.join(stale)}")


def pytest_collection_modifyitems(items):
    """A test that uses the session's vLLM engine is slow as a matter of course (`make test-fast` skips it).
    The files that hold a slow test run first: `make test` gives its two workers a file at a time, so the
    files of minutes start early and the files of seconds fill the end (no worker idles while the other runs
    a long file last)."""
    _mark_long(items)
    for item in items:
        if ENGINE_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)  # stable: each file keeps its order


class Result:
    def __init__(self, returncode: int, stdout: str, stderr: str) -> None:
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


@pytest.fixture
def cli(capsys, monkeypatch):
    """`grpo ARGS` in this process: a Result with the exit code and what it printed."""
    import sys

    from grpo_cli.cli import main

    monkeypatch.setattr(sys, "argv", list(sys.argv))  # Hydra's apps rewrite sys.argv

    def run(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> Result:
        for key, value in (env or {}).items():
            monkeypatch.setenv(key, value)
        monkeypatch.chdir(cwd or REPO)
        capsys.readouterr()
        try:
            code = main(list(args))
        except SystemExit as e:
            code = e.code
        captured = capsys.readouterr()
        return Result(code or 0, captured.out, captured.err)

    return run


def sigkill_when(proc: subprocess.Popen, root: Path, pattern: str) -> Path:
    """SIGKILL a `grpo train` subprocess once a file matching `pattern` under `root` exists (a checkpoint's
    checkpoint.json, written last): that file. Polls every 50 ms for up to 600 s."""
    deadline, marker = time.time() + 600, None
    while time.time() < deadline and proc.poll() is None and marker is None:
        marker = next(iter(root.glob(pattern)), None)
        time.sleep(0.05)
    assert marker is not None, f"no {pattern} appeared under {root}"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return marker
