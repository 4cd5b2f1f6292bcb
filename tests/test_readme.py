"""The README's CLI block runs as written: every `grpo` line composes and validates (train, eval and plot with
`--cfg job`, so nothing trains), and `check`, `reward`, `export` and the help lines run for real."""

from __future__ import annotations

import re
import shlex
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def cli_block_lines() -> list[str]:
    """The `grpo ...` commands of the README's "The CLI" section, comments dropped."""
    text = (REPO / "README.md").read_text()
    section = text.split("## The CLI", 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash", 1)[1].split("```", 1)[0]
    lines = [re.sub(r"\s+#.*$", "", line).strip() for line in block.splitlines()]
    commands = [line.removeprefix('eval "$(').removesuffix(')"') for line in lines]
    return [c for c in commands if c.startswith("grpo ")]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, shipped_model_dir) -> Path:
    """A run directory as `grpo train` leaves it: the resolved config and a final checkpoint."""
    from omegaconf import OmegaConf

    from grpo_cli.cli import load_config

    root = tmp_path_factory.mktemp("readme") / "runs" / "bike_pricing" / "2026-01-01_00-00-00_1-abcd"
    (root / "checkpoints").mkdir(parents=True)
    OmegaConf.save(OmegaConf.structured(load_config("train", ["recipe=bike_pricing"])), root / "config.yaml")
    shutil.copytree(shipped_model_dir, root / "checkpoints" / "final")
    (root / "checkpoints" / "final" / "checkpoint.json").write_text('{"step": 260, "eval/pass@1": 0.6}')
    return root


def test_the_readme_lists_every_command():
    commands = {line.split()[1] for line in cli_block_lines()}
    assert {"--help", "train", "check", "reward", "export", "eval", "plot", "-sc"} <= commands


@pytest.mark.parametrize("line", cli_block_lines())
def test_every_cli_line_of_the_readme_runs_as_written(line, cli, run_dir, tmp_path):
    args = shlex.split(line.replace("${RUN}", f"{run_dir}/").replace("$RUN", str(run_dir)))[1:]
    if args[0] in ("train", "eval", "plot") and "--help" not in args:
        args.append("--cfg=job")  # compose and validate; run nothing
    if "-m" in args:  # a sweep: compose its first job (Hydra's --cfg takes no -m)
        args = [a.split(",")[0] if "=" in a else a for a in args if a != "-m"]
    cwd = tmp_path if args[0] == "export" else REPO  # export writes problems/ where it runs
    out = cli(*args, cwd=cwd)
    assert out.returncode == 0, f"{line}: {out.stderr[-2000:]}"
    if args[0] == "export":
        assert (tmp_path / "problems" / "train.jsonl").is_file()


def test_the_readme_stays_a_short_users_document():
    """Details go to docs/, history to CHANGELOG.md: the README stays within 250 lines."""
    assert len((REPO / "README.md").read_text().splitlines()) <= 250
