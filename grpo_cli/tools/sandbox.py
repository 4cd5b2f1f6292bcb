"""A sandbox for model-written code: Linux namespaces through bubblewrap, a seccomp filter and a cgroup per call
(docs/sandbox.md).

An RL policy is optimized toward whatever pays, so the code it writes is treated as hostile (issues 36, 53). One
call runs `bwrap` with:
- every namespace new (PID, network, IPC, UTS, cgroup, mount; user too where the trainer is not root): no
  network (a loopback of its own, down), no host process visible or signalable, and every process of the call
  dies with its PID 1 (a double fork and `setsid` do not leave it);
- never host root: a spare unprivileged host uid with no capability (`setpriv`) where the trainer is root,
  leased for this call alone so no per-uid quota or count is shared with another call (`lease_uid`), else the
  trainer's own uid behind a user namespace with no further one (`_identity`);
- a seccomp filter (seccomp.py): no keyrings but one new empty one, no new namespaces, no mounts, no host
  state the calls share (vsock, file locks, the page cache's residency, inotify, message queues), ...;
- a root of its own: /usr read-only with /usr/local and every site-packages hidden, the interpreter's own files
  bound back, a fresh /proc (/proc/sys hidden, keyrings, kernel memory and host-wide counters masked) and /dev,
  a private /tmp,
  a private working directory /scratch (also its home); no /home, /root, /etc, project, run directory or host
  /tmp;
- an environment of PATH, HOME and the locale. bwrap itself starts with an empty environment: it is the call's
  PID 1, and its /proc/1/environ is readable from inside;
- a cgroup: the memory of all its processes together (swap and tmpfs included), the number of processes, and
  a CPU quota, so it cannot starve a concurrent call or the trainer;
- its output on a pipe read up to a limit (`supervise`): no host file is open to it.
The code's own bootstrap (builtin.py) joins a new session keyring and adds rlimits: CPU time, address space.

Where any part cannot be made (no bwrap, libseccomp, spare uid, user namespaces, or cgroup this user may
create), `problem()` says why in one line and callers fail closed; nothing falls back to running the code bare.
"""

from __future__ import annotations

import fcntl
import functools
import os
import queue
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo_cli.rewards.worker import Malformed, Worker, WorkerDied
from grpo_cli.tools.seccomp import filter_fd, keyring_lock, program

SANDBOX_UID = 65534  # "nobody": the code's uid and gid inside, where the trainer is not root (a user namespace)
SPARE_HOST_IDS = range(61000, 62000)  # where the trainer is root: the code's host uid and gid, one of these that no
# account and no group has, leased per call (a uid mapped to no one owns no file, and no key, of the host)
CGROUP_FS = Path("/sys/fs/cgroup")
INSIDE_PATH = "/usr/local/bin:/usr/bin:/bin"
INSIDE_ENV = {"PATH": INSIDE_PATH, "HOME": "/scratch", "TMPDIR": "/tmp", "LANG": "C.UTF-8"}
MASKED_PROC = ("/proc/keys", "/proc/key-users", "/proc/kcore", "/proc/sysrq-trigger", "/proc/timer_list",
               "/proc/locks",  # the host's file locks, with their files' inode numbers
               # host-wide counters another call moves at will, so a channel between calls (issue 64): the tasks
               # on the host (loadavg's total, stat's processes and procs_running), memory, paging and I/O
               "/proc/loadavg", "/proc/stat", "/proc/meminfo", "/proc/vmstat", "/proc/zoneinfo", "/proc/buddyinfo",
               "/proc/pagetypeinfo", "/proc/schedstat", "/proc/interrupts", "/proc/softirqs", "/proc/diskstats",
               "/proc/swaps", "/proc/uptime", "/proc/pressure", "/proc/cgroups", "/proc/sched_debug")
