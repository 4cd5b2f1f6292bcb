"""On-policy distillation (docs/distillation.md): the teacher checked before any model loads, and the update
pulling the student towards it (tier 1: CPU, seconds; the loss's arithmetic is in test_loss_variants.py)."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

from grpo_cli.cli import load_config
from grpo_cli.config import ConfigError, DistillConfig
from grpo_cli.errors import UsageError
from grpo_cli.preflight import preflight

BIKE = ["recipe=bike_pricing"]


def test_distill_settings_are_checked_with_their_key():
    with pytest.raises(ConfigError, match=r"^distill.objective: 'kd' is not one of distill, grpo\+distill"):
        DistillConfig(teacher="builtin:bike_base", objective="kd")
    with pytest.raises(ConfigError, match=r"^distill.coef: must be > 0"):
        DistillConfig(coef=0.0)
    with pytest.raises(UsageError, match=r"distill.objective: distill trains on every group.*filter_zero_variance"):
        load_config("train", [*BIKE, "distill.teacher=builtin:bike_base", "distill.objective=distill",
                              "trainer.filter_zero_variance=true"])
    assert DistillConfig().loss_objective == "grpo"  # no teacher: plain GRPO whatever the objective says
    assert DistillConfig(teacher="t", objective="distill").loss_objective == "distill"


def test_a_teacher_is_refused_before_any_model_loads_with_one_line_naming_it(tmp_path):
    """preflight checks distill.teacher (preflight.check_teacher): its files, a causal LM, the student's tokenizer."""
    from grpo_cli.preflight import check_teacher
    from grpo_cli.weights.checkpoint import load_tokenizer, resolve_model_path

    with pytest.raises(UsageError, match=r"^distill.teacher: no built-in model 'bike_teacherx'"):
        preflight(load_config("train", [*BIKE, "distill.teacher=builtin:bike_teacherx"]))
    student = resolve_model_path("builtin:bike_base")
    tokenizer = load_tokenizer(student)
    with pytest.raises(UsageError) as err:  # another task's model: its own tokenizer
        check_teacher("builtin:countdown_base", "builtin:bike_base", tokenizer)
    assert str(err.value) == ("distill.teacher: its tokenizer differs from the student's (vocabularies of 512 and 350 "
                              "tokens; token 258 is 'Ġd' in the student's, 'on' in the teacher's): student "
                              "builtin:bike_base, teacher builtin:countdown_base; distillation across tokenizers is "
                              "not supported")
    classifier = tmp_path / "classifier"  # a classifier with the student's own tokenizer: not a causal LM
    shutil.copytree(student, classifier)
    config = json.loads((classifier / "config.json").read_text())
    (classifier / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen2ForSequenceClassification"]}))
    with pytest.raises(UsageError, match=r"^distill.teacher: .*classifier is not a causal LM "
                                         r"\(Qwen2ForSequenceClassification\)"):
        check_teacher(str(classifier), "builtin:bike_base", tokenizer)
    task = preflight(load_config("train", [*BIKE, "distill.teacher=builtin:bike_base"]))
    assert task.teacher_path == task.model_path


def run_distill_steps(teacher: torch.nn.Module, steps: int) -> tuple[list[dict], list[float], torch.nn.Module]:
    """`steps` pure-distillation updates of a fresh tiny student on one synthetic batch, plain SGD, no KL: each
    update's stats, and the mean |student - teacher logprob| over the batch's tokens before each and after the last."""
    from test_stages import loop_cfg, stage_state, synthetic_groups, tiny_policy

    from grpo_cli.dist import Dist
    from grpo_cli.step.batch import TrainBatch
    from grpo_cli.step.update import batch_logprobs, fill_logprobs, loss_params, update

    cfg = loop_cfg(3, micro_batch_size=64, lr=0.2)
    cfg.distill = DistillConfig(teacher="given", objective="distill")
    policy = tiny_policy()
    optimizer = torch.optim.SGD(policy.parameters(), lr=cfg.trainer.lr)
    state = stage_state(policy=policy, optimizer=optimizer, teacher=teacher.eval().requires_grad_(False),
                        scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0))
    groups, params, stats, gaps = synthetic_groups(), loss_params(cfg), [], []
    batch = TrainBatch.build(groups, 0, cfg.trainer, Dist(), params)

    def gap() -> float:
        (student,), (taught,) = (batch_logprobs(m, batch, 1024, 1.0) for m in (policy, teacher))  # [b, Tc] each
        (mb,) = batch.micro_batches
        return float(((student - taught).abs() * mb.mask).sum() / mb.mask.sum())

    for _ in range(steps):
        gaps.append(gap())
        batch = TrainBatch.build(groups, 0, cfg.trainer, Dist(), params)
        fill_logprobs(state, batch, groups, cfg)
        stats.append(update(state, batch, params, cfg))
    return stats, [*gaps, gap()], policy


