"""rollout.placement=split (tier 3: minutes): `grpo train` as 2 processes, rank 0 trains and rank 1 samples
ahead with a vLLM engine on the shipped model, against one process sampling the same batches; 1 trainer + 2
generators and 2 trainers + 1 generator against it; each kind of rank SIGKILLed and the job resumed; the job over
two simulated nodes; a generator rank that fails as it starts; the channel's waits on each side. The one-process K=1 runs are in tests/test_async.py; the two files are apart so
that the suite's two workers can run them side by side.
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
WALL_CLOCK = ("time/", "elapsed_s", "tokens_per_s", "memory/", "dist/collective_s")


def logged(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if not any(w in k for w in WALL_CLOCK)}
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def final(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(run_dir / "checkpoints" / "final" / "model.safetensors")


# Split placement (2 processes: rank 0 trains, rank 1 generates), on the shipped model with a vLLM engine.
SPLIT = ["recipe=bike_pricing", "trainer.steps=3", "rollout.prompts_per_step=4", "rollout.group_size=4",
         "eval.num_problems=8", "eval.every=3", "checkpoint.every=0", "rollout.push_check_every=1",
         "trainer.lr=1e-3", "rollout.max_staleness=1", "rollout.enforce_eager=true",
         "trainer.mismatch_correction=none",  # tis (K > 0's default) would read the engine's logprobs, see below
         "trainer.threads=1"]  # one thread a rank and in the one process, on any number of cores (0 takes a share)
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1"}


def grpo_train(out: Path, *extra: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "grpo_cli", "train", *SPLIT, f"output_dir={out}", *extra],
                          cwd=REPO, capture_output=True, text=True, timeout=600, env=env or ONE_THREAD)


@pytest.fixture(scope="module")
def split_run(tmp_path_factory) -> Path:
    """The uninterrupted split job (K=1, 3 steps): its run directory."""
    out = tmp_path_factory.mktemp("split")
    split = grpo_train(out, "rollout.placement=split", "dist.nproc_per_node=2")
    assert split.returncode == 0, split.stderr[-3000:]
    assert "rank 0 trains, rank 1 generates" in split.stdout
    (split_dir,) = (out / "bike_pricing").iterdir()
    return split_dir


def test_a_split_job_trains_as_one_process_with_the_same_schedule(tmp_path, split_run):
    """K=1 with rollout.placement=split (the generator rank samples while the trainer rank steps, the weights
    go over the channel tensor by tensor, the push check re-scores on the generator) against one process of
    one thread sampling the same batches after each update: each rank has one thread too, so every logged
    value but the engine's sampling logprobs (another process's vLLM) and the final weights are the same bits."""
    one = grpo_train(tmp_path / "one", "rollout.overlap=off")
    assert one.returncode == 0, one.stderr[-3000:]
    split_dir = split_run
    (one_dir,) = (tmp_path / "one" / "bike_pricing").iterdir()
    assert (split_dir / "train-rank1.log").is_file()
    steps = logged(split_dir)
    assert [m["step"] for m in steps] == [0, 1, 2, 3] and all(m["push_check/max_abs_diff"] < 1e-3 for m in steps[1:])
    assert [m["rollout/staleness"] for m in steps[1:]] == [0, 1, 1]
    ones = logged(one_dir)
    # vLLM's sampling logprobs, computed in another process, agree to ~1e-8 rather than in every bit; the trained
    # values do not read them without a mismatch correction (SPLIT sets none)
    mismatch = [(m.pop("mismatch/mean_abs_logprob", 0.0), o.pop("mismatch/mean_abs_logprob", 0.0))
                for m, o in zip(steps, ones)]
    assert all(abs(m - o) < 1e-6 for m, o in mismatch), mismatch
    assert steps == ones
    a, b = final(split_dir), final(one_dir)
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)


def test_a_split_job_over_two_simulated_nodes_with_a_run_root_each_resumes_to_the_one_node_job(tmp_path, split_run):
    """Two launchers on this machine (dist.nnodes=2, one process each: node 0's rank trains, node 1's generates,
    the generator starting from the base as a node without the trainer's files would), each with its own
    output_dir as two machines would have, and node 1 running grpo_cli installed elsewhere (its builtin:bike_base
    is its own copy's): node 0's rank SIGKILLed after the step-2 checkpoint, then the same command plus
    resume=auto on both nodes (node 1's disk holds no checkpoint; rank 0 decides, issue 54) ends with the
    one-node job's bits."""
    import shutil
    import socket

    elsewhere = tmp_path / "elsewhere"  # node 1's install: `python -m grpo_cli` imports the package in its cwd
    for part in ("grpo_cli", "recipes"):
        shutil.copytree(REPO / part, elsewhere / part, ignore=shutil.ignore_patterns("__pycache__"))

    def start_nodes(*extra: str) -> list[subprocess.Popen]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        return [subprocess.Popen([sys.executable, "-m", "grpo_cli", "train", *SPLIT, f"output_dir={tmp_path / f'node{r}'}",
                                  "rollout.placement=split", "dist.nnodes=2", f"dist.node_rank={r}",
                                  f"dist.rdzv_endpoint=127.0.0.1:{port}", "checkpoint.every=2", *extra],
                                 cwd=REPO if r == 0 else elsewhere,
                                 env=ONE_THREAD, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for r in (0, 1)]

    nodes = start_nodes()
    deadline, marker = time.time() + 600, None
    while time.time() < deadline and nodes[0].poll() is None and marker is None:
        marker = next(iter((tmp_path / "node0").glob("bike_pricing/*/checkpoints/step_000002/checkpoint.json")), None)
        time.sleep(0.05)
    assert marker is not None, "no checkpoint at step 2 appeared"
    pid = rank_pid(str(tmp_path / "node0"), 0)
    assert pid is not None, "no trainer rank found"
    os.kill(pid, signal.SIGKILL)
    outputs = [node.communicate(timeout=300) for node in nodes]
    assert nodes[0].returncode == 1 and nodes[1].returncode != 0, [err[-2000:] for _, err in outputs]
    run_dir = marker.parents[2]
    assert not (run_dir / "checkpoints" / "final").exists()
    assert not list((tmp_path / "node1").glob("bike_pricing/*/checkpoints"))  # the generator's node saves none

    nodes = start_nodes("resume=auto")
    outputs = [node.communicate(timeout=600) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], [err[-2000:] for _, err in outputs]
    assert f"resumed from {run_dir}" in outputs[0][0] and "at step 2" in outputs[0][0]
    generator_log = (tmp_path / "node1" / "bike_pricing" / run_dir.name / "train-rank1.log").read_text()
    assert f"the engine starts from {elsewhere / 'grpo_cli' / 'models' / 'bike_base'} " in generator_log
    assert logged(run_dir) == logged(split_run)
    a, b = final(run_dir), final(split_run)
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)


def rank_pid(marker: str, rank: int) -> int | None:
    """The pid of the job's worker of this rank: a process with `marker` (its output directory) on its command
    line and RANK in its environment (the launcher sets none)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if marker in args and f"RANK={rank}".encode() in env and any(e.startswith(b"LOCAL_RANK=") for e in env):
            return int(pid)
    return None


def kill_after_step_2(out: Path, ranks: list[str], victim: int) -> tuple[Path, str]:
    """Start the split job of `ranks` (its dist / rollout.generator_ranks overrides) with a checkpoint every 2 steps,
    SIGKILL rank `victim` once the step-2 checkpoint is complete (the batch of step 3, sampled ahead, saved in it),
    and check that the job ends within a minute with the launcher's line naming the rank and leaves no process.
    Returns the run directory and the job's console output."""
    args = [sys.executable, "-m", "grpo_cli", "train", *SPLIT, f"output_dir={out}", "rollout.placement=split",
            *ranks, "checkpoint.every=2"]
    proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ONE_THREAD)
    deadline, marker = time.time() + 600, None
    while time.time() < deadline and proc.poll() is None and marker is None:
        marker = next(iter(out.glob("bike_pricing/*/checkpoints/step_000002/checkpoint.json")), None)
        time.sleep(0.05)
    assert marker is not None, "no checkpoint at step 2 appeared"
    pid = rank_pid(str(out), victim)
    assert pid is not None, f"no rank {victim} found"
    os.kill(pid, signal.SIGKILL)
    killed = time.time()
    console, err = proc.communicate(timeout=300)
    assert proc.returncode == 1 and time.time() - killed < 60, err[-3000:]
    assert f"grpo train: error: rank {victim} exited with signal SIGKILL" in err
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(out) not in ps  # no rank left behind
    run_dir = marker.parents[2]
    assert not (run_dir / "checkpoints" / "final").exists()
    return run_dir, console


def resume(out: Path, ranks: list[str]) -> None:
    resumed = grpo_train(out, "rollout.placement=split", *ranks, "checkpoint.every=2", "resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout and "at step 2" in resumed.stdout


def test_a_split_job_with_its_trainer_killed_stops_at_once_and_resumes_bit_exactly(tmp_path, split_run):
    """SIGKILL of the trainer rank after the step-2 checkpoint: the job ends within seconds with a line naming the
    rank, leaves no process, and `resume=auto` finishes with the uninterrupted job's weights and every logged
    value (issue 39)."""
    out = tmp_path / "killed"
    run_dir, _ = kill_after_step_2(out, ["dist.nproc_per_node=2"], victim=0)
    resume(out, ["dist.nproc_per_node=2"])
    assert logged(run_dir) == logged(split_run)
    a, b = final(run_dir), final(split_run)
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)


def test_two_generators_sample_what_one_does_and_a_killed_one_resumes_on_one(tmp_path, split_run):
    """1 trainer + 2 generator ranks at K=1 (each generator samples its half of every step's prompts from the
    prompts' own seeds, the weights reach both in one broadcast): generator rank 2 SIGKILLed after the step-2
    checkpoint ends the job naming it; resumed with one generator (the number of generators may change on
    resume), the job ends with every logged value and the weights of the uninterrupted 1 + 1 job, bit for bit."""
    out = tmp_path / "two_generators"
    run_dir, console = kill_after_step_2(out, ["dist.nproc_per_node=3", "rollout.generator_ranks=2"], victim=2)
    assert "3 processes: rank 0 trains, ranks 1-2 generate" in console
    assert (run_dir / "train-rank2.log").is_file()
    steps = logged(run_dir)
    assert steps == logged(split_run)[:len(steps)] and [m["step"] for m in steps] == [0, 1, 2]
    resume(out, ["dist.nproc_per_node=2"])
    assert logged(run_dir) == logged(split_run)
    a, b = final(run_dir), final(split_run)
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)


def test_two_trainers_beside_a_generator_train_as_two_colocated_ranks(tmp_path, split_run):
    """2 trainer ranks (FSDP2 between them) + 1 generator at K=1: the same samples as the 1 + 1 job (every reward
    logged equal) and the weights of a colocated job of two ranks, bit for bit (against one trainer they differ
    as any 2-rank FSDP2 job's do: the float sums' order). A killed rank and the resume are the 1 + 1 job's and
    the 1 + 2 job's tests above; the sharded checkpoint of two trainer ranks resumes in tests/test_distributed.py."""
    colocated = grpo_train(tmp_path / "colocated", "dist.nproc_per_node=2")
    assert colocated.returncode == 0, colocated.stderr[-3000:]
    (colocated_dir,) = (tmp_path / "colocated" / "bike_pricing").iterdir()
    two = grpo_train(tmp_path / "two_trainers", "rollout.placement=split", "dist.nproc_per_node=3")
    assert two.returncode == 0, two.stderr[-3000:]
    assert "3 processes: ranks 0-1 train (FSDP2), rank 2 generates" in two.stdout
    (run_dir,) = (tmp_path / "two_trainers" / "bike_pricing").iterdir()
    assert logged(run_dir) == logged(colocated_dir)
    a, b = final(run_dir), final(colocated_dir)
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    rewards = [{k: v for k, v in m.items() if k.startswith(("reward", "groups/", "completion_len"))}
               for m in logged(split_run)]
    assert rewards == [{k: v for k, v in m.items() if k.startswith(("reward", "groups/", "completion_len"))}
                       for m in logged(run_dir)]


def running(pid: int) -> bool:
    """Whether process `pid` still runs (a zombie waiting for its parent to reap it does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def test_a_kill_9_of_the_launcher_takes_every_trainer_and_generator_rank_with_it(tmp_path):
    """SIGKILL of the launcher of a 1 trainer + 2 generators job once it trains: every rank (each started in a
    session of its own by torchrun's agent) dies with it (PR_SET_PDEATHSIG), none is left running."""
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "grpo_cli", "train", *SPLIT, f"output_dir={out}",
                             "rollout.placement=split", "dist.nproc_per_node=3", "rollout.generator_ranks=2",
                             "trainer.steps=50"], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=ONE_THREAD)
    deadline, metrics = time.time() + 300, None
    while time.time() < deadline and proc.poll() is None and metrics is None:
        metrics = next(iter(out.glob("bike_pricing/*/metrics.jsonl")), None)
        time.sleep(0.1)
    assert metrics is not None, "the job never started training"
    ranks = [rank_pid(str(out), r) for r in range(3)]
    assert None not in ranks, ranks
    proc.kill()
    proc.wait()
    deadline = time.time() + 30
    while time.time() < deadline and any(map(running, ranks)):
        time.sleep(0.1)
    assert not [pid for pid in ranks if running(pid)]
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(out) not in ps


