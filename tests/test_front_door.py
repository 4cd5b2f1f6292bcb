"""The front door as a newcomer meets it (issue 65): every mistake before the first step is one line on stderr,
exit 2, printed once, with the full key path and a did-you-mean from the right schema; recipes load by path; a
broken recipe harms only the command that names it. Tier 2, in process: no model loads.
"""

from __future__ import annotations

import pytest
from conftest import REPO


def one_line_error(out, command: str = "check") -> str:
    """The single stderr line of a refused command (exit 2, no traceback, nothing on stdout), without its prefix."""
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert "Traceback" not in out.stderr + out.stdout and out.stdout.strip() == "", out.stdout
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith(f"grpo {command}: error: ")
    return lines[0][len(f"grpo {command}: error: "):]


@pytest.mark.parametrize(("override", "expected"), [
    ("rewards=[{name:correct,wieght:1}]", "unknown key 'rewards[0].wieght' (did you mean 'weight'?)"),
    ("rewards=[{name:correct},{name:format,wieght:1}]", "unknown key 'rewards[1].wieght' (did you mean 'weight'?)"),
    ("rollout.tools=[{function:calculator,timout_s:1}]", "unknown key 'rollout.tools[0].timout_s' (did you mean "
                                                         "'timeout_s'?)"),
])
def test_a_typo_inside_a_list_item_names_its_path_and_the_items_fields(cli, override, expected):
    """Before: `unknown key 'wieght'` with no path, and the tools typo suggested dist.timeout_s."""
    line = one_line_error(cli("check", "recipe=bike_pricing", override))
    assert line.startswith(expected), line
    assert "dist.timeout_s" not in line


@pytest.mark.parametrize(("override", "ours", "theirs"), [
    ("num_generations=8", "rollout.group_size", "TRL's num_generations"),
    ("rollout.n=8", "rollout.group_size", "verl's"),
    ("beta=0.04", "trainer.kl_coef", "TRL's beta"),
    ("epsilon=0.2", "trainer.clip_eps", "TRL's epsilon"),
    ("max_completion_length=256", "rollout.max_new_tokens", "TRL's max_completion_length"),
    ("learning_rate=1e-6", "trainer.lr", "TRL's learning_rate"),
    ("clip_ratio=0.2", "trainer.clip_eps", "verl's clip_ratio"),
])
def test_a_peer_trainers_name_points_at_ours(cli, override, ours, theirs):
    line = one_line_error(cli("check", "recipe=bike_pricing", override))
    assert f"did you mean '{ours}'? it is {theirs}" in line, line


def test_a_key_in_the_wrong_section_is_pointed_at_its_section(cli):
    line = one_line_error(cli("check", "recipe=bike_pricing", "kl_coef=0.1"))
    assert "did you mean 'trainer.kl_coef'?" in line, line


@pytest.mark.parametrize("override", ["trainer.kl_coef=0,0.02", "recipe=bike_pricing,countdown"])
def test_a_sweep_without_m_is_one_line_saying_add_m(cli, override):
    """Before: Hydra's six-line 'Ambiguous value' message, exit 1."""
    args = ["recipe=bike_pricing", override] if not override.startswith("recipe=") else [override]
    line = one_line_error(cli("check", *args))
    assert "a comma-separated value is a sweep: add -m" in line and override in line, line


def test_a_bad_cfg_value_is_one_line_not_argparses_usage(cli):
    line = one_line_error(cli("check", "recipe=bike_pricing", "--cfg", "jobb"))
    assert "invalid choice: 'jobb'" in line and "'job'" in line, line