def test_pure_distillation_pulls_the_student_towards_the_teacher_and_a_copy_of_itself_leaves_it_alone():
    """Each token's advantage pushes the student's logprob towards the teacher's, so on the batch's tokens the
    gap shrinks step after step; with the student's own weights as teacher every advantage is 0 and the
    update moves nothing."""
    from test_stages import tiny_policy

    stats, gaps, _ = run_distill_steps(tiny_policy(seed=1), steps=5)
    assert all(b < a for a, b in zip(gaps, gaps[1:])) and gaps[-1] < 0.5 * gaps[0], gaps
    assert all("distill/reverse_kl" in s and "distill/reverse_kl_per_seq" in s for s in stats)
    (same,), _, student = run_distill_steps(tiny_policy(seed=0), steps=1)
    assert same["distill/reverse_kl"] == 0.0 and same["distill/reverse_kl_per_seq"] == 0.0
    assert all(a.equal(b) for a, b in zip(student.state_dict().values(), tiny_policy(seed=0).state_dict().values()))


def test_the_teachers_heldout_pass_at_1_is_measured_on_the_teacher_itself():
    """train.teacher_heldout samples the held-out problems from distill.teacher, not from the policy: the shipped
    model passes some, the same model with its weights scrambled none; without a teacher there is no line. (The
    vLLM engine's path, the teacher's weights pushed in and the policy's back: test_engine.py.)"""
    from test_stages import stage_state

    from grpo_cli.engines.hf import HFEngine
    from grpo_cli.step.heldout import HeldoutSet
    from grpo_cli.train import teacher_heldout
    from grpo_cli.weights.checkpoint import load_policy

    cfg = load_config("train", [*BIKE, "distill.teacher=builtin:bike_base", "rollout.max_new_tokens=48"])
    task = preflight(cfg)
    heldout = HeldoutSet.build(task.heldout_rows[:24], task.encode, task.reward_fns, cfg.data)
    teacher = load_policy(task.teacher_path, "float32").eval()
    scrambled = load_policy(task.teacher_path, "float32").eval()
    with torch.no_grad():
        for p in scrambled.parameters():
            p.copy_(p[torch.randperm(p.shape[0], generator=torch.Generator().manual_seed(0))])
    policy = load_policy(task.model_path, "float32")  # on the transformers engine: the teacher gets its own engine
    run = {"task": task, "heldout": heldout, "policy": policy, "engine": HFEngine(policy, task.tokenizer)}
    good = teacher_heldout(stage_state(**run, teacher=teacher), cfg)["eval/teacher_pass@1"]
    bad = teacher_heldout(stage_state(**run, teacher=scrambled), cfg)["eval/teacher_pass@1"]
    assert good > 0.1 and bad == 0.0, (good, bad)
    assert teacher_heldout(stage_state(**run), cfg) == {}


# ---------------------------------------------------------------------------- a served teacher


def test_a_served_teacher_is_refused_with_its_key_when_it_cannot_grade():
    with pytest.raises(ConfigError, match=r"^distill.server: needs distill.teacher too"):
        DistillConfig(server="start")
    with pytest.raises(ConfigError, match=r"^distill.server: 'localhost:8000' is neither start nor an http"):
        DistillConfig(teacher="t", server="localhost:8000")
    with pytest.raises(UsageError, match=r"distill.server: a served teacher's logprobs are of its untempered "
                                         r"distribution, and rollout.temperature is 0.7"):
        load_config("train", [*BIKE, "distill.teacher=builtin:bike_base", "distill.server=start",
                              "rollout.temperature=0.7"])
    with pytest.raises(UsageError, match=r"distill.server: start runs the teacher's server on this node's loopback"):
        load_config("train", [*BIKE, "distill.teacher=builtin:bike_base", "distill.server=start", "dist.nnodes=2",
                              "dist.nproc_per_node=1"])
    with pytest.raises(UsageError, match=r"^distill.server: http://127.0.0.1:9 does not answer as a vLLM server "
                                         r"\(URLError"):
        preflight(load_config("train", [*BIKE, "distill.teacher=builtin:bike_base",
                                        "distill.server=http://127.0.0.1:9"]))


