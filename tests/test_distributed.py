"""Several processes: torchrun with 2 gloo ranks, FSDP2 (tier 3: minutes).

The update is checked on its own first (the same batch through 1 and 2 ranks and different
micro-batch caps gives the same weights, for every loss variant); then `grpo train` itself on the
tiny model with the transformers engine, so each job takes seconds: plain torchrun and two simulated
nodes against the same 2-rank job, a LoRA run, kill -9 and resume at 2, at 1 and back at 2 ranks,
Ctrl-C, and a rank that raises. The FSDP2 shards, collectives and checkpoints are the real ones.
The 2-rank runs with vLLM engines are in tests/test_distributed_engines.py.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from run_files import metrics_of, run_dir_of

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "workers" / "partition_update.py"
sys.path.insert(0, str(WORKER.parent))  # the worker's helpers, imported by the tests that read its job
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}  # one thread per rank: two ranks share this machine's two cores


def assert_same_weights(a: dict, b: dict, rtol: float = 1e-5) -> None:
    assert a.keys() == b.keys()
    for name in a:
        scale = float(a[name].abs().max())
        diff = float((a[name] - b[name]).abs().max())
        assert diff <= rtol * scale, f"{name}: max |diff| {diff:.3g} > {rtol} x {scale:.3g}"


@pytest.fixture(scope="module")
def partition_job(tmp_path_factory):
    """tests/workers/partition_update.py at 2 ranks, once: its outputs' folder; in its one/ subfolder the same
    variants at one rank with every sequence in one pass, in a process of its own with one thread as each rank
    has (once a vLLM engine has started in the test process, torch.set_num_threads does nothing there, and a
    second thread changes the float summation order: kl_in_reward then differed by 1.1e-5 relative)."""
    from partition_update import VARIANTS

    out = tmp_path_factory.mktemp("partition")
    (out / "one").mkdir()
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(WORKER), str(out), "3", *VARIANTS], capture_output=True, text=True, timeout=300,
                          env=ENV, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    one = subprocess.run([sys.executable, str(WORKER), str(out / "one"), "64", *VARIANTS], capture_output=True,
                         text=True, timeout=300, env=ENV, cwd=REPO)
    assert one.returncode == 0, one.stderr[-3000:]
    return out


def test_the_update_does_not_depend_on_how_the_batch_is_split(partition_job):
    """For every loss variant: one rank with every sequence in one pass (a process of one thread, as each rank);
    two ranks (uneven shares, padded passes, one torchrun job for all variants) with 3 per pass; one rank with 1
    per pass (in this process, against the same in this process): the same weights (fp32, relative 1e-5), and
    weights that did move; tool-run trajectories (tokens attended but out of the loss) too. The same job checks
    the loop's collectives on two gloo ranks."""
    from partition_update import VARIANTS, tiny, update_once

    from grpo_cli.dist import Dist

    tmp_path = partition_job
    collectives = [json.loads((tmp_path / f"collectives_rank{r}.json").read_text()) for r in range(2)]
    assert collectives == [  # every rank gets the same sums, decisions, rank 0's broadcast and every rank's value
        {"rank": r, "world_size": 2, "is_main": r == 0, "sum": [3.0, 1.0], "all": False, "any": True, "broadcast": 0,
         "gather": [0, 10]} for r in range(2)]
    threads = torch.get_num_threads()
    start = tiny(0).state_dict()
    try:
        torch.set_num_threads(1)  # as the two ranks ran
        for name in VARIANTS:
            whole = torch.load(tmp_path / "one" / f"{name}.pt")
            two_ranks = torch.load(tmp_path / f"{name}.pt")
            assert_same_weights(whole["weights"], two_ranks["weights"])
            assert two_ranks["stats"]["loss"] == pytest.approx(whole["stats"]["loss"], rel=1e-5), name
            assert two_ranks["stats"]["grad_norm"] == pytest.approx(whole["stats"]["grad_norm"], rel=1e-5), name
            if name == "lora":  # the adapters moved; every base weight is as it was, bit for bit
                base = {k.removeprefix("base_model.model.").replace(".base_layer.", "."): v
                        for k, v in two_ranks["weights"].items() if ".lora_" not in k}
                assert base.keys() == start.keys() and all(torch.equal(base[k], start[k]) for k in start)
                moved = max(float(v.abs().max()) for k, v in whole["weights"].items() if ".lora_B." in k)
            else:
                moved = max(float((whole["weights"][k] - start[k]).abs().max()) for k in start)
            assert moved > 1e-3, name  # the update did move the weights, so agreeing means something
            if name == "seq_mask":  # the band rejected some samples, not all of them
                assert 0 < two_ranks["stats"]["correction/masked_frac"] < 1
        for name in ("grpo", "tool_tokens"):
            one_per_pass = update_once(1, name, Dist())
            assert_same_weights(update_once(64, name, Dist())["weights"], one_per_pass["weights"])
            assert one_per_pass["passes"] > 4
        masked, unmasked = update_once(64, "tool_tokens", Dist()), update_once(64, "token_mean", Dist())
        embed = "model.embed_tokens.weight"
        assert not torch.equal(masked["weights"][embed], unmasked["weights"][embed])  # the mask changes the update
    finally:
        torch.set_num_threads(threads)


