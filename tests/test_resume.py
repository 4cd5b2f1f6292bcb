"""Never lose a run: atomic checkpoints, exact resume after SIGKILL, Ctrl-C, and bad input.

Runs use a tiny randomly initialised Qwen2 model with the shipped tokenizer and a
graded custom reward (share of digits), so every step has a real gradient and the
tests do not depend on the shipped model's accuracy.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

REWARD_MODULE = '''
import math
import os
import time

def digit_share(completions, **kwargs):
    time.sleep(float(os.environ.get("SLOW_REWARD_S", "0")))  # kill_at_step_2's run: a step outlasts the poll
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]

def boom(completions, **kwargs):
    raise ValueError("boom")

def too_few(completions, **kwargs):
    return [1.0]

def nan_always(completions, **kwargs):
    return [math.nan] * len(completions)

def huge(completions, **kwargs):  # finite rewards whose advantages overflow the float32 loss
    return [3e38 if i % 2 else 0.0 for i in range(len(completions))]

def nan_sometimes(completions, **kwargs):
    return [math.nan if i == 0 else 0.5 for i in range(len(completions))]

def sleeps(completions, **kwargs):  # a checker that hangs
    import time
    time.sleep(60)
    return [0.0] * len(completions)

def three_values(completions, **kwargs):
    return [1.0, 0.0, 1.0]

def echo(argument):  # a tool: its reply is the start of its argument, reversed
    return argument[:6][::-1]

def raises_sometimes(completions, **kwargs):  # crashes on some samples only (about one in four)
    if any(len(c) % 4 == 0 for c in completions):
        raise RuntimeError("cannot parse this one")
    return [0.5] * len(completions)
'''


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, tiny_model_dir):
    """The tiny model (shipped tokenizer) and a reward module, in a directory the runs use as cwd."""
    root = tmp_path_factory.mktemp("resume")
    (root / "tiny").symlink_to(tiny_model_dir, target_is_directory=True)
    (root / "test_rewards_mod.py").write_text(REWARD_MODULE)
    return root


@pytest.fixture
def in_workdir(workdir, monkeypatch):
    """In-process runs see the reward module as a subprocess in `workdir` would."""
    monkeypatch.chdir(workdir)
    monkeypatch.syspath_prepend(str(workdir))
    return workdir


def args(workdir: Path, out: str, *extra: str) -> list[str]:
    """`grpo train` on the tiny model with the transformers engine and a graded reward: a real gradient at
    every step, about a second each."""
    return ["train", "recipe=bike_pricing", f"output_dir={workdir / out}", f"model.name_or_path={workdir / 'tiny'}",
            "rollout.engine=hf", "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=16",
            "eval.num_problems=4", "eval.every=2", "trainer.lr=1e-3", "rewards=[{name:test_rewards_mod:digit_share}]",
            "rollout.push_check_every=0", "data.num_train=200", "data.num_heldout=20", *extra]


def run(capsys, workdir: Path, out: str, *extra: str) -> tuple[int, str, str]:
    """`grpo train` in this process (as `python -m grpo_cli` would run it): (exit code, stdout, stderr)."""
    from grpo_cli.cli import main

    capsys.readouterr()
    try:
        code = main(args(workdir, out, *extra))
    except SystemExit as e:
        code = e.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def only_run_dir(workdir: Path, out: str) -> Path:
    dirs = list((workdir / out / "bike_pricing").iterdir())
    assert len(dirs) == 1, dirs
    return dirs[0]


def test_atomic_save_leaves_previous_checkpoint_usable(workdir, tmp_path, monkeypatch):
    from grpo_cli.weights.checkpoint import load_policy, load_tokenizer, save_checkpoint
    from grpo_cli.weights.runs import step_checkpoints

    model, tokenizer = load_policy(str(workdir / "tiny"), "float32"), load_tokenizer(str(workdir / "tiny"))
    run_dir = tmp_path / "run"
    state = {"step": 1}
    save_checkpoint(model, tokenizer, run_dir / "checkpoints" / "step_000001", {"step": 1}, state)

    def killed(*a, **k):  # the writer dies after the weights, before the tokenizer and the marker
        raise KeyboardInterrupt

    monkeypatch.setattr(type(tokenizer), "save_pretrained", killed)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(model, tokenizer, run_dir / "checkpoints" / "step_000002", {"step": 2}, {"step": 2})
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert names[0] == "step_000001" and names[1].startswith("step_000002.tmp-")  # half-written, under a tmp name
    assert [p.name for p in step_checkpoints(run_dir)] == ["step_000001"]  # ...which loaders ignore
    assert load_policy(str(run_dir / "checkpoints" / "step_000001"), "float32") is not None


# The update's menu with more than one optimizer step per batch, extra sampling rounds and every
# correction on: the cursor, the rounds' seeds, the old logprobs and the schedule must all resume exactly.
MENU = ("trainer.ppo_epochs=2", "trainer.minibatches=2", "rollout.dynamic_sampling=true", "trainer.policy_loss=gspo",
        "trainer.mismatch_correction=tis", "trainer.kl_in_reward=true", "trainer.entropy_coef=0.01")
# A tool run the tiny random model calls often: any text from a space to an "e" is a call of `echo`.
TOOLS = ("rollout.tools=[{function:test_rewards_mod:echo,open:' ',close:e,timeout_s:null}]",
         "rollout.tool_result_tags=['[',']']", "rollout.max_turns=3", "rollout.max_trajectory_tokens=40")


def kill_when(workdir: Path, out: str, ready: str, *extra: str, lines: int = 0) -> tuple[Path, str]:
    """`python -m grpo_cli train ...` SIGKILLed once a file matching `ready` (under its output_dir) exists and
    holds more than `lines` lines: the file, and what the run printed. Its reward sleeps 0.2 s a call (the
    numbers are the same): a tiny-model step takes tens of milliseconds, and steps 3, 4 and the final save once
    finished inside the 0.1 s poll, before the kill."""
    proc = subprocess.Popen([sys.executable, "-m", "grpo_cli", *args(workdir, out, *extra)], cwd=workdir,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, "SLOW_REWARD_S": "0.2"})
    deadline, marker = time.time() + 600, None
    while time.time() < deadline and proc.poll() is None and marker is None:
        found = [p for p in (workdir / out).glob(ready) if len(p.read_text().splitlines()) > lines]
        marker = found[0] if found else None
        time.sleep(0.1)
    assert marker is not None, f"no {ready} appeared"
    proc.send_signal(signal.SIGKILL)
    printed, _ = proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    return marker, printed


def kill_at_step_2(workdir: Path, out: str, *extra: str) -> Path:
    """A run SIGKILLed once its step-2 checkpoint is complete, before its end: its run directory."""
    marker, _ = kill_when(workdir, out, "bike_pricing/*/checkpoints/step_000002/checkpoint.json", *extra)
    assert not (marker.parents[1] / "final").exists()
    return marker.parents[2]


# LoRA: the adapters and their AdamW moments are the whole trainable state (the reference: adapters off)
LORA = ("model.lora.rank=8", "model.lora.lr=1e-2")


@pytest.mark.parametrize("menu", [(), MENU, TOOLS, LORA], ids=["default", "menu", "tools", "lora"])
def test_resume_after_sigkill_gives_the_same_weights(in_workdir, capsys, menu):
    from safetensors.torch import load_file

    workdir = in_workdir
    straight_dir, killed = f"straight_{len(menu)}", f"killed_{len(menu)}"
    code, _, err = run(capsys, workdir, straight_dir, "trainer.steps=4", *menu)
    assert code == 0, err[-2000:]
    command = ("trainer.steps=4", "checkpoint.every=2", "resume=auto", *menu)  # a requeued job's one command
    # a requeued job's one command, SIGKILLed three times: before its first checkpoint, after it, and after resuming
    if not menu:  # its first attempt, killed before its first checkpoint, leaves nothing to resume (issue 54)
        (first, printed) = kill_when(workdir, killed, "bike_pricing/*/metrics.jsonl", *command)
        assert "resume=auto: no run of bike_pricing under" in printed and "starting a new run" in printed
        assert not (first.parent / "checkpoints").exists()
    run_dir = kill_at_step_2(workdir, killed, *command)
    if not menu:  # and once more after resuming, before its next checkpoint (the step-3 line is logged)
        assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 3  # steps 0-2: step 3 is the resume's
        _, printed = kill_when(workdir, killed, f"bike_pricing/{run_dir.name}/metrics.jsonl", *command, lines=3)
        assert f"resumed from {run_dir}" in printed and not (run_dir / "checkpoints" / "final").exists()
    code, out, err = run(capsys, workdir, killed, *command)
    assert code == 0, err[-2000:]
    assert f"resumed from {run_dir}" in out
    weights = "adapter_model.safetensors" if menu == LORA else "model.safetensors"  # LoRA: the adapters alone
    a = load_file(only_run_dir(workdir, straight_dir) / "checkpoints" / "final" / weights)
    b = load_file(run_dir / "checkpoints" / "final" / weights)
    assert a.keys() == b.keys()
    assert all(a[k].equal(b[k]) for k in a)  # bit-exact
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in logged] == [0, 1, 2, 3, 4]  # steps logged after the checkpoint were replayed
    if menu == TOOLS:  # trajectories of several turns, resumed on the same samples
        assert all(m["tools/calls_per_sample"] > 0.5 and m["tools/turns_per_sample"] > 1.5 for m in logged[1:])
    if menu == LORA:  # the adapters did train (B starts at 0)
        assert max(float(t.abs().max()) for k, t in b.items() if ".lora_B." in k) > 1e-3
    if menu:
        return  # the refusals below do not depend on the loss

    code, _, err = run(capsys, workdir, killed, "trainer.steps=4", "resume=auto")
    assert code == 2 and "nothing to resume" in err and "trainer.steps" in err
    code, _, err = run(capsys, workdir, killed, "trainer.steps=4", "trainer.lr=5e-3", "resume=auto")
    assert code == 2 and "trainer.lr (0.001 -> 0.005)" in err


def test_a_vllm_run_resumes_bit_exactly(trained_run, vllm_engine, shipped_weights, tmp_path):
    """The session's real vLLM run (conftest.trained_run), resumed from its step-2 checkpoint as a crash
    would leave it: the same final weights and the same logged values at steps 3 and 4."""
    import dataclasses
    import shutil

    from safetensors.torch import load_file

    from grpo_cli import train

    cfg, run_dir = trained_run
    copy = tmp_path / "bike_pricing" / "crashed"
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("final", "best", "metrics.png"))
    resumed_cfg = dataclasses.replace(cfg, resume=str(copy), output_dir=str(tmp_path))
    try:
        assert train.run(resumed_cfg, copy, engine=vllm_engine) == 0
    finally:
        vllm_engine.push_weights(shipped_weights.items())
    a = load_file(run_dir / "checkpoints" / "final" / "model.safetensors")
    b = load_file(copy / "checkpoints" / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    wall_clock = ("time/", "elapsed_s", "tokens_per_s", "memory/")
    logged = [[{k: v for k, v in json.loads(line).items() if not any(w in k for w in wall_clock)}
               for line in (d / "metrics.jsonl").read_text().splitlines()] for d in (run_dir, copy)]
    assert logged[0] == logged[1] and [m["step"] for m in logged[1]] == [0, 1, 2, 3, 4]


def test_ctrl_c_checkpoints_and_exits_130(workdir):
    proc = subprocess.Popen([sys.executable, "-m", "grpo_cli", *args(workdir, "interrupted", "trainer.steps=200",
                                                                   "checkpoint.every=0")],
                            cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 600
    while time.time() < deadline:
        metrics = list((workdir / "interrupted").glob("bike_pricing/*/metrics.jsonl"))
        if metrics and len(metrics[0].read_text().splitlines()) >= 2:  # step 0 and step 1 logged
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 130, stderr[-2000:]
    run_dir = only_run_dir(workdir, "interrupted")
    from grpo_cli.weights.runs import step_checkpoints

    saved = step_checkpoints(run_dir)
    assert saved, "Ctrl-C wrote no checkpoint"
    assert f"resume={run_dir}" in stdout + stderr
    assert "Traceback" not in stderr


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize(
    ("extra", "message", "code"),
    [
        (["data.source=/nonexistent/problems.jsonl"], "/nonexistent/problems.jsonl", 2),
        (["model.max_context_tokens=40"], "exceeds the model's context of 40 tokens", 2),
        (["model.name_or_path=/nonexistent/ckpt"], "model.name_or_path: model '/nonexistent/ckpt' does not exist", 2),
        (["rewards=[{name:test_rewards_mod:nope}]"], "nope", 2),
        (["resume=/nonexistent/run"], "resume=/nonexistent/run: not a directory", 2),  # only auto may start anew
        # failures during the run: exit 1
        (["rewards=[{name:test_rewards_mod:boom}]"], "failed on 8 of 8 samples at step 1", 1),
        (["rewards=[{name:test_rewards_mod:too_few}]"], "returned 1 values for 4 completions", 1),
        (["rewards=[{name:test_rewards_mod:nan_always}]"], "not a finite number", 1),
        # a reward that hangs is killed after timeout_s and stops the run in bounded time;
        # one that returns 3 values for a group of 4 names the function and the samples
        (["rewards=[{name:test_rewards_mod:sleeps,timeout_s:1}]"],
         "'test_rewards_mod:sleeps' failed on 8 of 8 samples at step 1: samples 4-7: timed out after 1 s", 1),
        (["rewards=[{name:test_rewards_mod:three_values}]"],
         "'test_rewards_mod:three_values' failed on 8 of 8 samples at step 1: samples 4-7: returned 3 values for 4", 1),
        (["rewards=[{name:test_rewards_mod:huge}]", "trainer.advantage=group_mean", "trainer.steps=4"],
         "steps in a row had a non-finite loss or gradient", 1),
    ],
)
def test_bad_input_is_one_line(in_workdir, capsys, tmp_path, extra, message, code):
    got, _, err = run(capsys, in_workdir, str(tmp_path / "bad"), "trainer.steps=2", "eval.every=0", *extra)
    assert got == code, err[-2000:]
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("grpo train: error: ")
    assert message in err.strip().splitlines()[-1]
    if code == 1:  # a failure during the run: its traceback is in the run's log
        (log,) = (tmp_path / "bad" / "bike_pricing").glob("*/train.log")
        assert "Traceback" in log.read_text()


def test_bad_data_files(in_workdir, capsys, tmp_path):
    missing_answer = write_jsonl(tmp_path / "no_answer.jsonl", [{"question": f"q{i}"} for i in range(20)])
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    cases = [
        ([f"data.source={missing_answer}", "data.num_heldout=4", "eval.num_problems=4",
          "rewards=[{name:correct}]"], "answer"),
        ([f"data.source={empty}"], "empty"),
    ]
    for i, (extra, message) in enumerate(cases):
        code, _, err = run(capsys, in_workdir, str(tmp_path / f"bad_data_{i}"), "trainer.steps=2", *extra)
        assert code == 2, err[-2000:]
        line = err.strip().splitlines()[-1]
        assert line.startswith("grpo train: error: ") and message in line, line


def test_a_few_failing_samples_score_zero_and_are_counted(in_workdir, capsys):
    code, _, err = run(capsys, in_workdir, "sometimes", "trainer.steps=1",
                       "rewards=[{name:test_rewards_mod:nan_sometimes}]")
    assert code == 0, err[-2000:]
    metrics = [json.loads(line) for line in (only_run_dir(in_workdir, "sometimes") / "metrics.jsonl").read_text()
               .splitlines()]
    # one NaN in each group's call (2 groups of 4), scored 0, the run went on
    assert metrics[-1]["reward/failures"] == 2 and metrics[-1]["reward_failures/test_rewards_mod:nan_sometimes"] == 2


def test_a_reward_that_crashes_on_some_samples_drops_them_from_the_loss(in_workdir, capsys):
    code, _, err = run(capsys, in_workdir, "drop", "trainer.steps=2",
                       "rewards=[{name:test_rewards_mod:digit_share,correctness:true},"
                       "{name:test_rewards_mod:raises_sometimes,on_failure:drop}]")
    assert code == 0, err[-2000:]
    metrics = [json.loads(line) for line in (only_run_dir(in_workdir, "drop") / "metrics.jsonl").read_text()
               .splitlines()]
    metrics = [m for m in metrics if "reward/dropped" in m]  # the training steps (step 0 is the baseline eval)
    assert len(metrics) == 2
    for m in metrics:
        fails = m["reward_failures/test_rewards_mod:raises_sometimes"]
        assert m["reward/dropped"] == fails  # every sample it failed on left the loss, no other one did
    assert 0 < sum(m["reward/dropped"] for m in metrics) < 16


def test_a_truncated_model_file_is_named_in_one_line(in_workdir, capsys, tmp_path):
    import shutil

    from grpo_cli.cli import main

    damaged = tmp_path / "damaged"
    shutil.copytree(in_workdir / "tiny", damaged)
    weights = damaged / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # an interrupted copy
    code, _, err = run(capsys, in_workdir, str(tmp_path / "damaged_run"), "trainer.steps=2",
                       f"model.name_or_path={damaged}")
    assert code == 2, err[-2000:]
    line = err.strip().splitlines()[-1]
    assert "Traceback" not in err
    assert f"'{weights}' is corrupted or truncated" in line and "cut short" in line, line
    with pytest.raises(SystemExit) as stopped:
        main(["eval", f"checkpoint={damaged}", "recipe=bike_pricing"])
    assert stopped.value.code == 2
    assert f"'{weights}' is corrupted or truncated" in capsys.readouterr().err.strip().splitlines()[-1]


def tiny_run_config(tmp_path: Path, tiny_model_dir: Path, *extra: str):
    """An in-process `grpo train` config on the tiny model and the transformers engine: seconds a step."""
    from grpo_cli.cli import load_config

    return load_config("train", ["recipe=bike_pricing", f"model.name_or_path={tiny_model_dir}",
                                 f"output_dir={tmp_path / 'runs'}", "rollout.engine=hf", "rollout.prompts_per_step=2",
                                 "rollout.group_size=2", "rollout.max_new_tokens=8", "eval.num_problems=2",
                                 "eval.every=0", "data.num_train=50", "data.num_heldout=10",
                                 "rollout.push_check_every=0", "logging.samples_every=0", *extra])


def test_a_resume_with_other_trainer_steps_keeps_the_original_lr_schedule(tmp_path, tiny_model_dir, capsys):
    """A decaying schedule spans the original run's trainer.steps: a resume that stops earlier keeps it
    (the lr does not jump) and says so; one that would run past its end is refused, and so is a
    checkpoint in another format."""
    import shutil

    from grpo_cli import train
    from grpo_cli.errors import UsageError

    schedule = ("trainer.lr_schedule=linear", "checkpoint.every=2")
    straight = tmp_path / "straight"
    assert train.run(tiny_run_config(tmp_path, tiny_model_dir, "trainer.steps=4", *schedule), straight) == 0
    lrs = {m["step"]: m["lr"] for m in map(json.loads, (straight / "metrics.jsonl").read_text().splitlines())
           if "lr" in m}
    shorter = tmp_path / "shorter"
    (shorter / "checkpoints").mkdir(parents=True)
    shutil.copytree(straight / "checkpoints" / "step_000002", shorter / "checkpoints" / "step_000002")
    capsys.readouterr()
    cfg = tiny_run_config(tmp_path, tiny_model_dir, "trainer.steps=3", f"resume={shorter}", *schedule)
    assert train.run(cfg, shorter) == 0
    resumed = {m["step"]: m["lr"] for m in map(json.loads, (shorter / "metrics.jsonl").read_text().splitlines())
               if "lr" in m}
    assert resumed[3] == pytest.approx(lrs[3])  # the original schedule's lr at step 3, not a new one's
    assert "lr schedule: linear over the original run's 4 steps, kept" in capsys.readouterr().out
    longer = tiny_run_config(tmp_path, tiny_model_dir, "trainer.steps=6", f"resume={shorter}", *schedule)
    with pytest.raises(UsageError, match=r"trainer.steps=6 runs past the end of the run's linear lr schedule"):
        train.run(longer, shorter)

    unversioned = tmp_path / "unversioned"  # a checkpoint from before the format had a number
    shutil.copytree(shorter, unversioned)
    marker = unversioned / "checkpoints" / "final" / "checkpoint.json"
    marker.write_text(json.dumps({k: v for k, v in json.loads(marker.read_text()).items() if k != "format_version"}))
    old = tiny_run_config(tmp_path, tiny_model_dir, "trainer.steps=3", f"resume={unversioned}", *schedule)
    with pytest.raises(UsageError, match=r"is in checkpoint format 0, and this grpo_cli resumes format 1 only"):
        train.run(old, unversioned)


def test_pruning_counts_only_complete_checkpoints(tmp_path, tiny_model_dir):
    """A directory an interrupted save left (step_N.old-PID, step_N.tmp-PID) is not a checkpoint: pruning,
    resuming and `grpo eval` list checkpoints by one rule, so the newest complete one is always kept."""
    import shutil

    from grpo_cli.weights.checkpoint import load_policy, load_tokenizer, save_checkpoint
    from grpo_cli.weights.runs import prune_checkpoints, step_checkpoints

    model, tokenizer = load_policy(str(tiny_model_dir), "float32"), load_tokenizer(str(tiny_model_dir))
    root = tmp_path / "checkpoints"
    for step in (1, 2):
        save_checkpoint(model, tokenizer, root / f"step_{step:06d}", {"step": step}, {"step": step})
    shutil.copytree(root / "step_000002", root / "step_000002.old-4242")  # a crash between the two renames
    (root / "step_000003.tmp-4242").mkdir()  # a save cut short
    prune_checkpoints(tmp_path, keep_last=1)
    assert sorted(p.name for p in root.iterdir()) == ["step_000002", "step_000002.old-4242", "step_000003.tmp-4242"]
    assert [p.name for p in step_checkpoints(tmp_path)] == ["step_000002"]


class RankOne:
    """Rank 1 of a two-rank job whose rank 0 decided `decided` (a checkpoint name, or None: a new run)."""
    rank, world_size = 1, 2

    def __init__(self, decided):
        self.decided = decided

    def broadcast(self, obj):
        return self.decided

    def gather(self, obj):
        return [True, obj]  # rank 0 holds its own choice


def test_every_rank_resumes_from_rank_0s_checkpoint_or_all_fail_in_one_line(tmp_path):
    """A rank decided from its own disk: with resume=auto a trainer rank on a node without the checkpoint started
    at step 0 from the base weights while rank 0 resumed at step N (issue 66, defect 3)."""
    from grpo_cli.config import RewardSpec, TrainConfig
    from grpo_cli.errors import UsageError
    from grpo_cli.step.setup import agreed_checkpoint, resume_or_start

    cfg = TrainConfig(task="t", rewards=[RewardSpec(name="correct")], resume="auto")
    with pytest.raises(UsageError) as info:
        resume_or_start(cfg, tmp_path, "builtin:bike_base", RankOne("step_000002"))  # this node holds nothing
    assert str(info.value).startswith(f"resume: rank 1 cannot read rank 0's checkpoint "
                                      f"{tmp_path / 'checkpoints' / 'step_000002'} on its own disk")
    mine = [tmp_path / "checkpoints" / f"step_{s:06d}" for s in (1, 2, 3)]  # this node has a newer one too
    assert agreed_checkpoint(tmp_path, mine, RankOne("step_000002")) == mine[1]
    assert agreed_checkpoint(tmp_path, mine, RankOne(None)) is None  # rank 0 starts a new run: so does every rank