def test_check_with_m_leaves_nothing_in_the_working_directory(cli, tmp_path):
    out = cli("check", "-m", "recipe=bike_pricing", "trainer.kl_coef=0,0.02", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("grpo check: bike_pricing") == 2
    assert list(tmp_path.iterdir()) == []


MINE = "task: mine\nrewards:\n  - name: correct\nrollout:\n  group_size: 4\n"


def test_a_recipe_loads_by_relative_or_absolute_path(cli, tmp_path):
    """Before: 'unknown recipe' for recipe=./mine.yaml and recipe=/abs/mine.yaml."""
    (tmp_path / "mine.yaml").write_text(MINE)
    for recipe in ("./mine.yaml", "mine.yaml", str(tmp_path / "mine.yaml")):
        out = cli("train", f"recipe={recipe}", "--cfg", "job", cwd=tmp_path)
        assert out.returncode == 0, (recipe, out.stderr)
        assert "task: mine" in out.stdout and "group_size: 4" in out.stdout
    line = one_line_error(cli("check", "recipe=./missing.yaml", cwd=tmp_path))
    assert line.startswith("recipe file './missing.yaml' not found"), line


def test_an_unknown_recipe_name_says_how_a_file_is_named(cli):
    line = one_line_error(cli("check", "recipe=mine"))
    assert "recipe=./mine.yaml" in line and "$GRPO_RECIPE_PATH" in line, line


def test_a_broken_recipe_on_the_path_harms_only_the_command_naming_it(cli, tmp_path):
    """Before: one malformed YAML anywhere on $GRPO_RECIPE_PATH broke every command."""
    (tmp_path / "broken.yaml").write_text("task: [oops\n")
    (tmp_path / "mine.yaml").write_text(MINE)
    env = {"GRPO_RECIPE_PATH": str(tmp_path)}
    assert cli("check", "recipe=bike_pricing", env=env).returncode == 0
    assert cli("train", "recipe=mine", "--cfg", "job", env=env).returncode == 0
    line = one_line_error(cli("check", "recipe=broken", env=env))
    assert line.startswith("recipe 'broken': cannot read") and "broken.yaml" in line, line


def test_a_typo_in_a_recipe_files_list_item_names_its_index(cli, tmp_path):
    (tmp_path / "typo.yaml").write_text("task: t\nrewards:\n  - name: correct\n  - name: format\n    wieght: 2\n")
    line = one_line_error(cli("check", "recipe=typo.yaml", cwd=tmp_path))
    assert line.startswith("recipe 'typo': unknown key 'rewards[1].wieght' (did you mean 'weight'?)"), line


def test_every_shipped_recipe_has_a_run_folder_of_its_own():
    """Two GPU recipes shared `task: bike_pricing`, so their runs landed beside the CPU recipe's, and resume=auto
    could pick another recipe's run."""
    from omegaconf import OmegaConf

    tasks = {path.stem: OmegaConf.load(path).task for path in sorted((REPO / "recipes").glob("*.yaml"))}
    assert len(set(tasks.values())) == len(tasks), tasks


def test_a_hub_model_recipe_passes_check_without_the_hub(cli):
    """`grpo check recipe=gsm8k_tools` exited 2 ('the tokenizer has no chat template'): a hub id was read as a
    local folder. What needs the hub is reported as not checked."""
    out = cli("check", "recipe=gsm8k_tools")
    assert out.returncode == 0, out.stderr
    assert "not checked: hub id Qwen/Qwen2.5-1.5B-Instruct" in out.stdout


def test_a_trl_style_reward_is_refused_at_load_saying_what_grpo_calls(cli, tmp_path):
    """Before: `f(prompts, completions, **kw)` loaded, then failed on every sample at call time."""
    (tmp_path / "trl_rewards.py").write_text(
        "def length(prompts, completions, **kwargs):\n    return [float(len(c)) for c in completions]\n")
    line = one_line_error(cli("check", "recipe=bike_pricing", "rewards=[{name:trl_rewards:length}]", cwd=tmp_path))
    assert "takes (prompts, completions, ...), as a TRL reward does" in line, line
    assert "grpo calls f(completions, **columns)" in line, line


REFUSED_BY_BOTH = [
    ("data.source=/nonexistent/rows.jsonl", "data.source: file '/nonexistent/rows.jsonl' not found"),
    ("model.name_or_path=/nonexistent/model", "model.name_or_path: model '/nonexistent/model' does not exist"),
    ("rewards=[{name:nope}]", "unknown reward 'nope'"),
    ("rollout.tools=[{function:nope_tool}]", "rollout.tools[0].function: unknown tool 'nope_tool'"),
    ("data.template=chat", "data.template: chat, and builtin:bike_base's tokenizer has no chat template"),
]


@pytest.mark.parametrize(("override", "expected"), REFUSED_BY_BOTH)
def test_check_refuses_what_train_refuses(cli, override, expected):
    """`grpo check` exited 0 on each of these; it now runs the run's own pre-run check (preflight.preflight)."""
    line = one_line_error(cli("check", "recipe=bike_pricing", override))
    assert expected in line, line


@pytest.mark.parametrize(("override", "expected"), REFUSED_BY_BOTH[1:])
def test_train_refuses_at_the_pre_run_check_once_and_leaves_no_run_directory(cli, tmp_path, override, expected):
    """Before: the line was printed twice (a log line on stdout too), each refusal left an empty
    runs/TASK/TIME/, and data.template=chat on a model without a chat template was a 31-line traceback."""
    line = one_line_error(cli("train", "recipe=bike_pricing", f"output_dir={tmp_path / 'runs'}", override),
                          command="train")
    assert expected in line, line
    assert list(tmp_path.rglob("*")) in ([], [tmp_path / "runs"]), list(tmp_path.rglob("*"))


def test_eval_temperature_follows_the_training_temperature_unless_set():
    """Its comment said it follows the training temperature by default; with rollout.temperature=0.7 it stayed 1.0."""
    from grpo_cli.cli import load_config

    assert load_config("train", ["recipe=bike_pricing", "rollout.temperature=0.7"]).eval.temperature == 0.7
    assert load_config("train", ["recipe=bike_pricing", "rollout.temperature=0.7",
                                 "eval.temperature=0.2"]).eval.temperature == 0.2
    assert load_config("train", ["recipe=bike_pricing"]).eval.temperature == 1.0


def test_a_null_column_and_a_zero_start_timeout_are_named_as_they_are(cli, tmp_path):
    """A row whose answer is null was reported as having no 'answer' column while listing it among the columns
    present; distill.server_start_timeout_s=0 named distill.request_timeout_s."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(f'{{"question": "{i} + 1?", "answer": "{i + 1}"}}\n' for i in range(30))
                    + '{"question": "2 + 2?", "answer": null}\n')
    line = one_line_error(cli("check", "recipe=bike_pricing", f"data.source={rows}", "data.num_heldout=5",
                              "eval.num_problems=5"))
    assert "its 'answer' is null" in line, line
    line = one_line_error(cli("check", "recipe=bike_pricing_distill", "distill.server_start_timeout_s=0"))
    assert line.startswith("distill.server_start_timeout_s: must be > 0"), line


def test_merge_says_what_is_wrong_with_its_own_arguments(cli, tmp_path):
    """`grpo merge checkpoint=/x` said the path 'holds no adapter_config.json' when it does not exist, and `grpo
    merge` alone said 'set it in the recipe', though merge takes none."""
    line = one_line_error(cli("merge", f"checkpoint={tmp_path / 'x'}", f"out={tmp_path / 'merged'}"), "merge")
    assert line == f"checkpoint '{tmp_path / 'x'}' does not exist", line
    line = one_line_error(cli("merge"), "merge")
    assert "set it on the command line" in line and "recipe" not in line, line


def test_check_warns_of_each_setting_that_waits_for_another():
    """grpo check's 'settings that do nothing' missed these six; the shipped recipes set none of them in vain."""
    from grpo_cli.check import unused_settings
    from grpo_cli.cli import available_recipes, load_config

    cfg = load_config("check", ["recipe=bike_pricing", "rollout.max_sampling_rounds=2", "model.lora.alpha=8",
                                "rollout.lora_push=merged", "distill.objective=distill", "data.instruction=hi",
                                "rollout.max_turns=3"])
    assert unused_settings(cfg) == [
        "rollout.max_sampling_rounds: unused without rollout.dynamic_sampling=true",
        "model.lora.alpha: unused without model.lora.rank", "rollout.lora_push: unused without model.lora.rank",
        "distill.objective: unused without distill.teacher", "data.instruction: unused without data.template=chat",
        "rollout.max_turns: unused without rollout.tools or rollout.environment"]
    assert all(unused_settings(load_config("check", [f"recipe={r}"])) == [] for r in available_recipes())


def test_command_help_shows_every_key_with_its_comment_and_the_list_items_fields(cli):
    """`grpo train --help` promised every key with its default but showed `rewards: []` and `tools: []` and none of
    the schema's comments."""
    out = cli("train", "--help")
    assert out.returncode == 0, out.stderr
    assert "rewards[i].weight=1.0  # weight of this function in the summed reward" in out.stdout
    assert "rollout.tools[i].timeout_s=" in out.stdout and "rollout.tools[i].sandbox=auto  # " in out.stdout
    assert "trainer.kl_coef=" in out.stdout and "  # " in out.stdout.split("trainer.kl_coef=")[1].splitlines()[0]


# ---------------------------------------------------------------------------
# library output and an unreachable hub


@pytest.mark.parametrize("args", [["reward", "recipe=bike_pricing", f"cases={REPO / 'recipes/bike_pricing_cases.jsonl'}"],
                                  ["export", "recipe=bike_pricing", "data.num_train=40", "data.num_heldout=8",
                                   "eval.num_problems=8"]])
def test_every_command_silences_the_libraries_before_it_runs(cli, monkeypatch, tmp_path, args):
    """Before: only train and eval did, so `grpo reward recipe=bike_pricing_rm` showed transformers' loading bar."""
    import grpo_cli.cli.app

    calls = []
    monkeypatch.setattr(grpo_cli.cli.app, "quiet_third_party", calls.append)
    out = cli(*args, *([f"out={tmp_path}"] if args[0] == "export" else []))
    assert out.returncode == 0, out.stderr
    assert calls == [False]  # once, silenced (logging.verbose_libraries=false)
    assert cli(*args, "logging.verbose_libraries=true", *([f"out={tmp_path}"] if args[0] == "export" else [])
               ).returncode == 0 and calls == [False, True]


@pytest.fixture
def unreachable_hub(monkeypatch):
    """A hub endpoint that refuses connections, and this process's hub state restored afterwards."""
    import huggingface_hub.constants

    from grpo_cli import hub

    monkeypatch.setattr(hub, "_settled", None)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: nothing listens there
    for name in hub.OFFLINE_ENV:
        monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv(name, "")  # set, so that monkeypatch restores it after go_offline()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    import datasets.config

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", False)
    return hub


def test_an_unreachable_hub_is_one_quick_line_and_the_cache_only(cli, unreachable_hub, caplog):
    """Before: 13 hub-retry lines over 27 s, then the error. Now one probe, then the libraries read the cache."""
    import huggingface_hub.constants

    out = cli("export", "recipe=bike_pricing", "data.source=hub:someone/nothing-here", "data.num_heldout=8",
              "eval.num_problems=8", "out=unused")
    line = one_line_error(out, "export")
    assert line.startswith("data.source: cannot load hub dataset 'someone/nothing-here'"), line
    assert line.endswith("the hub (127.0.0.1) could not be reached within 3 s, so only the local cache was read"), line
    assert huggingface_hub.constants.HF_HUB_OFFLINE is True and all(
        __import__("os").environ[name] == "1" for name in unreachable_hub.OFFLINE_ENV)
    assert not [r for r in caplog.records if "Retrying" in r.getMessage()]


def test_a_users_offline_choice_is_not_probed(monkeypatch, unreachable_hub):
    import grpo_cli.hub as hub

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub, "_connects", lambda *a: pytest.fail("probed although the user chose offline"))
    assert hub.settle() == "" and hub.offline_note() == ""