HIDDEN_PROC_DIRS = ("/proc/sys",)  # an empty read-only folder: kernel settings (core_pattern, issue 53) and more
# host-wide counters (fs/file-nr, fs/inode-nr, fs/aio-nr, kernel/pty/nr, kernel/random/entropy_avail)


@dataclass(frozen=True)
class Limits:
    wall_s: float  # wall time of the whole call, then every process in it is killed
    memory_bytes: int  # all the call's processes together (cgroup), swap and its tmpfs files included
    processes: int  # at once, the first one included (cgroup pids)
    cpus: float = 1.0  # CPU time per wall-clock second, all its processes together (cgroup cpu quota): a call
    # cannot take a concurrent call's or the trainer's share, whatever the host's scheduler settings (issue 64)


@dataclass(frozen=True)
class Finished:
    exit_code: int | None  # of the first process; None: killed at the wall-time limit
    oom_killed: bool  # the kernel killed a process of the call at its memory limit
    output: bytes = b""  # stdout and stderr together, at most the call's output limit
    output_cut: bool = False  # it wrote more than that: stopped there and killed


def interpreter() -> str:
    """The real Python binary behind sys.executable (a venv's is a link to it): the path code runs with inside.
    The venv itself stays out of sight; callers run it with `-I -S` (no site-packages)."""
    return os.path.realpath(sys.executable)


def _base_paths() -> dict[str, str]:
    """The base interpreter's install paths (not a venv's): its stdlib and its site-packages."""
    import sysconfig

    base = {"base": sys.base_prefix, "platbase": sys.base_exec_prefix, "installed_base": sys.base_prefix,
            "installed_platbase": sys.base_exec_prefix}
    return {k: os.path.realpath(v) for k, v in sysconfig.get_paths(vars=base).items()}


def _interpreter_files() -> list[str]:
    """What the interpreter itself needs, besides /usr's libraries: its binary, its standard library (with
    lib-dynload) and its shared libpython when it has one."""
    import glob
    import sysconfig

    paths = _base_paths()
    files = [interpreter(), paths["stdlib"], paths["platstdlib"]]
    if sysconfig.get_config_var("Py_ENABLE_SHARED") and (libdir := sysconfig.get_config_var("LIBDIR")):
        files += sorted(glob.glob(os.path.join(os.path.realpath(libdir), f"libpython{sys.version_info.major}."
                                               f"{sys.version_info.minor}*.so*")))
    return list(dict.fromkeys(files))


def _hidden_dirs() -> list[str]:
    """Folders the code must not see even where their parent is bound: every site-packages of the base
    interpreter and the system's (a reward package installed there would be readable), and /usr/local."""
    import glob

    paths = _base_paths()
    hidden = [paths["purelib"], paths["platlib"], *glob.glob("/usr/lib/python3*/*-packages"), "/usr/local"]
    return [d for d in dict.fromkeys(hidden) if os.path.isdir(d) and not os.path.islink(d)]


def ancestors(paths: list[str]) -> list[str]:
    """bwrap arguments that make the folders above `paths` (outside /usr) traversable inside: left to bwrap, they
    copy the host's modes, and a root trainer's /root is 0700 to the code's uid."""
    made: dict[str, None] = {}
    for path in paths:
        for parent in reversed(Path(path).parents):
            if str(parent) not in ("/", "/usr") and not str(parent).startswith("/usr/"):
                made[str(parent)] = None
    return [arg for d in made for arg in ("--perms", "0755", "--dir", d)]


