"""Reading a finished `grpo train` run back: its one run directory under an output folder, and its
logged rows. Shared by the multi-process test files (plain functions, not fixtures; pytest puts
tests/ on the import path because it has no __init__.py)."""

from __future__ import annotations

import json
from pathlib import Path


def run_dir_of(out: Path, task: str = "bike_pricing") -> Path:
    dirs = [d for d in (out / task).iterdir() if d.is_dir()]
    assert len(dirs) == 1, dirs
    return dirs[0]


def metrics_of(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