def test_chat_format_tools_are_described_as_the_chat_template_shows_them(cli):
    """Before: `grpo check recipe=gsm8k_tools` printed the tag format's call string and result tags."""
    out = cli("check", "recipe=gsm8k_tools")
    assert out.returncode == 0, out.stderr
    tools = [line for line in out.stdout.splitlines() if line.strip().startswith("tools:")]
    assert tools == ["  tools: calculator, each shown to the model as a JSON schema through the chat template; "
                     "results go back as the template's tool messages"], tools
    assert "<calculator>" not in out.stdout and "<result>" not in out.stdout
    tagged = cli("check", "recipe=bike_pricing_tools")
    assert "  tools: calculator (<calc>...); results between '<result>' and '</result>'" in tagged.stdout


def test_the_docs_list_every_key_a_resume_may_change():
    """README and docs/checkpoints.md omitted rollout.placement and rollout.generator_ranks."""
    import re

    from grpo_cli.step.setup import RESUMABLE_CHANGES

    for page in ("README.md", "docs/checkpoints.md"):
        text = " ".join((REPO / page).read_text().split())
        listed = re.search(r"Only (`resume`, `output_dir`, )?`trainer\.steps`.*?may (change|differ)", text).group(0)
        for key in RESUMABLE_CHANGES[2:]:
            assert f"`{key}*`" in listed if key.endswith(".") else f"`{key}`" in listed, (page, key, listed)