@functools.cache
def _binds() -> tuple[str, ...]:
    """The read-only view of the host: /usr with /usr/local and every site-packages hidden (empty, read-only
    tmpfs), its merged-/usr links, the loader's cache, and the interpreter's own files bound back where they lie
    (the same for every call of this process)."""
    binds = ["--ro-bind", "/usr", "/usr"]
    for top in ("bin", "lib", "lib64", "sbin"):  # merged-/usr systems have these as links into /usr
        host = Path("/") / top
        if host.is_symlink():
            binds += ["--symlink", os.readlink(host), f"/{top}"]
        elif host.is_dir():
            binds += ["--ro-bind", str(host), f"/{top}"]
    binds += ["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    hidden, own = _hidden_dirs(), _interpreter_files()

    def under(d: str, parents: list[str]) -> bool:
        return any(d.startswith(parent.rstrip("/") + "/") for parent in parents)

    binds += [arg for d in hidden if under(d, ["/usr"]) for arg in ("--perms", "0555", "--tmpfs", d)]
    binds += ancestors(own) + [arg for path in own for arg in ("--ro-bind", path, path)]  # where /usr/local held them
    binds += [arg for d in hidden if under(d, own) for arg in ("--perms", "0555", "--tmpfs", d)]  # pyenv's own
    return tuple(binds)


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


# ------------------------------------------------------------------------------------- a host uid per call
# Per-uid kernel state (the key quota, RLIMIT_NPROC's count, message-queue bytes, inotify instances, pipe pages)
# is shared by every process of a uid, so calls that shared one uid could make each other fail or pass each other
# bits (issue 64). A root trainer's call therefore leases a uid of its own: a file per uid in LEASE_DIR, held by
# an flock for as long as the call (or a sandboxed worker) lives. The kernel drops the lock when its holder dies,
# SIGKILL included, so a trainer that died leaves no lease behind; the file's first byte says whether the uid
# was given back clean ("0") or may still have processes ("1"), which the next holder kills before it runs code.
# Every trainer on the host (that shares this /run) leases from the same files: two never share a uid.

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


def _identity(lease: UidLease | None) -> tuple[list[str], list[str]]:
    """(bwrap's arguments for who the code is, the command it runs before the code). Never host root:
    - trainer not root (`lease` None): a user namespace of bwrap's own (uid and gid 65534 inside, the trainer's
      unprivileged uid outside), no capabilities, and no further user namespace (`--disable-userns`);
    - trainer root: bwrap (root) makes the namespaces but a user one, and `setpriv` turns the code into the
      call's leased spare host uid with no groups and no capability, bounding set included, before it runs: a
      user namespace made by root would map the code to host root, which the kernel honours in /proc/sys and
      /proc (issue 53)."""
    if lease is None:
        return (["--unshare-user", "--disable-userns", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID),
                 "--cap-drop", "ALL"], [])
    uid = lease.uid
    setpriv = os.path.realpath(shutil.which("setpriv") or "/usr/bin/setpriv")
    return [], [setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all",
                "--bounding-set=-all", "--no-new-privs", "--"]


def bwrap_argv(argv: list[str], seccomp_fd: int, lease: UidLease | None) -> list[str]:
    """The bwrap command line that runs `argv` in the sandbox (argv[0]: an absolute path inside it), under the
    seccomp filter read from `seccomp_fd` (seccomp.filter_fd(), passed to bwrap), as the uid of `lease` (a root
    trainer's; None otherwise)."""
    env = [arg for k, v in INSIDE_ENV.items() for arg in ("--setenv", k, v)]
    user, before = _identity(lease)
    masked = [arg for path in MASKED_PROC if os.path.exists(path)
              for arg in (("--perms", "0555", "--tmpfs", path) if os.path.isdir(path) else ("--ro-bind", "/dev/null", path))]
    hidden = [arg for path in HIDDEN_PROC_DIRS for arg in ("--perms", "0555", "--tmpfs", path, "--remount-ro", path)]
    return [shutil.which("bwrap") or "bwrap", "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts",
            "--unshare-cgroup", *user, "--die-with-parent", "--new-session", "--hostname", "sandbox", *_binds(),
            "--proc", "/proc", *hidden, *masked, "--dev", "/dev",
            "--perms", "01777", "--tmpfs", "/tmp", "--perms", "0777", "--dir", "/scratch", "--chdir", "/scratch",
            "--clearenv", *env, "--seccomp", str(seccomp_fd), "--", *before, *argv]


