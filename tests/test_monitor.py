"""Watching a run: metrics/completions JSONL and wandb offline (loggers.py), plain vs live console and the
summary (console.py), zero-variance warnings (watch.py), library quieting (runtime.py)."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from grpo_cli.config import LoggingConfig
from grpo_cli.report.console import PlainConsole, make_console, summary_lines
from grpo_cli.report.loggers import FanoutLogger, JsonlLogger, NullLogger, make_logger, wandb_mode
from grpo_cli.report.watch import ZeroVarianceWatch
from grpo_cli.runtime import QUIET_ENV

REPO = Path(__file__).resolve().parents[1]
ANSI = "\x1b["


def step_metrics(step: int, **extra: float) -> dict:
    """A metrics dict with every key the training loop logs each step."""
    m = {
        "step": step, "reward/mean": 0.5, "reward/std": 0.4, "reward/correct": 0.4, "reward/format": 0.9,
        "loss": 0.01, "kl": 0.002, "clip_frac": 0.01, "grad_norm": 0.7, "lr": 1e-4,
        "completion_len/mean": 21.5, "completion_len/max": 64, "truncation_rate": 0.05,
        "groups/all_correct_frac": 0.25, "groups/all_wrong_frac": 0.125, "tokens_per_s": 900.0,
        "time/generate": 1.0, "time/reward": 0.01, "time/logprobs": 0.2, "time/update": 0.8, "time/push": 0.1,
        "time/step": 2.11, "elapsed_s": 2.11 * step,
    }
    m.update(extra)
    return m


SAMPLES = [
    {"prompt": "Q: 3 bikes for 2 days?\n", "completion": "3*2=6 [b]\nAnswer: 6", "rewards": {"correct": 1.0, "format": 1.0},
     "advantage": 1.25},
    {"prompt": "Q: 1 bike for 1 day?\n", "completion": "no idea", "rewards": {"correct": 0.0, "format": 0.0},
     "advantage": -0.75},
]


# ---------------------------------------------------------------------------
# JSONL


def test_jsonl_logger_writes_one_object_per_step_and_samples(tmp_path):
    logger = JsonlLogger(tmp_path)
    for step in range(1, 4):
        logger.log(step_metrics(step), step)
        # flushed each line: readable while the run is still going
        assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == step
    logger.log_samples(SAMPLES, 3)
    logger.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert set(step_metrics(1)) <= set(rows[0])
    samples = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert len(samples) == 2 and samples[0]["step"] == 3
    assert samples[0]["completion"] == SAMPLES[0]["completion"] and samples[1]["rewards"] == {"correct": 0.0,
                                                                                           "format": 0.0}


def test_make_logger_without_wandb_is_jsonl_plus_null(tmp_path):
    logger = make_logger(LoggingConfig(), tmp_path, {"task": "t"})
    assert isinstance(logger, FanoutLogger)
    assert [type(x) for x in logger.loggers] == [JsonlLogger, NullLogger]
    logger.log({"loss": 1.0}, 0)
    logger.log_samples(SAMPLES, 0)
    logger.close()
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 0, "loss": 1.0}
    assert not (tmp_path / "wandb").exists()


# ---------------------------------------------------------------------------
# console


def test_plain_console_prints_one_plain_line_every_n_steps():
    out = io.StringIO()  # not a terminal -> plain
    console = make_console(total_steps=10, log_every=3, file=out)
    assert isinstance(console, PlainConsole)
    console.start()
    for step in range(1, 11):
        console.update(step_metrics(step))
    console.close()
    lines = out.getvalue().splitlines()
    assert ANSI not in out.getvalue() and "\r" not in out.getvalue()
    assert [line.split("|")[0].strip() for line in lines] == ["step  3/10", "step  6/10", "step  9/10", "step 10/10"]
    assert "reward 0.500 (correct 0.400, format 0.900)" in lines[0]
    for piece in ("kl 0.0020", "len 21.5/64", "all-wrong 0.12", "900 tok/s", "gen 1.0", "push 0.1", "eta "):
        assert piece in lines[0], piece


def test_plain_console_eval_step_samples_and_warnings_are_plain_lines():
    out = io.StringIO()
    console = make_console(total_steps=20, log_every=10, force_plain=True, file=out)
    console.start()
    console.update({"step": 0, "eval/pass@1": 0.125})  # the baseline evaluation
    console.update(step_metrics(3, **{"eval/pass@1": 0.25}))  # an eval step off the log_every grid still prints
    console.update(step_metrics(4))
    console.samples(SAMPLES, 4)
    console.warn("too hard: something")
    console.info("done")
    text = out.getvalue()
    assert ANSI not in text
    lines = text.splitlines()
    assert lines[0].startswith("step  0/20 | held-out pass@1 0.125")
    assert lines[1].startswith("step  3/20") and "held-out pass@1 0.250" in lines[1]
    assert lines[2] == "samples at step 4:"
    assert "adv +1.25" in lines[3] and "correct=1.00" in lines[3] and "\\nAnswer: 6" in lines[3]
    assert lines[5:] == ["warning: too hard: something", "done"]


def test_console_through_a_pipe_is_plain():
    code = (
        "from grpo_cli.report.console import make_console\n"
        "c = make_console(4, 2)\n"
        "c.start()\n"
        "for s in range(1, 5):\n"
        "    c.update({'step': s, 'reward/mean': 0.5, 'kl': 0.1, 'time/step': 1.0, 'time/generate': 0.5})\n"
        "c.warn('careful')\n"
        "c.close()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60,
                         env={**os.environ, "TERM": "xterm-256color", "FORCE_COLOR": "1"})
    assert out.returncode == 0, out.stderr
    assert ANSI not in out.stdout
    lines = out.stdout.splitlines()
    assert len(lines) == 3 and lines[2] == "warning: careful"
    assert lines[0].startswith("step 2/4 | reward 0.500") and lines[1].startswith("step 4/4 | reward 0.500")


def test_live_console_renders_progress_and_metrics_panel():
    out = io.StringIO()
    console = make_console(total_steps=5, log_every=1, force_plain=False, file=out)
    console.start()
    console.update({"step": 0, "eval/pass@1": 0.125})
    console.update(step_metrics(1, **{"eval/pass@1": 0.375}))
    console.update(step_metrics(2))  # no eval this step: the panel keeps the last measured value
    console.samples(SAMPLES, 2)
    console.warn("too easy: something")
    console.close()
    assert ANSI in out.getvalue()  # a terminal gets the rich view
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.getvalue())
    for piece in ("step", "2/5", "held-out pass@1", "0.375 (step 1)", "correct", "all-wrong groups", "12%",
                  "grad norm", "tokens/s", "generate 1.00s", "push 0.10s", "samples at step 2", "[b]",
                  "too easy: something"):
        assert piece in text, piece


# ---------------------------------------------------------------------------
# zero-variance warnings


def test_zero_variance_watch_warns_once_too_hard():
    watch = ZeroVarianceWatch(threshold=0.9, patience=3)
    messages = [watch.update(0.0, 0.95, 0.1, 0.2) for _ in range(10)]
    fired = [m for m in messages if m]
    assert len(fired) == 1 and messages[2] is fired[0]
    assert fired[0].startswith("too hard:") and "easier data" in fired[0] and "grpo reward" in fired[0]
    assert "max_new_tokens" in fired[0]


def test_zero_variance_watch_warns_once_too_easy_and_needs_consecutive_steps():
    watch = ZeroVarianceWatch(threshold=0.9, patience=3)
    assert watch.update(1.0, 0.0, 1.0, 0.0) is None
    assert watch.update(1.0, 0.0, 1.0, 0.0) is None
    assert watch.update(0.5, 0.0, 0.8, 0.3) is None  # the streak breaks
    messages = [watch.update(0.95, 0.0, 0.97, 0.1) for _ in range(6)]
    fired = [m for m in messages if m]
    assert len(fired) == 1 and messages[2] is fired[0]
    assert fired[0].startswith("too easy:") and "harder data" in fired[0] and "fewer trainer.steps" in fired[0]


def test_zero_variance_watch_zero_reward_is_too_hard_and_each_case_fires_once():
    watch = ZeroVarianceWatch(threshold=0.9, patience=2)
    assert watch.check({"step": 0, "eval/pass@1": 0.0}) is None  # eval-only rows are skipped
    zero = step_metrics(1, **{"reward/mean": 0.0, "reward/std": 0.0, "groups/all_correct_frac": 0.0,
                              "groups/all_wrong_frac": 1.0})
    messages = [watch.check(zero) for _ in range(5)]
    fired = [m for m in messages if m]
    assert len(fired) == 1 and fired[0].startswith("too hard: every sample scored reward 0")
    assert "`grpo reward" in fired[0]
    # later the model solves everything: the other case still gets its one warning
    easy = [watch.update(1.0, 0.0, 1.0, 0.0) for _ in range(5)]
    assert [m[:9] for m in easy if m] == ["too easy:"]
    assert [watch.update(0.0, 1.0, 0.0, 0.0) for _ in range(5)] == [None] * 5


def test_zero_variance_watch_rejects_bad_knobs():
    with pytest.raises(ValueError, match="threshold"):
        ZeroVarianceWatch(threshold=0.0)
    with pytest.raises(ValueError, match="patience"):
        ZeroVarianceWatch(patience=0)


def test_logging_config_has_the_knobs():
    cfg = LoggingConfig()
    assert cfg.zero_variance_threshold == 0.9 and cfg.zero_variance_patience == 10
    assert cfg.verbose_libraries is False


# ---------------------------------------------------------------------------
# summary and third-party quieting


def test_summary_lines_name_steps_time_pass_at_1_and_files(tmp_path):
    (tmp_path / "checkpoints" / "final").mkdir(parents=True)
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "metrics.png").write_bytes(b"png")
    history = [{"step": 0, "eval/pass@1": 0.1}, step_metrics(1), step_metrics(2, **{"eval/pass@1": 0.6}),
               step_metrics(3, **{"eval/pass@1": 0.5})]
    lines = summary_lines(history, tmp_path, wall_s=125.0)
    text = "\n".join(lines)
    assert lines[0].startswith("done: 3 steps in 2m05s")
    assert "0.100 at step 0 -> final 0.500 at step 3 | best 0.600 at step 2" in text
    assert f"checkpoints: {tmp_path / 'checkpoints'} (final)" in text
    assert str(tmp_path / "metrics.jsonl") in text and f"plot: {tmp_path / 'metrics.png'}" in text
    assert "not measured" in "\n".join(summary_lines([step_metrics(1)], tmp_path, 1.0))


def test_quiet_third_party_sets_env_and_respects_the_user_and_verbose():
    code = (
        "import json, logging, os\n"
        "from grpo_cli.runtime import QUIET_ENV, quiet_third_party\n"
        "quiet_third_party(verbose=True)\n"
        "untouched = {k: os.environ.get(k) for k in QUIET_ENV}\n"
        "quiet_third_party(verbose=False)\n"
        "print(json.dumps({'untouched': untouched, 'env': {k: os.environ.get(k) for k in QUIET_ENV},\n"
        "                  'vllm': logging.getLogger('vllm').level, 'tf': logging.getLogger('transformers').level}))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in QUIET_ENV}
    env["TRANSFORMERS_VERBOSITY"] = "info"  # set by the user: kept
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["untouched"] == {k: ("info" if k == "TRANSFORMERS_VERBOSITY" else None) for k in QUIET_ENV}
    assert result["env"] == {**QUIET_ENV, "TRANSFORMERS_VERBOSITY": "info"}
    assert result["vllm"] == result["tf"] == 40  # logging.ERROR


# ---------------------------------------------------------------------------
# wandb, for real, offline


def test_wandb_mode_is_offline_without_a_key(monkeypatch, tmp_path):
    for key in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    assert wandb_mode() == "offline"
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    (tmp_path / "netrc").chmod(0o600)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    assert wandb_mode() == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_mode() == "disabled"


def _wandb_records(path: Path) -> list:
    """The protobuf records of a .wandb file (LevelDB log format: 32 KiB blocks, 7-byte chunk headers)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, payloads, pending = 7, 32768, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # block trailer padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 1:  # full
            payloads.append(chunk)
        elif kind == 2:  # first
            pending = chunk
        elif kind == 3:  # middle
            pending += chunk
        elif kind == 4:  # last
            payloads.append(pending + chunk)
    records = []
    for payload in payloads:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        records.append(record)
    return records


