"""The `grpo` CLI: help, version, errors, --cfg job, recipes, completion, run dirs.

Most checks call `grpo_cli.cli.main` in this process (`cli`); a few start `python -m grpo_cli` where only a
fresh interpreter tells (what gets imported, the one-line error contract of each command, two runs at once).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_cli import __version__
from grpo_cli.cli import available_recipes

REPO = Path(__file__).resolve().parents[1]


def grpo(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "grpo_cli", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, cwd=cwd or REPO, timeout=300)


def test_help_lists_commands_and_recipes(cli):
    out = cli("--help")
    assert out.returncode == 0
    for command in ("train", "eval", "reward", "export", "plot"):
        assert f"  {command} " in out.stdout
    assert "bike_pricing" in out.stdout


def test_version_is_the_projects(cli):
    out = cli("--version")
    assert out.returncode == 0
    assert out.stdout.strip() == f"grpo {__version__}"


def test_cfg_job_prints_resolved_config_with_overrides():
    out = grpo("train", "recipe=bike_pricing", "rollout.group_size=16", "trainer.lr=3e-6", "rewards=[{name:correct}]",
               "--cfg", "job")
    assert out.returncode == 0, out.stderr
    assert "rewards:\n- name: correct\n  weight: 1.0\n" in out.stdout  # a key that is also a subpackage's name
    assert "group_size: 16" in out.stdout
    assert "lr: 3.0e-06" in out.stdout
    assert "task: bike_pricing" in out.stdout


def test_cfg_job_imports_no_heavy_package():
    code = (
        "import sys\n"
        "from grpo_cli.cli import main\n"
        "try:\n"
        "    main(['train', 'recipe=bike_pricing', '--cfg', 'job'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "heavy = [m for m in ('torch', 'vllm', 'datasets', 'transformers') if m in sys.modules]\n"
        "print('HEAVY=' + ','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "HEAVY=\n" in out.stdout


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["recipe=bike_pricing", "trainer.lrr=1"], "unknown key 'trainer.lrr' (did you mean 'trainer.lr'?)"),
        (["recipe=bike_pricng"], "unknown recipe 'bike_pricng' (did you mean 'bike_pricing'?)"),
        ([], "no recipe given"),
        (["recipe=bike_pricing", "+trainer.foo=1"], "unknown key 'trainer.foo'"),
        (["recipe=bike_pricing", "+foo=1"], "unknown key 'foo'"),
        (["recipe=bike_pricing", "rollout.group_size=abc"], "rollout.group_size"),
        (["recipe=bike_pricing", "rollout.group_size=1"], "rollout.group_size: is 1"),
        (["recipe=bike_pricing", "task=???"], "'task' has no value"),
        (["recipe=bike_pricing", "rollout.engine=tgi"], "rollout.engine: 'tgi' is not one of vllm, hf"),
        (["recipe=bike_pricing", "rewards=[]"], "rewards: no reward functions"),
        (["recipe=bike_pricing", "trainer.lr=[1"], "no viable alternative"),
    ],
)
def test_bad_config_is_one_line_error(cli, args, expected):
    out = cli("train", *args)
    assert out.returncode == 2
    assert "Traceback" not in out.stderr + out.stdout
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("grpo train: error: ")
    assert expected in lines[0]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["train", "recipe=bike_pricing", "trainer.lrr=1"], "grpo train: error: unknown key 'trainer.lrr'"),
        (["eval"], "grpo eval: error: no checkpoint given"),
        (["check", "recipe=bike_pricing", "trainer.minibatches=9"], "grpo check: error: trainer.minibatches: 9 exceeds"),
        (["reward", "recipe=bike_pricing", "cases=/nonexistent/cases.jsonl"],
         "grpo reward: error: cases file '/nonexistent/cases.jsonl' not found"),
        (["export", "recipe=bike_pricing", "out=README.md", "data.num_train=10", "data.num_heldout=5",
          "eval.num_problems=5"],
         "grpo export: error: out: 'README.md' exists and is not a directory"),
        (["plot"], "grpo plot: error: no run given"),
    ],
)
def test_every_command_fails_in_one_line_from_a_fresh_interpreter(args, expected):
    """The contract, as a shell sees it: exit 2, one line on stderr, no traceback."""
    out = grpo(*args)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(expected) and "Traceback" not in out.stderr, out.stderr


def test_missing_recipe_lists_available(cli):
    out = cli("train")
    for name in available_recipes():
        assert name in out.stderr


def test_unknown_commands_and_eval_without_a_checkpoint(cli):
    out = cli("trian")
    assert out.returncode == 2 and "did you mean 'train'" in out.stderr
    out = cli("eval")  # without a checkpoint it says what to give, in one line
    assert out.returncode == 2 and out.stderr.strip() == (
        "grpo eval: error: no checkpoint given; set checkpoint=PATH (or latest|best|base with run=DIR) "
        "or checkpoints=[A,B]")


def test_every_shipped_recipe_composes_and_validates():
    from grpo_cli.cli import _compose_and_validate, _register
    from grpo_cli.config import TrainConfig

    _register("train")
    recipes = available_recipes()
    assert "bike_pricing" in recipes
    for name in recipes:
        config = _compose_and_validate("train", [f"recipe={name}"], None)
        assert isinstance(config, TrainConfig)
        assert config.rewards, name


def test_private_recipe_dir_from_environment(cli, tmp_path):
    (tmp_path / "my_task.yaml").write_text(
        "task: my_task\nrewards:\n  - name: correct\nrollout:\n  group_size: 4\n")
    out = cli("train", "recipe=my_task", "--cfg", "job", env={"GRPO_RECIPE_PATH": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    assert "task: my_task" in out.stdout and "group_size: 4" in out.stdout
    assert "my_task" in cli("--help").stdout


def test_recipe_with_unknown_key_names_it(cli, tmp_path):
    (tmp_path / "broken.yaml").write_text("task: broken\nrewards:\n  - name: correct\nrollout:\n  groupsize: 4\n")
    out = cli("train", "recipe=broken", env={"GRPO_RECIPE_PATH": str(tmp_path)})
    assert out.returncode == 2
    assert "rollout.groupsize" in out.stderr and "Traceback" not in out.stderr


def test_shell_completion_install_and_query():
    install = grpo("-sc", "install=bash")
    assert install.returncode == 0
    assert "complete" in install.stdout and "hydra_bash_completion" in install.stdout
    recipe = grpo("-sc", "query=bash", env={"COMP_LINE": "grpo train recipe=", "COMP_POINT": "18"})
    assert "recipe=bike_pricing" in recipe.stdout.split()
    nested = grpo("-sc", "query=bash", env={"COMP_LINE": "grpo train rollout.gr", "COMP_POINT": "21"})
    assert "rollout.group_size=" in nested.stdout.split()
    commands = grpo("-sc", "query=bash", env={"COMP_LINE": "grpo ", "COMP_POINT": "5"})
    assert set(commands.stdout.split()) >= {"train", "eval", "reward"}


def test_hydra_usage_error_is_one_line(cli):
    out = cli("train", "-m", "recipe=bike_pricing", "rollout.group_size=4,8", "--cfg", "job")
    assert out.returncode == 2
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_command_help_without_recipe(cli):
    out = cli("train", "--help")
    assert out.returncode == 0, out.stderr
    assert "recipe: bike_pricing" in out.stdout or "bike_pricing" in out.stdout


def test_run_dirs_are_unique_and_hold_config_overrides_and_log(tmp_path):
    """Two runs started together get two directories; a crash's traceback lands in the log file."""
    broken = tmp_path / "broken_model"  # passes the path checks, then fails inside transformers: a real crash
    broken.mkdir()
    (broken / "config.json").write_text("{ not json")
    (broken / "model.safetensors").write_bytes((2).to_bytes(8, "little") + b"{}")  # a whole, empty safetensors
    out_dir = tmp_path / "runs"
    args = ["train", "recipe=bike_pricing", f"output_dir={out_dir}", f"model.name_or_path={broken}"]
    procs = [subprocess.Popen([sys.executable, "-m", "grpo_cli", *args], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode != 0 for p in procs)
    run_dirs = sorted((out_dir / "bike_pricing").iterdir())
    assert len(run_dirs) == 2
    for run_dir in run_dirs:
        assert (run_dir / "config.yaml").is_file()
        assert f"model.name_or_path={broken}" in (run_dir / ".hydra" / "overrides.yaml").read_text()
        assert "Traceback" in (run_dir / "train.log").read_text()
    for _, stderr in results:
        assert "Traceback" not in stderr
        assert stderr.strip().splitlines()[-1].startswith("grpo train: error: ")
    assert not (REPO / "outputs").exists()


def test_sliding_window_model_is_refused_before_loading(cli, tmp_path):
    """The shared prompt pass cannot serve sliding-window layers: a one-line error before any model loads."""
    import json
    import shutil

    from grpo_cli.weights.checkpoint import resolve_model_path

    model = tmp_path / "sliding"
    shutil.copytree(resolve_model_path("builtin:bike_base"), model)
    config = json.loads((model / "config.json").read_text())
    config.update(use_sliding_window=True, sliding_window=8,
                  layer_types=["sliding_attention"] + config["layer_types"][1:])
    (model / "config.json").write_text(json.dumps(config))
    out = cli("train", "recipe=bike_pricing", f"output_dir={tmp_path / 'runs'}", f"model.name_or_path={model}")
    assert out.returncode == 2, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("grpo train: error: model.name_or_path: ") and "sliding-window" in last


def test_cwd_is_not_changed(cli, tmp_path):
    out = cli("train", "recipe=bike_pricing", f"output_dir={tmp_path}", "model.name_or_path=/nonexistent/model",
               cwd=tmp_path)
    assert out.returncode == 2
    assert "model.name_or_path: model '/nonexistent/model' does not exist" in out.stderr
    # refused at the pre-run check: its run directory is removed (issue 65), and nothing else was written into
    # the working directory
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_load_config_builds_the_typed_config_the_cli_would():
    from grpo_cli.cli import UsageError, load_config
    from grpo_cli.config import TrainConfig

    cfg = load_config("train", ["recipe=bike_pricing", "rollout.group_size=16"])
    assert isinstance(cfg, TrainConfig)
    assert cfg.rollout.group_size == 16 and cfg.task == "bike_pricing"
    with pytest.raises(UsageError, match="did you mean 'trainer.lr'"):
        load_config("train", ["recipe=bike_pricing", "trainer.lrr=1"])


def test_check_prints_the_batch_arithmetic_and_warns_about_settings_that_do_nothing(cli):
    code = (
        "import sys\n"
        "from grpo_cli.cli import main\n"
        "try:\n"
        "    main(sys.argv[1:])\n"
        "except SystemExit as e:\n"
        "    assert not e.code, e.code\n"
        "heavy = [m for m in ('vllm',) if m in sys.modules]\n"
        "print('HEAVY=' + ','.join(heavy))\n"
    )
    args = ["check", "recipe=bike_pricing", "trainer.ppo_epochs=2", "trainer.minibatches=2",
            "rollout.dynamic_sampling=true"]
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "8 prompts (up to 32 over 4 dynamic-sampling rounds) x 8 samples = 64 completions" in out.stdout
    assert "2 epoch(s) x 2 minibatch(es) = 4 per rollout batch, 1040 in 260 steps" in out.stdout
    assert "parameters -> policy + grads + AdamW" in out.stdout  # read off the shipped model's config.json
    # the run's pre-run check reads the tokenizer (transformers), never the weights or an engine
    assert "no setting without effect found" in out.stdout and "HEAVY=\n" in out.stdout

    two = cli("check", "recipe=bike_pricing", "dist.nproc_per_node=2")  # reads the process count, starts nothing
    assert two.returncode == 0, two.stderr
    assert "per rank (2): 4 prompts, 32 completions" in two.stdout
    ahead = cli("check", "recipe=bike_pricing", "rollout.max_staleness=2", "rollout.overlap=off")
    assert "the batch of step t is sampled from the weights after step t-1-2 (the start's for steps 1-3), after " \
           "the update" in ahead.stdout
    assert "off-policy" not in two.stdout
    split = cli("check", "recipe=bike_pricing", "rollout.placement=split", "dist.nproc_per_node=2",
                "rollout.max_staleness=1")
    assert split.returncode == 0, split.stderr
    assert "per rank (1): 8 prompts, 64 completions" in split.stdout  # the trainer rank takes every prompt
    assert "on the generator ranks while the trainers step; the engine does not sleep; " \
           "trainer.mismatch_correction=tis" in split.stdout  # auto: tis with stale samples
    assert "placement: split; 2 processes: rank 0 trains, rank 1 generates: the memory above is each trainer " \
           "rank's (alone, no FSDP2, no engine)" in split.stdout
    scaled = cli("check", "recipe=bike_pricing", "rollout.placement=split", "dist.nproc_per_node=4",
                 "rollout.generator_ranks=2")
    assert scaled.returncode == 0, scaled.stderr
    assert "per rank (2): 4 prompts, 32 completions" in scaled.stdout  # the prompts shared by the two trainers
    assert "4 processes: ranks 0-1 train (FSDP2), ranks 2-3 generate: the memory above is each trainer rank's " \
           "(FSDP2 over 2, no engine)" in scaled.stdout

    warned = cli("check", "recipe=bike_pricing", "trainer.policy_loss=gspo", "rollout.group_size=2")
    assert warned.returncode == 0, warned.stderr
    assert "trainer.policy_loss=gspo: with one optimizer step per batch the ratio is exactly 1" in warned.stdout
    assert "group_size=2 with trainer.advantage=group_std" in warned.stdout
    bad = cli("check", "recipe=bike_pricing", "trainer.minibatches=9")
    assert bad.returncode == 2 and "trainer.minibatches: 9 exceeds rollout.prompts_per_step=8" in bad.stderr