def test_a_served_teachers_grades_are_read_off_the_prompt_logprobs_of_the_whole_sample():
    from grpo_cli.rewards.teacher import completion_grades

    choice = {"prompt_logprobs": [None, {"60": {"logprob": -8.7, "rank": 152}}, {"70": {"logprob": -8.0, "rank": 3},
                                                                                 "71": {"logprob": -0.1, "rank": 1}},
                                  {"80": {"logprob": -7.1, "rank": 85}}]}
    assert completion_grades(choice, [5, 60, 70, 80], 2) == [-8.0, -7.1]  # the sampled token's, not the top one
    with pytest.raises(KeyError):
        completion_grades(choice, [5, 60, 71, 81], 2)  # a token the server did not grade: never a default
    with pytest.raises(ValueError, match="3 prompt logprobs for 4 tokens"):
        completion_grades({"prompt_logprobs": choice["prompt_logprobs"][:3]}, [5, 60, 70, 80], 2)


@pytest.mark.slow
def test_a_teacher_served_by_a_real_vllm_server_grades_as_the_teacher_in_process(tmp_path):
    """distill.server=URL: a vLLM server on the shipped model (started as `distill.server=start` starts one) grades
    every sampled token as the same model in this process does (within 1e-4; 1e-7 seen), a run graded by it
    trains as with the teacher in process (its reverse KL ~0 at step 1, where the student is the teacher), and
    closing the server grpo started leaves no process."""
    from test_stages import loop_cfg, synthetic_groups

    from grpo_cli import train
    from grpo_cli.dist import Dist
    from grpo_cli.engines.served import Placement
    from grpo_cli.rewards.teacher import start_server
    from grpo_cli.step.batch import TrainBatch
    from grpo_cli.step.update import batch_logprobs, loss_params
    from grpo_cli.weights.checkpoint import load_policy, resolve_model_path

    path = resolve_model_path("builtin:bike_base")
    served = start_server(path, Placement("cpu", "float32", 1.0), 512, tmp_path / "server.log", 300, 60, 4)
    try:
        cfg = loop_cfg(3, micro_batch_size=5)
        groups = synthetic_groups()  # token ids < 40: any of them is a token of the shipped 512-token vocabulary
        batch = TrainBatch.build(groups, 0, cfg.trainer, Dist(), loss_params(cfg))
        here = batch_logprobs(load_policy(path, "float32").eval(), batch, 1024, 1.0)  # [b, Tc] per micro-batch
        there = served.grades(batch)
        assert len(here) == len(there) > 1
        for mb, a, b in zip(batch.micro_batches, here, there):
            assert (((a - b).abs() * mb.mask).max()) < 1e-4 and (b * (1 - mb.mask)).abs().max() == 0.0
        run = load_config("train", [*BIKE, "distill.teacher=builtin:bike_base", f"distill.server={served.url}",
                                    f"output_dir={tmp_path}", "rollout.engine=hf", "rollout.prompts_per_step=2",
                                    "rollout.group_size=4", "rollout.max_new_tokens=24", "trainer.steps=1",
                                    "eval.num_problems=4", "eval.every=0", "checkpoint.every=0"])
        assert train.run(run, tmp_path / "run") == 0
        step_1 = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()][1]
        assert abs(step_1["distill/reverse_kl"]) < 1e-6
        assert served.process.poll() is None  # a server given by URL is the user's: the run leaves it running
    finally:
        process = served.process
        served.close()
    assert process.poll() is not None


def test_grpo_check_counts_a_teacher_in_process_in_the_trainers_gpu_memory_and_a_served_one_nowhere():
    from grpo_cli.estimate import gpu_lines, model_shape, teacher_bytes, teacher_line

    def cfg(*extra: str):
        return load_config("train", [*BIKE, "model.dtype=bfloat16", "rollout.push_check_tol=0.05", *extra])

    shape = model_shape("builtin:bike_base")
    teacher = teacher_bytes(cfg("distill.teacher=builtin:bike_teacher"), 1)
    assert teacher == 1_116_800 * 2  # the shipped teacher's parameters in bf16 (its head is tied)
    assert teacher_bytes(cfg("distill.teacher=builtin:bike_teacher", "distill.server=start"), 1) == 0.0
    assert "served by a vLLM server grpo starts for the run" in teacher_line(
        cfg("distill.teacher=builtin:bike_teacher", "distill.server=start"), 1)
    plain, taught = (gpu_lines(c, shape, 1)[0] for c in (cfg(), cfg("distill.teacher=builtin:bike_teacher")))
    assert "reference + teacher" in taught and "reference + teacher" not in plain
    big = cfg("distill.teacher=Qwen/Qwen2.5-0.5B-Instruct")  # a hub teacher grpo check knows the shape of

    def updating_gib(line: str) -> float:
        return float(re.search(r"the trainer holds ([0-9.]+) GiB while it updates", line).group(1))

    assert updating_gib(gpu_lines(big, shape, 1)[0]) - updating_gib(plain) == pytest.approx(
        teacher_bytes(big, 1) / 2**30, abs=0.1) and teacher_bytes(big, 1) > 2**29