def test_real_offline_wandb_run_records_metrics_config_and_samples(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    run_dir = tmp_path / "2026-01-01_00-00-00_1-abcd"
    run_dir.mkdir()
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / var.lower()))  # nothing lands in $HOME
    resolved = {"task": "bike_pricing", "rollout": {"group_size": 8}, "trainer": {"lr": 1e-4}}
    logger = make_logger(LoggingConfig(wandb=True, wandb_project="grpo-test"), run_dir, resolved)
    assert [type(x).__name__ for x in logger.loggers] == ["JsonlLogger", "WandbLogger"]
    assert logger.notes and "wandb sync" in logger.notes[0]
    logger.log({"eval/pass@1": 0.125}, 0)
    for step in (1, 2):
        logger.log(step_metrics(step, **({"eval/pass@1": 0.5} if step == 2 else {})), step)
    logger.log_samples(SAMPLES, 2)
    logger.close()

    offline = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(offline) == 1, list((run_dir / "wandb").iterdir())
    wandb_file = next(offline[0].glob("run-*.wandb"))
    # wandb's service process may still be writing the file when finish() returns: read it once it ends
    deadline = time.monotonic() + 30
    while True:
        records = _wandb_records(wandb_file)
        kinds = [r.WhichOneof("record_type") for r in records]
        if "exit" in kinds or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    history = [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"]
    metric_rows = [h for h in history if "samples/_type" not in h]
    assert [h["step"] for h in metric_rows] == [0, 1, 2]
    for key in step_metrics(1):
        assert metric_rows[1][key] == pytest.approx(step_metrics(1)[key]), key
    assert metric_rows[2]["eval/pass@1"] == 0.5 and metric_rows[0]["eval/pass@1"] == 0.125
    # the training step is every chart's x-axis
    metrics = [r.metric for r in records if r.WhichOneof("record_type") == "metric"]
    assert any(m.glob_name == "*" and m.step_metric == "step" for m in metrics)
    # the resolved config and the run's name
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    config = {u.key: json.loads(u.value_json) for u in run.config.update}
    assert config["rollout"] == {"group_size": 8} and config["task"] == "bike_pricing"
    assert run.display_name == run_dir.name and run.project == "grpo-test"
    # completions as a table
    table_rows = [h for h in history if h.get("samples/_type") == "table-file"]
    assert len(table_rows) == 1 and table_rows[0]["step"] == 2
    table = json.loads((offline[0] / "files" / table_rows[0]["samples/path"]).read_text())
    assert table["columns"] == ["step", "prompt", "completion", "advantage", "reward/correct", "reward/format"]
    assert table["data"][0][2] == SAMPLES[0]["completion"] and len(table["data"]) == 2
    assert "exit" in kinds
    # JSONL is written alongside
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 3
