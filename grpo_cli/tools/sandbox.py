"""A sandbox for model-written code: Linux namespaces through bubblewrap, and a cgroup per call (docs/sandbox.md).

An RL policy is optimized toward whatever pays, so the code it writes is treated as hostile (issue 36). One
call runs `bwrap` with:
- every namespace new (user, PID, network, IPC, UTS, cgroup, mount): no network (a loopback of its own, down),
  no host process visible or signalable, and every process of the call dies with its PID 1 (a double fork and
  `setsid` do not leave it);
- a root of its own: /usr read-only (and the interpreter's prefix when it lives elsewhere), a fresh /proc and
  /dev, a private /tmp, a private working directory /scratch (also its home); no /home, /root, /etc, project,
  run directory or host /tmp;
- no capabilities, uid and gid 65534, an environment of PATH, HOME and the locale. bwrap itself starts with an
  empty environment: it is the call's PID 1, and its /proc/1/environ is readable from inside;
- a cgroup: the memory of all its processes together (swap and tmpfs included) and the number of processes.
The code's own bootstrap (builtin.py) adds rlimits: CPU time, address space, output size.

Where any part cannot be made (no bwrap, no user namespaces, no cgroup this user may create), `problem()` says
why in one line and callers fail closed; nothing falls back to running the code bare.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

SANDBOX_UID = 65534  # "nobody": the code's uid and gid inside its user namespace
CGROUP_FS = Path("/sys/fs/cgroup")
INSIDE_PATH = "/usr/local/bin:/usr/bin:/bin"
INSIDE_ENV = {"PATH": INSIDE_PATH, "HOME": "/scratch", "TMPDIR": "/tmp", "LANG": "C.UTF-8"}


@dataclass(frozen=True)
class Limits:
    wall_s: float  # wall time of the whole call, then every process in it is killed
    memory_bytes: int  # all the call's processes together (cgroup), swap and its tmpfs files included
    processes: int  # at once, the first one included (cgroup pids)


@dataclass(frozen=True)
class Finished:
    exit_code: int | None  # of the first process; None: killed at the wall-time limit
    oom_killed: bool  # the kernel killed a process of the call at its memory limit


def interpreter() -> str:
    """The real Python binary behind sys.executable (a venv's is a link to it): the path code runs with inside.
    The venv itself stays out of sight; callers run it with `-I -S` (no site-packages)."""
    return os.path.realpath(sys.executable)


def _prefixes() -> list[str]:
    """Folders besides /usr the interpreter needs (its installation, e.g. pyenv's), bound read-only."""
    prefix = os.path.realpath(sys.base_prefix)
    return [] if prefix == "/usr" or prefix.startswith("/usr/") else [prefix]


@functools.cache
def _binds() -> tuple[str, ...]:
    """The read-only view of the host: /usr, its merged-/usr links, the loader's cache, the interpreter's prefix
    (the same for every call of this process)."""
    binds = ["--ro-bind", "/usr", "/usr"]
    for top in ("bin", "lib", "lib64", "sbin"):  # merged-/usr systems have these as links into /usr
        host = Path("/") / top
        if host.is_symlink():
            binds += ["--symlink", os.readlink(host), f"/{top}"]
        elif host.is_dir():
            binds += ["--ro-bind", str(host), f"/{top}"]
    binds += ["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    for path in _prefixes():
        binds += ["--ro-bind", path, path]
    return tuple(binds)


def bwrap_argv(argv: list[str]) -> list[str]:
    """The bwrap command line that runs `argv` in the sandbox (argv[0]: an absolute path inside it)."""
    env = [arg for k, v in INSIDE_ENV.items() for arg in ("--setenv", k, v)]
    return [shutil.which("bwrap") or "bwrap", "--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
            "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID), "--hostname", "sandbox", *_binds(),
            "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--dir", "/scratch", "--chdir", "/scratch",
            "--clearenv", *env, "--", *argv]


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


def _remove_orphans(parent: Path) -> None:
    """Empty call cgroups left by a process that died mid-call (a tool worker killed on its timeout): their
    names carry the creator's pid."""
    for d in parent.glob("grpo-sandbox-*"):
        pid = int(d.name.split("-")[2])
        if pid != os.getpid() and not Path(f"/proc/{pid}").exists():
            try:
                d.rmdir()
            except OSError:
                pass


@functools.cache
def _cgroup_parents() -> tuple[int, tuple[Path, ...]]:
    """(cgroup version, the folders the calls' cgroups go in), read once per process: v2 (one folder with memory
    and pids) where this process's cgroup delegates both controllers, else v1 (its memory and pids folders)."""
    own = _own_cgroups()
    mount = _v2_mount()
    parent = mount / own.get("", "/").lstrip("/") if mount is not None else None
    if parent is not None and {"memory", "pids"} <= set((parent / "cgroup.subtree_control").read_text().split()
                                                         if (parent / "cgroup.subtree_control").exists() else []):
        return 2, (parent,)
    if (CGROUP_FS / "memory").is_dir() and (CGROUP_FS / "pids").is_dir() and "memory" in own and "pids" in own:
        return 1, tuple(CGROUP_FS / c / own[c].lstrip("/") for c in ("memory", "pids"))
    raise OSError("no cgroup with the memory and pids controllers that this process may create (cgroup v2 "
                  "needs them delegated, e.g. a systemd scope with Delegate=yes)")


class CallGroup:
    """The cgroup(s) of one call, under _cgroup_parents(): one folder (v2), or one in the memory and one in the
    pids hierarchy (v1)."""

    def __init__(self, limits: Limits):
        name = f"grpo-sandbox-{os.getpid()}-{time.monotonic_ns()}"
        self.version, parents = _cgroup_parents()
        self.dirs = [parent / name for parent in parents]
        for d in self.dirs:
            _remove_orphans(d.parent)
            d.mkdir()  # PermissionError / OSError: the caller reports it
        try:
            if self.version == 2:
                self._write("memory.max", limits.memory_bytes)
                self._write("memory.swap.max", 0)
                self._write("pids.max", limits.processes)
            else:
                self._write("memory.limit_in_bytes", limits.memory_bytes)
                if (self.dirs[0] / "memory.memsw.limit_in_bytes").exists():  # swap accounting on: none of it
                    self._write("memory.memsw.limit_in_bytes", limits.memory_bytes)
                self._write("pids.max", limits.processes)
        except OSError:
            self.remove()
            raise

    def _write(self, name: str, value: int) -> None:
        target = next(d / name for d in self.dirs if (d / name).exists())
        target.write_text(str(value))

    def join_prefix(self) -> list[str]:
        """A shell that moves itself into the call's cgroup(s) and then execs the command, so the first process
        of the call, and all it forks, are inside before any model code runs."""
        moves = " && ".join(f"echo $$ > '{d / 'cgroup.procs'}'" for d in self.dirs)
        return ["/bin/sh", "-c", f"{moves} && exec \"$@\"", "sh"]

    def oom_killed(self) -> bool:
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        for line in (self.dirs[0] / name).read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value) > 0
        return False

    def pids(self) -> list[int]:
        return [int(p) for p in (self.dirs[-1] / "cgroup.procs").read_text().split()]

    def kill_all(self, wait_s: float = 2.0) -> None:
        """SIGKILL every process still in the call's cgroup, until it is empty (or wait_s passes)."""
        deadline = time.monotonic() + wait_s
        while (pids := self.pids()) and time.monotonic() < deadline:
            for pid in pids:
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass
            time.sleep(0.005)

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


def run(argv: list[str], limits: Limits, output: IO[bytes]) -> Finished:
    """Run `argv` (argv[0] a path that exists inside: /usr/...) in the sandbox, stdout and stderr into
    `output`, stdin closed; kill everything it started at the end. Raises OSError when the sandbox cannot be
    made; never runs the code outside one."""
    group = CallGroup(limits)
    try:
        command = group.join_prefix() + bwrap_argv(argv)
        proc = subprocess.Popen(command, env={}, cwd="/", stdin=subprocess.DEVNULL, stdout=output, stderr=output,
                                start_new_session=True)  # env={}: bwrap is PID 1 inside, its environ readable
        try:
            exit_code: int | None = proc.wait(limits.wall_s)
        except subprocess.TimeoutExpired:
            exit_code = None
        try:
            os.killpg(proc.pid, 9)  # bwrap's own process; the call's PID 1 dies with it (--die-with-parent)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()
        group.kill_all()
        return Finished(exit_code, group.oom_killed())
    finally:
        group.remove()


@functools.cache
def problem() -> str | None:
    """Why the sandbox cannot be made on this machine, in one line; None when a trial call runs in it."""
    if shutil.which("bwrap") is None:
        return "bwrap (bubblewrap) is not on PATH; `make install` installs it on Debian and Ubuntu"
    trial = Limits(wall_s=10.0, memory_bytes=256 * 2**20, processes=8)
    try:
        with open(os.devnull, "wb") as sink:
            finished = run([interpreter(), "-I", "-S", "-c", "import os; assert os.getuid() == 65534"], trial, sink)
    except OSError as e:
        return f"cannot make the call's cgroup ({' '.join(str(e).split())[:160]})"
    if finished.exit_code != 0:
        out = subprocess.run(bwrap_argv(["/bin/true"]), capture_output=True, text=True, env={}, timeout=10)
        why = " ".join(out.stderr.split())[:160] or f"exit code {finished.exit_code}"
        return f"bwrap cannot start a sandbox here ({why}); user namespaces may be off"
    return None


# ------------------------------------------------------------------------------- a tool's worker inside


# The worker's loop inside the sandbox: length-prefixed frames, pickles in on stdin (the trainer's), JSON out on
# the fd stdout was (the tool's own prints go to stderr, so they cannot break the frames). What comes out of the
# sandbox is never unpickled: a tool steered into running code there could otherwise run it in the trainer. A
# value that is not text is reported as a "type" failure, the words call_tool uses for it. It imports the
# function by module and name.
_WORKER_BOOT = """import json, os, pickle, struct, sys
sys.path[:0] = json.loads(sys.argv[1])
out = os.fdopen(os.dup(1), "wb")
os.dup2(2, 1)
src = os.fdopen(0, "rb")
def read():
    head = src.read(4)
    if len(head) < 4:
        sys.exit(0)
    return pickle.loads(src.read(struct.unpack("<I", head)[0]))
def write(value):
    data = json.dumps(value).encode()
    out.write(struct.pack("<I", len(data)) + data)
    out.flush()
from grpo_cli.rewards.worker import call_in_process
fn = read()
write(["ready", None])
while True:
    completions, kwargs = read()
    tag, values = call_in_process(fn, completions, kwargs)
    if tag == "ok" and (junk := next((v for v in values if not isinstance(v, str)), None)) is not None:
        tag, values = "type", f"returned {type(junk).__name__}, not text"
    write([tag, values])
"""
MAX_FRAME_BYTES = 2**24  # a frame out of the sandbox longer than this is the worker's failure (results are cut to 4 KiB)
WORKER_LIMITS = Limits(wall_s=0.0, memory_bytes=512 * 2**20, processes=32)  # wall time: per call, the tool's


def _import_roots(fn: Any) -> list[str]:
    """The folders to bind read-only so `fn` (pickled by reference) imports inside: grpo_cli's, the site-packages
    of this interpreter, and the one holding the function's top-level module or package."""
    roots = [str(Path(__file__).resolve().parents[2])]  # the folder holding grpo_cli
    roots += [p for p in sys.path if p and "site-packages" in p and Path(p).is_dir()]
    functions = [fn, getattr(fn, "func", None), *getattr(fn, "keywords", {}).values()]  # a partial's parts too
    for name in {getattr(f, "__module__", None) for f in functions if callable(f)} - {None}:
        top = sys.modules.get(name.split(".")[0])
        if (where := getattr(top, "__file__", None)) is not None:
            path = Path(where).resolve()
            roots.append(str(path.parent.parent if path.name == "__init__.py" else path.parent))
    return list(dict.fromkeys(os.path.realpath(r) for r in roots))


class SandboxedWorker:
    """A tool's worker process (the RewardWorker protocol: call, kill, close) running inside the sandbox for its
    whole life: a trusted tool the model's arguments reach (rollout.tools[i].sandbox=bwrap), so one it can be
    made to misbehave still sees no network, no host file but its code's, and no host process, under a cgroup
    of 512 MiB and 32 processes. Started on the first call; a call over its time limit kills the sandbox."""

    def __init__(self, name: str, fn: Any, timeout_s: float) -> None:
        self.name, self.fn, self.timeout_s = name, fn, timeout_s
        self.process: Any = None
        self.group: CallGroup | None = None
        self.starts = 0

    def twin(self, name: str) -> SandboxedWorker:
        return SandboxedWorker(name, self.fn, self.timeout_s)

    def _send(self, value: Any) -> None:
        import pickle
        import struct

        data = pickle.dumps(value)
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

    def _receive(self, timeout_s: float) -> tuple[str, Any]:
        """The next frame, read as JSON (never unpickled: it comes from the sandbox), within `timeout_s`."""
        import json
        import struct

        deadline = time.monotonic() + timeout_s
        (size,) = struct.unpack("<I", self._read(4, deadline))
        if size > MAX_FRAME_BYTES:
            raise EOFError(f"a frame of {size} bytes")
        tag, value = json.loads(self._read(size, deadline))
        return str(tag), value

    def _start(self) -> tuple[str, Any] | None:
        import json
        import pickle

        self.starts += 1
        roots = _import_roots(self.fn)
        binds = [arg for root in roots for arg in ("--ro-bind", root, root)]
        try:
            self.group = CallGroup(WORKER_LIMITS)
            argv = bwrap_argv([interpreter(), "-I", "-S", "-c", _WORKER_BOOT, json.dumps(roots)])
            at = argv.index("--")
            command = self.group.join_prefix() + argv[:at] + binds + argv[at:]
            self.process = subprocess.Popen(command, env={}, cwd="/", stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                            stderr=subprocess.DEVNULL, start_new_session=True, bufsize=0)
            self._send(self.fn)
            tag, reason = self._receive(120.0)
        except (OSError, EOFError, TimeoutError, ValueError, pickle.PickleError) as e:
            self.kill()
            return "raised", f"its sandboxed worker did not start ({type(e).__name__}: {' '.join(str(e).split())[:160]})"
        return None if tag == "ready" else (tag, reason)

    def call(self, completions: list, kwargs: dict[str, Any], timeout_s: float | None = None) -> tuple[str, Any]:
        """As RewardWorker.call: ("ok", values) | ("raised" | "type" | "timeout", reason)."""
        if self.process is None or self.process.poll() is not None:
            if (failure := self._start()) is not None:
                return failure
        limit = timeout_s or self.timeout_s
        try:
            self._send((completions, kwargs))
            tag, value = self._receive(limit)
        except TimeoutError:
            self.kill()
            return "timeout", f"timed out after {limit:g} s (worker killed)"
        except (OSError, EOFError):
            oom = self.group is not None and self.group.oom_killed()
            self.kill()
            return "raised", "its sandboxed worker died" + (" at its memory limit" if oom else "")
        except Exception as e:  # noqa: BLE001 - inputs pickle cannot carry, a frame that is not JSON
            self.kill()
            return "type", f"its call could not be passed to or from the sandbox: {type(e).__name__}"
        well_formed = (isinstance(value, list) and len(value) == len(completions) and all(isinstance(v, str) for v in value)
                       if tag == "ok" else tag in ("raised", "type") and isinstance(value, str))
        if not well_formed:  # the bootstrap never writes such a frame: something else in the sandbox did
            self.kill()
            return "type", "its sandboxed worker sent a malformed answer (worker killed)"
        return tag, value

    def kill(self) -> None:
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

    def close(self) -> None:
        self.kill()
