"""Benchmark: what one call of the built-in `python` tool costs, in its sandbox and without (docs/sandbox.md).

    python scripts/bench_sandbox.py               # 40 calls each (about 10 s on 2 cores)
    python scripts/bench_sandbox.py --calls 100 --out sandbox.json

Calls the tool as a run with `timeout_s: null` does (in this process, no worker), on a program that prints
one line, after 3 calls not counted: the median and the 90th percentile of the wall time per call, sandboxed
(bwrap, the namespaces, the call's cgroup) and with `sandbox: none`. The sandbox's own share is the
difference. The figure the sandbox aims at (issue 53): a median of at most 40 ms a call. No assertion on
timings: a measuring tool, not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from grpo_cli.tools import sandbox
from grpo_cli.tools.builtin import python, python_unsandboxed

PROGRAM = "print(sum(range(1000)))"


def seconds_per_call(tool, calls: int) -> list[float]:
    for _ in range(3):
        tool(PROGRAM)
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        assert tool(PROGRAM) == "499500"
        times.append(time.perf_counter() - started)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=40, help="timed calls per mode")
    parser.add_argument("--out", type=Path, help="also write the figures here as JSON")
    args = parser.parse_args()
    if (why := sandbox.problem()) is not None:
        raise SystemExit(f"the sandbox cannot be made here: {why}")
    figures = {}
    for name, tool in (("sandboxed", python), ("unsandboxed", python_unsandboxed)):
        times = sorted(seconds_per_call(tool, args.calls))
        figures[name] = {"median_ms": round(1000 * statistics.median(times), 1),
                         "p90_ms": round(1000 * times[int(0.9 * (len(times) - 1))], 1), "calls": args.calls}
        print(f"{name:>11}: median {figures[name]['median_ms']:.1f} ms, p90 {figures[name]['p90_ms']:.1f} ms "
              f"({args.calls} calls)")
    if args.out:
        args.out.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