# Fault injection: the generator rank's engine raises as it starts
GENERATOR_FAILS = '''
import os
if os.environ.get("RANK") == "1":
    import grpo_cli.engines.vllm as _vllm
    def broken(self, *args, **kwargs):
        raise RuntimeError("injected failure in the generator")
    _vllm.VLLMEngine.__init__ = broken
'''


def test_a_generator_rank_that_raises_stops_the_job_with_one_line(tmp_path):
    (tmp_path / "inject").mkdir()
    (tmp_path / "inject" / "sitecustomize.py").write_text(GENERATOR_FAILS)
    env = {**ONE_THREAD, "PYTHONPATH": os.pathsep.join([str(tmp_path / "inject"), os.environ.get("PYTHONPATH", "")])}
    started = time.time()
    failed = grpo_train(tmp_path / "out", "rollout.placement=split", "dist.nproc_per_node=2", env=env)
    assert failed.returncode == 1, failed.stderr[-3000:]
    assert "grpo train: error: generator rank 1: RuntimeError: injected failure in the generator" in failed.stderr
    assert "Traceback" not in failed.stderr and "trainer rank 0" not in failed.stderr  # the trainer's is a consequence
    assert time.time() - started < 200
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(tmp_path / "out") not in ps  # no rank left behind


# The two ends of a split job's channel with a 1 s dist.timeout_s, as two plain processes (no engine, no training).
CHANNEL_ENDS = """
import sys, time
from grpo_cli.dist import channel

rank = int(sys.argv[1])
line = channel.connect(rank, 1, 2, 1).channels[0]
if rank == 0:  # the trainer: busy 3 s (an update, a checkpoint) before its next call, then waits on an answer
    time.sleep(3)
    line.send("generate")
    try:
        line.recv()
    except RuntimeError as e:
        print("trainer: no answer within dist.timeout_s" if "Timed out" in str(e) else f"trainer: {e}")
else:  # the generator: idle 3 s, then slower than the trainer's timeout to answer
    started = time.time()
    print(f"generator: got {line.recv()!r} after {time.time() - started:.0f} s")
    time.sleep(3)
    try:
        line.send("rollouts")
    except RuntimeError:
        print("generator: the trainer is gone")
"""


def test_an_idle_generator_waits_past_dist_timeout_and_the_trainer_does_not(tmp_path):
    """The generator rank waits on the trainer however long it works (with a 1 s dist.timeout_s it would have
    raised after 1 s and taken the job down: issue 39); the trainer still names a generator that does not answer
    within dist.timeout_s, and the generator then learns the trainer is gone instead of waiting on."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "ends.py"
    script.write_text(CHANNEL_ENDS)
    env = {**ONE_THREAD, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2"}
    ends = [subprocess.Popen([sys.executable, str(script), str(r)], cwd=REPO, env={**env, "RANK": str(r)},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    (trainer, trainer_err), (generator, generator_err) = [end.communicate(timeout=120) for end in ends]
    assert [end.returncode for end in ends] == [0, 0], (trainer_err[-2000:], generator_err[-2000:])
    assert trainer.strip() == "trainer: no answer within dist.timeout_s"
    assert generator.splitlines() == ["generator: got 'generate' after 3 s", "generator: the trainer is gone"]