def test_the_readme_names_every_shipped_recipe():
    text = " ".join((REPO / "README.md").read_text().split())
    shipped = text[text.index("Shipped: "):].split(". docs/rewards.md")[0]
    for path in sorted((REPO / "recipes").glob("*.yaml")):
        assert f"`{path.stem}`" in shipped, path.stem


# ---------------------------------------------------------------------------
# one page of figures


def _figures_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("figures", REPO / "scripts" / "figures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readme_states_the_default_runs_figures_as_docs_figures_does():
    import re

    rows = {m.group(1): m.groups() for m in re.finditer(
        r"^\| `(\w+)` \| (\d+) \((\d+) x (\d+)\) \| ([^|]+) \| ([^|]+) \| ([\d.]+) \| ([\d.]+) -> ([\d.]+) ",
        (REPO / "docs" / "figures.md").read_text(), re.M)}
    _, steps, prompts, group, _, _, step_s, start, end = rows["bike_pricing"]
    readme = " ".join((REPO / "README.md").read_text().split())
    assert (f"{steps} steps of {prompts} prompts x {group} samples" in readme and f"({step_s} s a step)" in readme
            and f"held-out pass@1 from {start} to {end}" in readme), (steps, step_s, start, end)
    _, _, _, _, wall, _, _, start, end = rows["bike_pricing_tools"]  # README's tool table: the same run
    assert f"one sample each at T=1 ({wall.strip()})" in readme, wall
    assert re.search(rf"\| sampled pass@1 \| {start} \|[^\n]*\| {end} \|", readme), (start, end)


def test_the_figures_script_reads_a_run(tmp_path):
    import json

    figures = _figures_script()
    run = tmp_path / "2026-01-02_03-04-05_123-abcd"
    (run / ".hydra").mkdir(parents=True)
    (run / "config.yaml").write_text("task: bike_pricing\nrollout:\n  prompts_per_step: 8\n  group_size: 4\n")
    (run / ".hydra" / "overrides.yaml").write_text("- recipe=bike_pricing\n- trainer.steps=3\n")
    rows = [{"step": 0, "eval/pass@1": 0.25}, {"step": 1, "time/step": 2.0, "elapsed_s": 2.0},
            {"step": 2, "time/step": 4.0, "elapsed_s": 6.0, "eval/pass@1": 0.5},
            {"step": 3, "time/step": 3.0, "elapsed_s": 9.0, "eval/pass@1": 0.5}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    import os
    import time

    end = time.mktime(time.strptime("2026-01-02 03:05:15", "%Y-%m-%d %H:%M:%S"))
    os.utime(run / "metrics.jsonl", (end, end))
    os.utime(run / "config.yaml", (end - 60, end - 60))
    os.utime(run / ".hydra" / "overrides.yaml", (end - 60, end - 60))
    got = figures.summarise(run)
    assert (got["steps"], got["wall_s"], got["training_s"], got["median_step_s"]) == (3, 70.0, 9.0, 3.0)
    assert (got["start"], got["end"], got["best"], got["overrides"]) == ((0, 0.25), (3, 0.5), (2, 0.5),
                                                                         ["trainer.steps=3"])
    page = figures.page([got], "python scripts/figures.py X")
    assert ("| `bike_pricing` (trainer.steps=3) | 3 (8 x 4) | 1 min 10 s | 0 min 09 s | 3.00 | 0.250 -> 0.500 (0.500 at "
            "step 2) |") in page
