"""scripts/toy_grpo.py: the lesson's one-parameter GRPO policy runs and learns."""

import importlib.util
import math
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "toy_grpo.py"


@pytest.fixture(scope="module")
def toy():
    spec = importlib.util.spec_from_file_location("toy_grpo", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


START = 1 / (1 + math.exp(1.5))  # sigmoid(-1.5) = 0.182


def test_defaults_learn(toy, capsys):
    p = toy.main([])
    out = capsys.readouterr().out
    assert p > 0.95 > START  # seed 0: 0.182 -> 0.981
    steps = [line.split()[1] for line in out.splitlines() if line.startswith("step")]
    assert steps == ["1", "10", "20", "30", "40"]
    assert "P(correct)=0.182" in out.splitlines()[0]
    assert f"final P(correct)={p:.3f}" in out and "skipped groups=13/40" in out


def test_group_size_two_skips_more(toy, capsys):
    p = toy.main(["--group-size", "2"])
    out = capsys.readouterr().out
    assert START < p
    skipped = int(out.split("skipped groups=")[1].split("/")[0])
    assert skipped > 13  # pairs are often all-right or all-wrong


def test_no_std_runs_and_learns(toy, capsys):
    p = toy.main(["--no-std"])
    assert START < p < toy.main([])  # r - mean takes smaller steps than std-scaled advantages here
    assert "final P(correct)" in capsys.readouterr().out


def test_flags(toy, capsys):
    p = toy.main(["--theta", "0", "--lr", "0", "--steps", "3"])
    assert p == 0.5
    assert "skipped groups=" in capsys.readouterr().out