# ----------------------------------------------------------------------------------------------- cgroups


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


# ------------------------------------------------------------------------------------------------ running


def supervise(command: list[str], wall_s: float, max_output_bytes: int, env: dict[str, str], cwd: str,
              pass_fds: tuple[int, ...] = ()) -> tuple[int | None, bytes, bool]:
    """Start `command` in a session of its own, stdout and stderr into one pipe, stdin closed; read the pipe as it
    fills, up to `max_output_bytes`, and wait for the exit on a pidfd (no polling: the call returns as soon as
    it ends). Returns (exit code, None past `wall_s`; the output; whether there was more than the limit, which
    also ends the call). Every process of the session is killed before it returns. The one home of a code
    call's wait and output rules: the sandbox's calls and `sandbox: none`'s (builtin.py) both come here."""
    import select

    read_end, write_end = os.pipe()
    try:
        proc = subprocess.Popen(command, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=write_end,
                                stderr=write_end, start_new_session=True, pass_fds=pass_fds)
    finally:
        os.close(write_end)  # the call's processes hold the only write ends: EOF when they are gone
    deadline = time.monotonic() + wall_s
    chunks: list[bytes] = []
    exit_code, pidfd = None, None

    def over() -> bool:  # more output than the limit: the call ends here
        return sum(map(len, chunks)) > max_output_bytes

    try:
        pidfd = os.pidfd_open(proc.pid)
        waiting = [read_end, pidfd]
        while waiting and not over() and (left := deadline - time.monotonic()) > 0:
            ready = select.select(waiting, [], [], left)[0]
            if read_end in ready:
                chunks.append(chunk := os.read(read_end, 65536))
                if not chunk:
                    waiting.remove(read_end)
            if pidfd in ready:
                exit_code = proc.wait()  # it has exited: no wait here
                # what it wrote before it ended, not waiting for a process it left that holds the pipe
                while read_end in waiting and not over() and select.select([read_end], [], [], 0)[0] and \
                        (chunk := os.read(read_end, 65536)):
                    chunks.append(chunk)
                break
    finally:
        try:
            os.killpg(proc.pid, 9)  # what is left of the session (the sandbox's PID 1 dies with bwrap)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()
        os.close(read_end)
        if pidfd is not None:
            os.close(pidfd)
    cut = over()
    if cut:
        exit_code = proc.returncode
    return exit_code, b"".join(chunks)[:max_output_bytes], cut


def run(argv: list[str], limits: Limits, max_output_bytes: int) -> Finished:
    """Run `argv` (argv[0] a path that exists inside: /usr/...) in the sandbox, stdin closed; return its exit,
    and its stdout and stderr together up to `max_output_bytes` (a pipe: the code holds no host file). It runs
    as a host uid leased for this call alone (a root trainer's). Every process it started is killed by then (the
    sandbox's PID namespace ends with bwrap); its cgroup is emptied and removed, and its uid given back, just
    after, off the call's path (`settle`). Raises OSError when the sandbox cannot be made; never runs the code
    outside one."""
    lease = lease_uid()
    try:
        group = CallGroup(limits)
    except BaseException:
        if lease is not None:
            lease.give_back()
        raise
    try:
        fd = filter_fd()
        try:  # env={}: bwrap is PID 1 inside, its environ readable
            exit_code, output, cut = supervise(group.join_prefix() + bwrap_argv(argv, fd, lease), limits.wall_s,
                                               max_output_bytes, env={}, cwd="/", pass_fds=(fd,))
        finally:
            os.close(fd)
        return Finished(exit_code, group.oom_killed(), output, cut)
    finally:
        _sweep_later(group, lease)


