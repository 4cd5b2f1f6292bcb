"""A host uid per call where the trainer is root: the spare uids, and a lease on one for as long as a call (or a
sandboxed worker) lives, so no per-uid kernel state is shared between calls (docs/sandbox.md).
"""

from __future__ import annotations

import fcntl
import functools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

SPARE_HOST_IDS = range(61000, 62000)  # where the trainer is root: the code's host uid and gid, one of these that no

@functools.cache
def spare_ids() -> tuple[int, ...] | None:
    """The host uids (each also the gid) a root trainer's calls may run as: those of SPARE_HOST_IDS that no
    account and no group has. None where the trainer is not root: bwrap's user namespace then maps the code to
    the trainer's own, unprivileged uid. OSError when none is spare."""
    if os.geteuid() != 0:
        return None
    import grp
    import pwd

    taken = {p.pw_uid for p in pwd.getpwall()} | {g.gr_gid for g in grp.getgrall()}
    spare = tuple(uid for uid in SPARE_HOST_IDS if uid not in taken)
    if not spare:
        raise OSError(f"no spare uid in {SPARE_HOST_IDS.start}-{SPARE_HOST_IDS.stop - 1} for the code to run as "
                      "(every one is an account or a group)")
    return spare

LEASE_DIR = Path("/run/grpo-sandbox")  # root's own (0700); the files are named by uid

LEASE_KILL_WAIT_S = 2.0  # how long a lease waits for a uid's leftover processes to die before it passes it over

def uid_processes(uid: int) -> list[int]:
    """The live host processes (of this PID namespace) with `uid` as any of their real, effective, saved or file
    uids; a zombie runs nothing and waits for its parent. Read from /proc/PID/status: a process that makes
    itself non-dumpable hides its uid from stat()."""
    found, wanted = [], str(uid).encode()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status", "rb") as f:
                for line in f:
                    if line.startswith(b"State:") and line.split()[1] == b"Z":
                        break
                    if line.startswith(b"Uid:"):
                        if wanted in line.split()[1:]:
                            found.append(int(name))
                        break
        except OSError:  # gone meanwhile
            pass
    return found

def kill_until_gone(listed: Callable[[], list[int]], wait_s: float) -> bool:
    """SIGKILL every process `listed()` names until it names none (True), or `wait_s` passes (False)."""
    deadline = time.monotonic() + wait_s
    while pids := listed():
        if time.monotonic() > deadline:
            return False
        for pid in pids:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        time.sleep(0.005)
    return True

def _kill_uid(uid: int, wait_s: float) -> bool:
    """SIGKILL every process of `uid` until none is left (True), or `wait_s` passes (False)."""
    return kill_until_gone(lambda: uid_processes(uid), wait_s)

@dataclass
class UidLease:
    """A spare host uid held by this process for one call (or one sandboxed worker's life)."""

    uid: int
    fd: int  # the lease file, flock-ed; closing it gives the uid back

    def give_back(self) -> None:
        """Free the uid once no process of it is left (it is marked to be cleaned by its next holder if one
        would not die). Called after the call's cgroup is empty."""
        if self.fd < 0:
            return
        if _kill_uid(self.uid, LEASE_KILL_WAIT_S):
            os.pwrite(self.fd, b"0", 0)
        os.close(self.fd)
        self.fd = -1

def _lease_dir() -> Path:
    LEASE_DIR.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(LEASE_DIR)
    import stat

    if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022:
        raise OSError(f"{LEASE_DIR} is not a folder of root's that only root may write")
    return LEASE_DIR

def _try_lease(folder: Path, uid: int) -> UidLease | None:
    """The lease of `uid` if no one holds it and nothing of it is left running (its leftovers killed first)."""
    fd = os.open(folder / str(uid), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    # "1": its last holder died holding it, or could not kill all of it: its leftovers go first
    if os.pread(fd, 1, 0) == b"1" and not _kill_uid(uid, LEASE_KILL_WAIT_S):
        os.close(fd)
        return None
    os.pwrite(fd, b"1", 0)
    return UidLease(uid, fd)

@functools.cache
def _recover_leases() -> None:
    """Once per process, before its first lease: the uids that trainers which died left marked in use (and free
    now) have their leftover processes killed and are marked clean, whichever uid this process draws later."""
    folder = _lease_dir()
    for file in folder.iterdir():
        if file.name.isdigit() and file.read_bytes()[:1] == b"1" and (lease := _try_lease(folder, int(file.name))):
            lease.give_back()

def lease_uid() -> UidLease | None:
    """A spare uid no other call on this host runs as (None where the trainer is not root: a user namespace maps
    the code to the trainer's uid). Drawn at random among the free ones: the lowest free one would tell a call
    how many calls run beside it, which a policy could use to signal from one call to another. OSError when
    every spare uid is taken, or leases cannot be kept here."""
    spare = spare_ids()
    if spare is None:
        return None
    folder = _lease_dir()
    _recover_leases()
    import secrets

    start = secrets.randbelow(len(spare))
    for uid in spare[start:] + spare[:start]:
        if (lease := _try_lease(folder, uid)) is not None:
            return lease
    raise OSError(f"every spare uid ({len(spare)} in {SPARE_HOST_IDS.start}-{SPARE_HOST_IDS.stop - 1}) is held by "
                  "a call running now")
