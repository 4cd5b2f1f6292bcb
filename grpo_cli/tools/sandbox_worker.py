"""A tool's worker inside the sandbox: the call protocol of tools.worker.Worker over length-prefixed frames, JSON
answers checked for each request's random key, never unpickled (docs/sandbox.md).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from grpo_cli.tools.cgroups import CallGroup, Limits
from grpo_cli.tools.sandbox import ancestors, bwrap_argv, interpreter
from grpo_cli.tools.seccomp import filter_fd, keyring_boot
from grpo_cli.tools.uids import UidLease, lease_uid
from grpo_cli.tools.worker import Malformed, Worker, WorkerDied

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
from grpo_cli.tools.worker import call_in_process
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
    """A tool's worker (tools.worker.Worker's call protocol, this module's transport) running inside the sandbox
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