# A call's cgroup is emptied and removed, and its uid given back, off the call's path: its processes are already
# dying (bwrap's exit ends the sandbox's PID namespace) but linger in cgroup.procs for a few ms, and waiting for
# that cost a harmless call 5 ms of its ~35 (issue 53). One thread per process does it; a process that dies
# first leaves the folders to the next one's _remove_orphans and its leases to their next holders. A failure on
# one call's cleanup (its cgroup removed by someone else, say) is logged once and the thread goes on: it dying
# would leave every later call's cgroup and uid held for the rest of the run (issue 64).
_SWEEPS: queue.Queue[tuple[CallGroup, UidLease | None]] = queue.Queue()
_SWEEPER: list[threading.Thread] = []  # started on the first call
_SWEEPER_LOCK = threading.Lock()
_SWEEP_FAILURES: list[str] = []  # each kind once, for the log


def _sweep_one(group: CallGroup, lease: UidLease | None) -> None:
    try:
        group.kill_all(wait_s=5.0)
        group.remove()
    finally:
        if lease is not None:  # once its cgroup is empty (or could not be read): give_back kills what is left
            lease.give_back()


def _sweep() -> None:
    import logging

    while True:
        group, lease = _SWEEPS.get()
        try:
            _sweep_one(group, lease)
        except Exception as e:  # noqa: BLE001 - the sweeper outlives any one call's failure
            kind = type(e).__name__
            if kind not in _SWEEP_FAILURES:
                _SWEEP_FAILURES.append(kind)
                logging.getLogger(__name__).warning("sandbox: a call's cleanup failed (%s: %s); the sweeper goes "
                                                    "on", kind, " ".join(str(e).split())[:160])
        finally:
            _SWEEPS.task_done()


def _sweep_later(group: CallGroup, lease: UidLease | None = None) -> None:
    with _SWEEPER_LOCK:
        if not _SWEEPER:
            _SWEEPER.append(threading.Thread(target=_sweep, name="grpo-sandbox-sweep", daemon=True))
            _SWEEPER[0].start()
    _SWEEPS.put((group, lease))


def settle() -> None:
    """Wait until every finished call's cgroup is gone and its uid given back (tests, and a run's end)."""
    _SWEEPS.join()


_TRIAL_PASSED: list[bool] = []  # a trial call ran in the sandbox in this process: it holds here


def problem() -> str | None:
    """Why the sandbox cannot be made on this machine, in one line; None when a trial call runs in it as the
    unprivileged uid it should, under the seccomp filter. A pass is kept for the process's life; a failure is not:
    the next caller tries again, so a passing glitch (a cgroup write refused for a moment) cannot fail every later
    tool load of a long process closed."""
    if _TRIAL_PASSED:
        return None
    why = _trial_problem()
    if why is None:
        _TRIAL_PASSED.append(True)
    return why


problem.cache_clear = _TRIAL_PASSED.clear  # forget a pass (tests that take a part of the machine away)


def _trial_problem() -> str | None:
    if shutil.which("bwrap") is None:
        return "bwrap (bubblewrap) is not on PATH; `make install` installs it on Debian and Ubuntu"
    try:
        program()
        keyring_lock()
        spare = spare_ids()
    except OSError as e:
        return " ".join(str(e).split())[:200]
    if spare is not None and shutil.which("setpriv") is None:
        return "setpriv (util-linux) is not on PATH: a root trainer's sandbox needs it to drop root"
    trial = Limits(wall_s=10.0, memory_bytes=256 * 2**20, processes=8)
    check = keyring_boot() + "import os; print(*os.getresuid(), *os.getresgid())"  # the bootstraps' start too
    try:
        finished = run([interpreter(), "-I", "-S", "-c", check], trial, 4096)
    except OSError as e:
        return f"cannot make the call's uid lease or cgroup ({' '.join(str(e).split())[:160]})"
    ids = set(finished.output.split()) if finished.exit_code == 0 else set()
    if finished.exit_code == 0 and (len(ids) != 1 or int(ids.pop()) not in (spare or (SANDBOX_UID,))):
        return f"the trial call ran as {finished.output.decode(errors='replace').strip()[:80]}, not a spare uid"
    if finished.exit_code != 0:
        why = " ".join(finished.output.decode(errors="replace").split())[-160:] or f"exit code {finished.exit_code}"
        return f"bwrap cannot start a sandbox here ({why}); user namespaces may be off"
    return None