def test_layer_by_layer_resharding_holds_a_layer_or_two_and_changes_no_number(partition_job):
    """The 2-rank job's `reshard_runs` (the same update on a 6-layer model): freeing each layer after its
    forward and backward, a rank holds at most its shards + the root group + 2 layers (the one running and
    the one prefetched), where keeping the step gathered holds its shards + the whole model, with bit-identical
    weights, loss and grad norm. bf16 gathers over fp32 master weights hold half those gathered bytes, keep the
    shards and updated weights fp32, and land within bf16's round-off of the fp32 update."""
    from partition_update import reshard_start

    runs = torch.load(partition_job / "reshard.pt")
    layers, step, bf16 = runs["layers"], runs["step"], runs["layers_bf16"]
    shard, full, root, layer = (layers[k] for k in ("shard_bytes", "full_model_bytes", "root_bytes", "layer_bytes"))
    assert shard == full // 2  # 2 ranks, fp32 shards
    assert layers["peak_param_bytes"] <= shard + root + 2 * layer
    assert step["peak_param_bytes"] >= shard + full  # the whole model gathered at once
    assert layers["peak_param_bytes"] < 0.75 * step["peak_param_bytes"]
    for name, tensor in layers["weights"].items():
        assert torch.equal(tensor, step["weights"][name]), name
    assert (layers["loss"], layers["grad_norm"]) == (step["loss"], step["grad_norm"])
    assert bf16["shard_bytes"] == shard  # fp32 master shards
    assert bf16["peak_param_bytes"] <= shard + (root + 2 * layer) // 2
    assert bf16["loss"] == pytest.approx(layers["loss"], rel=2e-2, abs=1e-3)
    assert bf16["grad_norm"] == pytest.approx(layers["grad_norm"], rel=5e-2)
    start = reshard_start()
    lr = 1e-4  # one AdamW step moves a weight by about lr
    assert max(float((layers["weights"][k] - start[k]).abs().max()) for k in start) > lr / 2
    for name, tensor in bf16["weights"].items():
        assert tensor.dtype == torch.float32, name
        assert float((tensor - layers["weights"][name]).abs().max()) <= 2 * lr, name


# ---------------------------------------------------------------------------- grpo train at 2 ranks


REWARD_MODULE = '''
def digit_share(completions, **kwargs):
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]
'''

