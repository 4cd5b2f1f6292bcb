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

import functools
import os
import queue
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from grpo_cli.tools.cgroups import CallGroup, Limits
from grpo_cli.tools.seccomp import filter_fd, keyring_boot, keyring_lock, program
from grpo_cli.tools.uids import UidLease, lease_uid, spare_ids

SANDBOX_UID = 65534  # "nobody": the code's uid and gid inside, where the trainer is not root (a user namespace)

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