# ------------------------------------------------------------------------------- a tool's worker inside


# First thing in the sandbox's Python bootstraps (the python tool's, a worker's): a new, empty, anonymous session
# keyring, the one keyctl request bwrap's seccomp filter lets through, so the call does not even possess the
# trainer's (docs/sandbox.md); then a second filter (seccomp.keyring_lock) that refuses every keyring call, that
# join included, so code cannot keep joining keyrings to fill its uid's key quota (issue 64). keyctl's number:
# x86-64 250, arm64 219. It calls libc through `_ctypes` itself: importing the `ctypes` package costs a harmless
# call 6 ms of its ~35 (issue 53). `_F(("name", _D))` is a libc function returning a C long, `_L(n)` a C long
# argument; the python tool's bootstrap uses them for prctl too.
_LIBC_BOOT = """import _ctypes as _c, os as _o
class _L(_c._SimpleCData):
    _type_ = "l"
class _C(_c._SimpleCData):
    _type_ = "c"
class _F(_c.CFuncPtr):
    _flags_ = _c.FUNCFLAG_CDECL
    _restype_ = _L
class _D:
    _handle = _c.dlopen(None, 0)
def _bytes(data):
    class _A(_c.Array):
        _type_ = _C
        _length_ = len(data)
    return _A.from_buffer_copy(data)
"""
_KEYRING_JOIN = """_n = {"x86_64": 250, "aarch64": 219}.get(_o.uname().machine)
if _n is None or _F(("syscall", _D))(_L(_n), _L(1), _L(0)) < 0:
    raise SystemExit("sandbox: cannot join a new session keyring")
"""
_KEYRING_LOCK = """_lock = _bytes(bytes.fromhex("%s"))
_prog = _bytes((len(_lock) // 8).to_bytes(8, "little") + _c.addressof(_lock).to_bytes(8, "little"))
if _F(("prctl", _D))(_L(22), _L(2), _L(_c.addressof(_prog))) < 0:  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
    raise SystemExit("sandbox: cannot load the keyring lock")
"""


@functools.cache
def keyring_boot(lock: bool = True) -> str:
    """The start of a Python bootstrap: join a fresh session keyring, then (`lock`, inside the sandbox, where
    bwrap has set no_new_privs) refuse every keyring call (seccomp.keyring_lock, compiled here and carried in
    the text). OSError without libseccomp."""
    return _LIBC_BOOT + _KEYRING_JOIN + (_KEYRING_LOCK % keyring_lock().hex() if lock else "")


# The worker's loop inside the sandbox: length-prefixed frames on stdin and on the fd stdout was (the tool's own
# prints go to stderr, so they cannot break the frames). In: one pickle, the function (by module and name) and
# the start's key, read before any tool code runs; then JSON requests. Out: JSON, never unpickled by the trainer
# (a tool steered into running code could otherwise run it there). Every request carries a fresh random key that
# its answer must repeat: a tool steered into writing a frame into either pipe (/proc/self/fd/N is a path)
# cannot know it, so a forged answer is caught, not taken (issue 53). A value that is not text is reported as a
# "type" failure, the words call_tool uses for it.
_WORKER_BOOT = """import json, os, pickle, struct, sys
sys.path[:0] = json.loads(sys.argv[1])
out = os.fdopen(os.dup(1), "wb")
os.dup2(2, 1)
src = os.fdopen(0, "rb")
def read(decode):
    head = src.read(4)
    if len(head) < 4:
        sys.exit(0)
    return decode(src.read(struct.unpack("<I", head)[0]))
def write(value):
    data = json.dumps(value).encode()
    out.write(struct.pack("<I", len(data)) + data)
    out.flush()
from grpo_cli.rewards.worker import call_in_process
fn, key = read(pickle.loads)
write([key, "ready", None])
while True:
    key, completions, kwargs = read(json.loads)
    tag, values = call_in_process(fn, completions, kwargs)
    if tag == "ok" and (junk := next((v for v in values if not isinstance(v, str)), None)) is not None:
        tag, values = "type", f"returned {type(junk).__name__}, not text"
    write([key, tag, values])
"""
MAX_FRAME_BYTES = 2**24  # a frame out of the sandbox longer than this is the worker's failure (results are cut to 4 KiB)
WORKER_LIMITS = Limits(wall_s=0.0, memory_bytes=512 * 2**20, processes=32)  # wall time: per call, the tool's


