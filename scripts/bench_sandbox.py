"""Benchmark: what one call of the built-in `python` tool costs, in its sandbox and without (docs/sandbox.md).

    python scripts/bench_sandbox.py               # 40 calls each (about 10 s on 2 cores)
    python scripts/bench_sandbox.py --calls 100 --out sandbox.json
    python scripts/bench_sandbox.py --concurrent   # calls against each other (issue 64)

Calls the tool as a run with `timeout_s: null` does (in this process, no worker), on a program that prints
one line, after 3 calls not counted: the median and the 90th percentile of the wall time per call, sandboxed
(bwrap, the namespaces, the call's cgroup) and with `sandbox: none`. The sandbox's own share is the
difference. The figure the sandbox aims at (issue 53): a median of at most 40 ms a call.

--concurrent measures calls against each other (issue 64): a harmless call that spends about 0.3 s of CPU,
alone and while another call runs 31 busy processes (its cgroup's CPU quota keeps them to one CPU; the aim:
within 1.5x of its time alone), and 16 harmless calls at once (all answer, each as a uid of its own where the
trainer is root). No assertion on timings: a measuring tool, not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
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


HARMLESS = "n = 0\nfor i in range(2_000_000):\n    n += i\nprint(n)"
HOG = """import os, time
end, busy = time.monotonic() + 6, 0
while True:  # as many busy processes as its pids limit (32, bwrap's two included) allows
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        while time.monotonic() < end:
            pass
        os._exit(0)
    busy += 1
for _ in range(busy):
    os.wait()
print(busy)
"""


def harmless_seconds(repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        assert python(HARMLESS) == str(sum(range(2_000_000)))
        times.append(time.perf_counter() - started)
    return times


def concurrent_figures(repeats: int) -> dict:
    """A harmless call's time alone and beside a hog of 31 busy processes; 16 calls at once."""
    python(HARMLESS)  # warm
    alone = statistics.median(harmless_seconds(repeats))
    hogged: list[str] = []
    hog = threading.Thread(target=lambda: hogged.append(python(HOG)))
    hog.start()
    time.sleep(1.0)  # its processes running
    beside = statistics.median(harmless_seconds(repeats))
    hog.join()
    started = time.perf_counter()
    with ThreadPoolExecutor(16) as pool:
        uids = list(pool.map(lambda _: python("import os, time; time.sleep(0.5); print(os.getuid())"), range(16)))
    at_once_s = time.perf_counter() - started
    return {"hog_busy_processes": int(hogged[0]), "harmless_alone_s": round(alone, 3),
            "harmless_beside_hog_s": round(beside, 3),
            "slowdown": round(beside / alone, 2), "sixteen_at_once_s": round(at_once_s, 2),
            "sixteen_answered": len(uids), "sixteen_distinct_uids": len(set(uids))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=40, help="timed calls per mode")
    parser.add_argument("--out", type=Path, help="also write the figures here as JSON")
    parser.add_argument("--concurrent", action="store_true", help="calls against each other instead (issue 64)")
    args = parser.parse_args()
    if (why := sandbox.problem()) is not None:
        raise SystemExit(f"the sandbox cannot be made here: {why}")
    figures = {}
    if args.concurrent:
        figures = concurrent_figures(repeats=5)
        print(", ".join(f"{k} {v}" for k, v in figures.items()))
        if args.out:
            args.out.write_text(json.dumps(figures, indent=2) + "\n")
        return
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