# Fault injection for the rank-failure test: rank 1's update raises at the second step.
SITECUSTOMIZE = '''
import os
if os.environ.get("GRPO_TEST_FAIL_RANK") == os.environ.get("RANK", "-"):
    import grpo_cli.step.update as _update
    _real, _calls = _update.update, []
    def update(*args, **kwargs):
        _calls.append(1)
        if len(_calls) == 2:
            raise RuntimeError("injected failure in the update")
        return _real(*args, **kwargs)
    _update.update = update
'''


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("dist")
    (root / "tiny").symlink_to(tiny_model_dir, target_is_directory=True)
    (root / "dist_rewards_mod.py").write_text(REWARD_MODULE)
    (root / "inject").mkdir()
    (root / "inject" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return root


# The prompt pool in every job here: its record comes from the ranks' gathered scores, so it is one pool on every
# rank, saved by rank 0 and resumed at any world size (a fast-moving EMA so it chooses within 4 steps).
POOL = ("data.sampler.name=signal_by_column", "data.sampler.decay=0.5", "data.sampler.floor=0.2",
        "data.sampler.band=[0.02,1.0]")  # the digit share of a tiny random model: a group below 0.02 is settled


def train_args(workdir: Path, out: str, *extra: str, ranks: int = 2) -> list[str]:
    return [sys.executable, "-m", "grpo_cli", "train", "recipe=bike_pricing", f"output_dir={workdir / out}",
            f"model.name_or_path={workdir / 'tiny'}", "rollout.engine=hf", "rollout.prompts_per_step=2",
            "rollout.group_size=4", "rollout.max_new_tokens=16", "eval.num_problems=4", "eval.every=2",
            "trainer.lr=1e-3", "trainer.lr_schedule=constant", "rewards=[{name:dist_rewards_mod:digit_share}]",
            "rollout.push_check_every=1", "data.num_train=200", "data.num_heldout=20", *POOL,
            *([f"dist.nproc_per_node={ranks}"] if ranks > 1 else []), *extra]


def env_with_cwd(workdir: Path, **extra: str) -> dict[str, str]:
    return {**ENV, "PYTHONPATH": os.pathsep.join([str(workdir), ENV.get("PYTHONPATH", "")]), **extra}


def train(workdir: Path, out: str, *extra: str, ranks: int = 2, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(train_args(workdir, out, *extra, ranks=ranks), cwd=workdir, capture_output=True, text=True,
                          timeout=600, env=env or env_with_cwd(workdir))


def final_weights(workdir: Path, out: str) -> dict:
    from safetensors.torch import load_file

    return load_file(run_dir_of(workdir / out) / "checkpoints" / "final" / "model.safetensors")


def assert_bit_identical(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    assert all(a[k].equal(b[k]) for k in a), [k for k in a if not a[k].equal(b[k])]


def workers_left(marker: str) -> list[str]:
    """Command lines of processes still running with `marker` (an output directory) in them."""
    ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout.splitlines()
    return [line for line in ps if marker in line and "ps -eo" not in line]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_procs(workdir):
    """A 2-rank job of 4 steps with checkpoints every 2: what plain torchrun, two simulated nodes and a run
    killed and resumed must reproduce bit for bit."""
    done = train(workdir, "two_procs", "trainer.steps=4", "checkpoint.every=2")
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir_of(workdir / "two_procs")


def test_two_simulated_nodes_and_plain_torchrun_run_the_same_job_as_two_processes(workdir, two_procs):
    by_hand = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                              *train_args(workdir, "by_hand", "trainer.steps=4", "checkpoint.every=2", ranks=1)[1:]],
                             cwd=workdir, capture_output=True, text=True, timeout=600, env=env_with_cwd(workdir))
    assert by_hand.returncode == 0, by_hand.stderr[-3000:]
    assert_bit_identical(final_weights(workdir, "two_procs"), final_weights(workdir, "by_hand"))
    port = free_port()
    nodes = [subprocess.Popen(train_args(workdir, "two_nodes", "trainer.steps=4", "checkpoint.every=2",
                                         "dist.nnodes=2", f"dist.node_rank={r}", f"dist.rdzv_endpoint=127.0.0.1:{port}",
                                         ranks=1),
                              cwd=workdir, env=env_with_cwd(workdir), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for r in range(2)]
    outputs = [node.communicate(timeout=600) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], [err[-2000:] for _, err in outputs]
    assert_bit_identical(final_weights(workdir, "two_procs"), final_weights(workdir, "two_nodes"))
    keys = ("reward/mean", "loss", "grad_norm", "eval/pass@1", "push_check/max_abs_diff")
    pick = [[{k: m.get(k) for k in keys} for m in metrics_of(run_dir)]
            for run_dir in (two_procs, run_dir_of(workdir / "two_nodes"))]
    assert pick[0] == pick[1]
    assert (two_procs / "train.log").is_file() and (two_procs / "train-rank1.log").is_file()  # one run, both logs


def test_the_prompt_pool_chooses_the_same_prompts_at_one_and_two_ranks(workdir, two_procs, monkeypatch, capsys):
    """data.sampler=signal_by_column at 1 process and at 2 ranks: the same prompts passed over, the same rewards
    and the same pool at every step (each rank scores half the groups; every rank records them all)."""
    from grpo_cli.cli import main

    monkeypatch.chdir(workdir)  # one process: in this one, the reward module imported from the run's cwd
    monkeypatch.syspath_prepend(str(workdir))
    main(train_args(workdir, "one_rank", "trainer.steps=4", "checkpoint.every=2", ranks=1)[3:])
    pool = [[{k: v for k, v in m.items() if k.startswith("pool/") or k == "reward/mean"} for m in metrics_of(run_dir)]
            for run_dir in (two_procs, run_dir_of(workdir / "one_rank"))]
    assert pool[0] == pool[1]
    assert sum(m["pool/passed_over"] for m in pool[0][1:]) > 0  # it did pass prompts over


def test_kill_9_then_resume_at_two_ranks_is_bit_exact_at_one_rank_works_and_back_at_two(workdir, two_procs,
                                                                                       monkeypatch, capsys):
    """kill -9 of the launcher takes its workers with it; resumed at 2 ranks the job ends with the weights
    of the uninterrupted one; a copy resumed at 1 process finishes, and that 1-process run resumes
    further at 2 ranks."""
    proc = subprocess.Popen(train_args(workdir, "killed", "trainer.steps=4", "checkpoint.every=2"), cwd=workdir,
                            env=env_with_cwd(workdir), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline, marker = time.time() + 600, None
    while time.time() < deadline and proc.poll() is None and marker is None:
        marker = next(iter((workdir / "killed").glob("bike_pricing/*/checkpoints/step_000002/checkpoint.json")), None)
        time.sleep(0.1)
    assert marker is not None, "no checkpoint at step 2 appeared"
    proc.send_signal(signal.SIGKILL)  # the launcher; its workers die with it
    proc.wait()
    time.sleep(2)
    assert workers_left(str(workdir / "killed")) == []
    run_dir = marker.parents[2]
    assert not (run_dir / "checkpoints" / "final").exists()
    copy = workdir / "killed_copy" / "bike_pricing" / run_dir.name
    shutil.copytree(run_dir, copy)

    resumed = train(workdir, "killed", "trainer.steps=4", "checkpoint.every=2", "resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_bit_identical(final_weights(workdir, "two_procs"), final_weights(workdir, "killed"))
    assert [m["step"] for m in metrics_of(run_dir)] == [0, 1, 2, 3, 4]

    from grpo_cli.cli import main

    monkeypatch.chdir(workdir)  # one process: in this one, the reward module imported from the run's cwd
    monkeypatch.syspath_prepend(str(workdir))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    capsys.readouterr()
    main(train_args(workdir, "killed_copy", "trainer.steps=4", "checkpoint.every=2", f"resume={copy}", ranks=1)[3:])
    assert "saved by 2 processes, resumed on 1" in capsys.readouterr().out
    assert [m["step"] for m in metrics_of(copy)] == [0, 1, 2, 3, 4]

    grown = train(workdir, "killed_copy", "trainer.steps=6", "checkpoint.every=2", f"resume={copy}")
    assert grown.returncode == 0, grown.stderr[-3000:]
    assert "saved by 1 process, resumed on 2" in grown.stdout
    assert [m["step"] for m in metrics_of(copy)] == [0, 1, 2, 3, 4, 5, 6]


def test_a_two_rank_lora_run_with_a_teacher_ends_with_the_adapters_of_a_one_rank_run(workdir):
    """`grpo train` with LoRA adapters and a distillation teacher (the base model itself, so the grade is 0 at
    step 1 and not after) at 2 ranks (FSDP2 over the peft model and over the teacher, the prompts split, the
    adapters gathered for the checkpoint) and at 1 (one thread, as each rank): the same adapters after 3 steps
    in peft's files, adapters that did move, and the same teacher metrics. Three steps of sampling, scoring and
    AdamW carry the float-order differences further than the one update of the partition test (1e-5): 7.9e-6
    relative at worst here, so the bound is 3e-5."""
    from safetensors.torch import load_file

    args = ("model.lora.rank=4", "model.lora.lr=3e-3", "trainer.steps=3", "checkpoint.every=0", "eval.every=0",
            f"distill.teacher={workdir / 'tiny'}")
    runs = {ranks: train(workdir, f"lora_{ranks}", *args, ranks=ranks) for ranks in (2, 1)}
    for ranks, done in runs.items():
        assert done.returncode == 0, (ranks, done.stderr[-3000:])
    adapters = [load_file(run_dir_of(workdir / f"lora_{ranks}") / "checkpoints" / "final" / "adapter_model.safetensors")
                for ranks in (2, 1)]
    assert_same_weights(adapters[1], adapters[0], rtol=3e-5)
    assert max(float(v.abs().max()) for k, v in adapters[0].items() if "lora_B" in k) > 1e-3  # B starts at zero
    assert "LoRA rank 4" in runs[2].stdout
    logs = [[json.loads(line) for line in (run_dir_of(workdir / f"lora_{ranks}") / "metrics.jsonl").read_text()
             .splitlines()] for ranks in (2, 1)]
    assert logs[0][0]["eval/teacher_pass@1"] == logs[1][0]["eval/teacher_pass@1"]
    grades = [[m["distill/reverse_kl"] for m in log[1:]] for log in logs]  # [ranks][steps 1-3]
    assert grades[0][0] == grades[1][0] == 0.0 and all(g != 0.0 for g in grades[0][1:])
    assert grades[0] == pytest.approx(grades[1], rel=1e-3, abs=1e-7)


def test_ctrl_c_on_two_ranks_checkpoints_exits_130_and_leaves_no_rank(workdir):
    from grpo_cli.weights.runs import step_checkpoints

    proc = subprocess.Popen(train_args(workdir, "interrupted", "trainer.steps=200", "checkpoint.every=0"),
                            cwd=workdir, env=env_with_cwd(workdir), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.time() + 600
    while time.time() < deadline:
        found = list((workdir / "interrupted").glob("bike_pricing/*/metrics.jsonl"))
        if found and len(found[0].read_text().splitlines()) >= 2:
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)  # what a terminal's Ctrl-C sends the launcher
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 130, stderr[-3000:]
    run_dir = run_dir_of(workdir / "interrupted")
    assert step_checkpoints(run_dir), "Ctrl-C wrote no checkpoint"
    assert f"resume={run_dir}" in stdout + stderr
    assert "Traceback" not in stderr
    assert workers_left(str(workdir / "interrupted")) == []


def test_a_rank_that_raises_ends_the_job_in_bounded_time_with_one_line(workdir):
    env = env_with_cwd(workdir, GRPO_TEST_FAIL_RANK="1")
    env["PYTHONPATH"] = os.pathsep.join([str(workdir / "inject"), env["PYTHONPATH"]])
    started = time.time()
    failed = train(workdir, "raises", "trainer.steps=20", env=env)
    took = time.time() - started
    assert failed.returncode == 1, failed.stderr[-3000:]
    assert "grpo train: error: rank 1: RuntimeError: injected failure in the update" in failed.stderr
    assert "rank 1 exited with exit code 1" in failed.stderr
    assert "Traceback" not in failed.stderr
    assert "rank 0:" not in failed.stderr  # rank 0's lost connection is a consequence: in its log only
    assert "injected failure" in (run_dir_of(workdir / "raises") / "train-rank1.log").read_text()
    assert took < 200  # rank 0 waited in a collective: stopped by the launcher, not by the 600 s timeout
    assert workers_left(str(workdir / "raises")) == []