def _import_view(fn: Any) -> tuple[list[str], list[str]]:
    """(what to bind read-only, what to put on sys.path) so `fn` (pickled by reference) imports inside: the
    grpo_cli package itself, the site-packages of this interpreter, and the function's own top-level package, or
    its module's file alone. Not the folders around them: under an editable install the one holding grpo_cli is
    the checkout, with its runs (held-out data, checkpoints), recipes and .git (issue 64). Parents come before
    their children, so a bind never hides one made inside it."""
    package = Path(__file__).resolve().parents[1]  # grpo_cli/
    binds, path = [str(package)], [str(package.parent)]
    sites = [os.path.realpath(p) for p in sys.path if p and "site-packages" in p and Path(p).is_dir()]
    binds += sites
    path += sites
    functions = [fn, getattr(fn, "func", None), *getattr(fn, "keywords", {}).values()]  # a partial's parts too
    for name in {getattr(f, "__module__", None) for f in functions if callable(f)} - {None}:
        top = sys.modules.get(name.split(".")[0])
        if (where := getattr(top, "__file__", None)) is not None:
            file = Path(where).resolve()
            own = file.parent if file.name == "__init__.py" else file  # the package's folder, or the module alone
            binds.append(str(own))
            path.append(str(own.parent))
    unique = sorted(dict.fromkeys(os.path.realpath(b) for b in binds), key=lambda b: (b.count("/"), b))
    return unique, list(dict.fromkeys(path))


