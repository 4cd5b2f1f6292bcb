"""A cgroup per sandboxed call: its memory (swap and tmpfs included), its process count and a CPU quota, and
the one sweeper of stale per-process folders (docs/sandbox.md).
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo_cli.tools.uids import kill_until_gone

# account and no group has, leased per call (a uid mapped to no one owns no file, and no key, of the host)
CGROUP_FS = Path("/sys/fs/cgroup")

@dataclass(frozen=True)
class Limits:
    wall_s: float  # wall time of the whole call, then every process in it is killed
    memory_bytes: int  # all the call's processes together (cgroup), swap and its tmpfs files included
    processes: int  # at once, the first one included (cgroup pids)
    cpus: float = 1.0  # CPU time per wall-clock second, all its processes together (cgroup cpu quota): a call

def _own_cgroups() -> dict[str, str]:
    """/proc/self/cgroup as {controller: path}; cgroup v2's line is under the key ""."""
    out = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for name in controllers.split(",") if controllers else [""]:
            out[name] = path
    return out

def _v2_mount() -> Path | None:
    """Where the cgroup v2 hierarchy is mounted (/sys/fs/cgroup, or /sys/fs/cgroup/unified on a hybrid host)."""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        if right.split(" ")[0] == "cgroup2":
            return Path(left.split(" ")[4])
    return None

def sweep_stale(parent: Path, prefix: str, remove: Callable[[Path], Any]) -> None:
    """The one sweeper of per-process folders: `parent`'s entries named `{prefix}PID-...` whose creating process is
    gone (a tool worker killed on its timeout mid-call), removed with `remove` (a call's cgroup: rmdir, once its
    processes are gone; a `sandbox: none` home: rmtree). One that fails is left to the next sweep."""
    for d in parent.glob(f"{prefix}*-*"):
        pid = d.name[len(prefix):].split("-")[0]
        if pid.isdigit() and int(pid) != os.getpid() and not Path(f"/proc/{pid}").exists():  # not ours: left
            try:
                remove(d)
            except OSError:
                pass

CGROUP_PREFIX = "grpo-sandbox-"  # a call's cgroup: grpo-sandbox-PID-NS

def _remove_orphans(parent: Path) -> None:
    """Empty call cgroups left by a process that died mid-call: their names carry the creator's pid."""
    sweep_stale(parent, CGROUP_PREFIX, Path.rmdir)

CONTROLLERS = ("memory", "pids", "cpu")  # what a call's cgroup limits: its memory, its processes, its CPU share

CPU_PERIOD_US = 100_000  # the cpu controller's accounting period; a call's quota is Limits.cpus of it

@functools.cache
def _cgroup_parents() -> tuple[int, dict[str, Path]]:
    """(cgroup version, {controller: the folder the calls' cgroups go in}), read once per process: v2 (one folder
    for all three) where this process's cgroup delegates memory, pids and cpu, else v1 (a folder per
    controller's hierarchy)."""
    own = _own_cgroups()
    mount = _v2_mount()
    parent = mount / own.get("", "/").lstrip("/") if mount is not None else None
    if parent is not None and set(CONTROLLERS) <= set((parent / "cgroup.subtree_control").read_text().split()
                                                      if (parent / "cgroup.subtree_control").exists() else []):
        return 2, {c: parent for c in CONTROLLERS}
    if all((CGROUP_FS / c).is_dir() and c in own for c in CONTROLLERS):
        return 1, {c: CGROUP_FS / c / own[c].lstrip("/") for c in CONTROLLERS}
    raise OSError("no cgroup with the memory, pids and cpu controllers that this process may create (cgroup v2 "
                  "needs them delegated, e.g. a systemd scope with Delegate=yes)")

class CallGroup:
    """The cgroup(s) of one call, under _cgroup_parents(): one folder (v2), or one in each of the memory, pids
    and cpu hierarchies (v1)."""

    def __init__(self, limits: Limits):
        name = f"{CGROUP_PREFIX}{os.getpid()}-{time.monotonic_ns()}"
        self.version, parents = _cgroup_parents()
        self.by_controller = {c: parent / name for c, parent in parents.items()}
        self.dirs = list(dict.fromkeys(self.by_controller.values()))
        made = []
        try:
            for d in self.dirs:
                _remove_orphans(d.parent)
                d.mkdir()  # PermissionError / OSError: the caller reports it
                made.append(d)
            quota_us = max(int(limits.cpus * CPU_PERIOD_US), 1000)  # the kernel's floor is 1 ms
            if self.version == 2:
                self._write("memory", "memory.max", limits.memory_bytes)
                self._write("memory", "memory.swap.max", 0)
                self._write("pids", "pids.max", limits.processes)
                self._write("cpu", "cpu.max", f"{quota_us} {CPU_PERIOD_US}")
            else:
                self._write("memory", "memory.limit_in_bytes", limits.memory_bytes)
                if (self.by_controller["memory"] / "memory.memsw.limit_in_bytes").exists():  # swap accounting on
                    self._write("memory", "memory.memsw.limit_in_bytes", limits.memory_bytes)
                self._write("pids", "pids.max", limits.processes)
                self._write("cpu", "cpu.cfs_period_us", CPU_PERIOD_US)
                self._write("cpu", "cpu.cfs_quota_us", quota_us)
        except OSError:
            self.dirs = made
            self.remove()
            raise

    def _write(self, controller: str, name: str, value: int | str) -> None:
        (self.by_controller[controller] / name).write_text(str(value))

    def join_prefix(self) -> list[str]:
        """A shell that moves itself into the call's cgroup(s) and then execs the command, so the first process
        of the call, and all it forks, are inside before any model code runs."""
        moves = " && ".join(f"echo $$ > '{d / 'cgroup.procs'}'" for d in self.dirs)
        return ["/bin/sh", "-c", f"{moves} && exec \"$@\"", "sh"]

    def oom_killed(self) -> bool:
        memory = self.by_controller["memory"]
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        for line in (memory / name).read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value) > 0
        return False

    def pids(self) -> list[int]:
        """The processes still in the call's cgroup(s); none once they are gone (removed under us included)."""
        found: set[int] = set()
        for d in self.dirs:
            try:
                found.update(int(p) for p in (d / "cgroup.procs").read_text().split())
            except FileNotFoundError:
                pass
        return sorted(found)

    def kill_all(self, wait_s: float = 2.0) -> None:
        """SIGKILL every process still in the call's cgroup, until it is empty (or wait_s passes)."""
        kill_until_gone(self.pids, wait_s)

    def remove(self) -> None:
        for d in self.dirs:
            for _ in range(200):  # a killed process leaves its cgroup a moment after it is reaped
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.005)