class SandboxedWorker(Worker):
    """A tool's worker (rewards.worker.Worker's call protocol, this module's transport) running inside the sandbox
    for its whole life: a trusted tool the model's arguments reach (rollout.tools[i].sandbox=bwrap), so one it can
    be made to misbehave still sees no network, no host file but its code's, and no host process, under a cgroup
    of 512 MiB and 32 processes. Its answers come back as JSON frames, never unpickled."""

    def __init__(self, name: str, fn: Any, timeout_s: float) -> None:
        super().__init__(name, fn, timeout_s)
        self.process: Any = None
        self.group: CallGroup | None = None
        self.lease: UidLease | None = None  # a root trainer's worker runs as a uid of its own for its whole life

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def _send(self, data: bytes) -> None:
        import struct

        self.process.stdin.write(struct.pack("<I", len(data)) + data)
        self.process.stdin.flush()

    def _read(self, size: int, deadline: float) -> bytes:
        """Exactly `size` bytes from the worker by `deadline`: TimeoutError past it (a worker that writes half a
        frame and stops cannot stall the call), EOFError when it died."""
        import select

        out, data = self.process.stdout, b""
        while len(data) < size:
            if not select.select([out], [], [], max(deadline - time.monotonic(), 0.0))[0]:
                raise TimeoutError
            chunk = out.read(size - len(data))  # unbuffered: what the pipe holds, up to that
            if not chunk:
                raise EOFError
            data += chunk
        return data

    def _receive(self, key: str, timeout_s: float) -> tuple[str, Any]:
        """The next frame, read as JSON (never unpickled: it comes from the sandbox), within `timeout_s`; a frame
        that does not carry `key` was not written by the bootstrap: ValueError."""
        import json
        import struct

        deadline = time.monotonic() + timeout_s
        (size,) = struct.unpack("<I", self._read(4, deadline))
        if size > MAX_FRAME_BYTES:
            raise EOFError(f"a frame of {size} bytes")
        frame = json.loads(self._read(size, deadline))
        if not (isinstance(frame, list) and len(frame) == 3 and frame[0] == key):
            raise ValueError("a frame without this call's key")
        return str(frame[1]), frame[2]

    def _launch(self, within_s: float) -> tuple[str, Any] | None:
        import json
        import pickle
        import secrets

        binds, path = _import_view(self.fn)
        binds = ancestors(binds) + [arg for bind in binds for arg in ("--ro-bind", bind, bind)]
        key, fd = secrets.token_hex(16), -1
        try:
            self.lease = lease_uid()
            self.group = CallGroup(WORKER_LIMITS)
            fd = filter_fd()
            argv = bwrap_argv([interpreter(), "-I", "-S", "-c", keyring_boot() + _WORKER_BOOT, json.dumps(path)],
                              fd, self.lease)
            at = argv.index("--seccomp")
            command = self.group.join_prefix() + argv[:at] + binds + argv[at:]
            self.process = subprocess.Popen(command, env={}, cwd="/", stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                            stderr=subprocess.DEVNULL, start_new_session=True, bufsize=0,
                                            pass_fds=(fd,))
            self._send(pickle.dumps((self.fn, key)))
            tag, reason = self._receive(key, within_s)
        except TimeoutError:
            self.kill()
            return "timeout", f"its sandboxed worker did not start within {within_s:g} s"
        except (OSError, EOFError, ValueError, pickle.PickleError) as e:
            self.kill()
            return "raised", f"its sandboxed worker did not start ({type(e).__name__}: {' '.join(str(e).split())[:160]})"
        finally:
            if fd >= 0:
                os.close(fd)
        return None if tag == "ready" else (tag, reason)

    def _exchange(self, completions: list, kwargs: dict[str, Any], limit_s: float) -> tuple[str, Any]:
        import json
        import secrets

        key = secrets.token_hex(16)
        try:
            request = json.dumps([key, completions, kwargs]).encode()
        except (TypeError, ValueError) as e:  # arguments JSON cannot carry
            return "type", f"its call could not be passed to the sandbox: {type(e).__name__}"
        try:
            self._send(request)
            tag, value = self._receive(key, limit_s)
        except TimeoutError:  # an OSError too: the call's limit, which Worker.call reports
            raise
        except (OSError, EOFError):
            oom = self.group is not None and self.group.oom_killed()
            raise WorkerDied("its sandboxed worker died" + (" at its memory limit" if oom else "")) from None
        except ValueError:  # a frame that is not JSON, or not this call's (forged inside)
            raise Malformed("its sandboxed worker sent a malformed answer (worker killed)") from None
        well_formed = (isinstance(value, list) and len(value) == len(completions) and all(isinstance(v, str) for v in value)
                       if tag == "ok" else tag in ("raised", "type") and isinstance(value, str))
        if not well_formed:  # the bootstrap never writes such a frame: something else in the sandbox did
            raise Malformed("its sandboxed worker sent a malformed answer (worker killed)")
        return tag, value

    def _stop(self) -> None:
        if self.process is not None:
            try:
                os.killpg(self.process.pid, 9)  # bwrap; the sandbox's PID 1 dies with it
            except (ProcessLookupError, PermissionError):
                pass
            self.process.wait()
            self.process = None
        if self.group is not None:
            self.group.kill_all()
            self.group.remove()
            self.group = None
        if self.lease is not None:  # once its cgroup is empty
            self.lease.give_back()
            self.lease = None

