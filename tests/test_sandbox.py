"""The sandbox against hostile code: the `python` tool's, a call at a time, and a trusted tool's worker in one
(`sandbox: bwrap`), tier 1: a second or so a call; docs/sandbox.md.

Each test is an attack a policy could learn, written as the model would write it, run through the tool as a
run loads it (`load_tools`, the default `sandbox: auto`). Each failed against the unsandboxed tool
(`python_unsandboxed`, the tool before issue 36): the file read, the write, the environment, the loopback
connection, the signal, the process list, the double-fork escape, the bounded fork bomb and the memory of
many processes.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from grpo_cli.config import ToolSpec
from grpo_cli.errors import UsageError
from grpo_cli.tools import builtin, cgroups, sandbox, uids
from grpo_cli.tools.load import call_tool, load_tools
from grpo_cli.tools.sandbox_worker import SandboxedWorker

REPO = Path(__file__).resolve().parents[1]


def run(code: str) -> tuple[str, bool]:
    """The built-in python tool as a run loads it (sandboxed, in process), on `code`: (text, ok)."""
    (tool,) = load_tools([ToolSpec(function="python", timeout_s=None)])
    result = call_tool(tool, code)
    return result.text, result.ok


def probe_files(paths: list[str], mode: str) -> dict[str, str]:
    """What the code got for each path: its start, or the error's type name."""
    code = f"""import json
out = {{}}
for path in {paths!r}:
    try:
        with open(path, {mode!r}) as f:
            out[path] = f.read(40) if {mode!r} == "r" else f.write("tampered") and "written"
    except OSError as e:
        out[path] = type(e).__name__
print(json.dumps(out))
"""
    text, ok = run(code)
    assert ok, text
    return json.loads(text)


def test_the_code_reads_no_file_outside_its_scratch_folder(tmp_path):
    secret = tmp_path / "heldout_answers.jsonl"
    secret.write_text('{"answer": 42}\n')
    netrc = Path.home() / ".netrc"
    got = probe_files([str(secret), str(REPO / "grpo_cli" / "rewards" / "builtin.py"), str(netrc), "/etc/passwd",
                       "/etc/hostname"], "r")
    assert set(got.values()) <= {"FileNotFoundError", "PermissionError"}, got


def test_the_code_writes_nowhere_but_its_scratch_folder(tmp_path):
    module = tmp_path / "pkg" / "builtin.py"  # a stand-in for an editable install's reward module
    module.parent.mkdir()
    module.write_text("REWARD = 'honest'\n")
    created = tmp_path / "created.txt"
    got = probe_files([str(module), str(created)], "a")
    assert "written" not in got.values(), got
    assert module.read_text() == "REWARD = 'honest'\n" and not created.exists()
    text, ok = run(f"import os; print([os.access(p, os.W_OK) for p in ('/usr/lib', {str(REPO)!r})])")
    assert ok and text == "[False, False]", text
    text, ok = run("open('note.txt', 'w').write('kept'); open('/tmp/t', 'w').write('x'); print(open('note.txt').read())")
    assert ok and text == "kept"  # its own scratch folder and /tmp are writable


def test_the_code_sees_none_of_the_trainers_environment():
    """Not in its own environment, nor through /proc: its parent's environ (PID 1, bwrap) is empty too."""
    host = [e for e in Path("/proc/self/environ").read_bytes().decode(errors="replace").split("\0")
            if e and e.split("=", 1)[0] not in ("PATH", "LANG", "LC_ALL", "TZ")]
    code = """import os
for path in (f"/proc/{os.getppid()}/environ", "/proc/1/environ", "/proc/self/environ"):
    try:
        print(open(path, "rb").read().decode(errors="replace"))
    except OSError as e:
        print(type(e).__name__)
"""
    text, ok = run(code)
    assert ok, text
    leaked = [e for e in host if e in text]
    assert host and not leaked, leaked[:5]


def test_the_code_has_no_network_not_even_the_hosts_loopback():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.setblocking(False)
    port = server.getsockname()[1]
    code = f"""import socket
try:
    s = socket.create_connection(("127.0.0.1", {port}), timeout=2)
    s.sendall(b"leak")
    print("connected")
except OSError as e:
    print(type(e).__name__)
"""
    try:
        text, ok = run(code)
        with pytest.raises(BlockingIOError):  # nothing knocked
            server.accept()
    finally:
        server.close()
    assert ok and text != "connected", text


def test_the_code_cannot_signal_or_see_host_processes():
    marker = f"victim-{uuid.uuid4().hex}"  # searched for as hex below, so the code's own argv does not hold it
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", marker])
    code = f"""import os
try:
    os.kill({victim.pid}, 9)
    print("killed")
except OSError as e:
    print(type(e).__name__)
pids = [p for p in os.listdir("/proc") if p.isdigit()]
marker = bytes.fromhex("{marker.encode().hex()}")
print(len(pids), any(marker in open(f"/proc/{{p}}/cmdline", "rb").read() for p in pids))
"""
    try:
        text, ok = run(code)
        time.sleep(0.2)
        assert victim.poll() is None, "the host process was killed"
    finally:
        victim.kill()
        victim.wait()
    killed, seen = text.splitlines()
    count, victim_seen = seen.split()
    assert ok and killed == "ProcessLookupError" and victim_seen == "False" and int(count) <= 3, text


def host_processes_with(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker.encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            pass
    return found


def test_a_double_fork_and_setsid_does_not_outlive_the_call():
    marker = f"escaped-{uuid.uuid4().hex}"
    code = f"""import os, sys
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(30)", "{marker}"])
    os._exit(0)
os.wait()
print("forked")
"""
    text, ok = run(code)
    time.sleep(0.3)
    left = host_processes_with(marker)
    for pid in left:
        os.kill(pid, 9)
    assert ok and text == "forked" and not left, left


def test_a_fork_bomb_stops_at_the_process_limit():
    code = """import os, time
started = 0
for _ in range(200):
    try:
        if os.fork() == 0:
            time.sleep(5)
            os._exit(0)
        started += 1
    except OSError:
        break
print(started)
"""
    started_at = time.monotonic()
    text, ok = run(code)
    assert ok and int(text) < builtin.PYTHON_PROCESSES, text
    assert time.monotonic() - started_at < builtin.PYTHON_WALL_SECONDS + 2  # the sleepers went with the call


def test_many_processes_share_one_memory_limit():
    """Six children of 150 MiB each: 900 MiB in all against the call's 512 MiB. Some are killed (or the call
    is, reported as over its memory), never all six alive at once."""
    code = """import os, select, time
readers = []
for _ in range(6):
    r, w = os.pipe()
    if os.fork() == 0:
        block = b"x" * (150 * 2**20)  # written, so resident
        os.write(w, b"ok")
        time.sleep(3)
        os._exit(0)
    os.close(w)
    readers.append(r)
alive, deadline = 0, time.monotonic() + 4
while readers and time.monotonic() < deadline:
    ready, _, _ = select.select(readers, [], [], 0.2)
    for r in ready:
        alive += os.read(r, 2) == b"ok"
        readers.remove(r)
print(alive)
"""
    text, ok = run(code)
    if ok:
        assert int(text) * 150 <= 512, text
    else:
        assert "over 512 MiB of memory, all its processes together" in text, text


def test_the_sandbox_missing_fails_closed_naming_the_opt_out(monkeypatch, capsys):
    monkeypatch.setattr(sandbox, "problem", lambda: "bwrap (bubblewrap) is not on PATH")
    with pytest.raises(UsageError, match=r"rollout.tools\[0\].sandbox: the sandbox for model-written code cannot be "
                                         r"made here: bwrap .*; set rollout.tools\[0\].sandbox=none"):
        load_tools([ToolSpec(function="python")])
    (bare,) = load_tools([ToolSpec(function="python", sandbox="none", timeout_s=None)])
    assert "runs model-written code without a sandbox" in capsys.readouterr().err
    assert call_tool(bare, "print(6 * 7)")[:2] == ("42", True)


def test_a_sandbox_that_breaks_mid_run_fails_the_call_not_open(monkeypatch):
    def broken(limits):
        raise PermissionError("cgroup.procs: permission denied")

    monkeypatch.setattr(sandbox, "CallGroup", broken)
    text, ok = run("print('ran')")
    assert not ok and text.startswith("error: could not run the code (PermissionError") and "ran" not in text


def test_sandbox_none_is_refused_where_it_means_nothing():
    with pytest.raises(UsageError, match=r"rollout.tools\[0\].sandbox: none applies to a tool that runs "):
        load_tools([ToolSpec(function="calculator", sandbox="none")])


def test_each_call_removes_its_cgroups(monkeypatch):
    made = []

    class Recorded(sandbox.CallGroup):
        def __init__(self, limits):
            super().__init__(limits)
            made.append(self)

    monkeypatch.setattr(sandbox, "CallGroup", Recorded)
    assert run("print(sum(range(10)))") == ("45", True)
    sandbox.settle()  # removed off the call's path
    (group,) = made
    assert group.dirs and not any(d.exists() for d in group.dirs)


def test_grpo_check_shows_the_sandbox_and_fails_closed_without_it(cli, monkeypatch):
    tools = "rollout.tools=[{function:python}]"
    shown = cli("check", "recipe=bike_pricing_tools", tools)
    assert shown.returncode == 0 and "rollout.tools[0] (python): model-written code runs in the sandbox" in shown.stdout
    worker = cli("check", "recipe=bike_pricing_tools", "rollout.tools=[{function:calculator,sandbox:bwrap}]")
    assert worker.returncode == 0 and "rollout.tools[0] (calculator): its worker lives in a sandbox" in worker.stdout
    monkeypatch.setattr(sandbox, "problem", lambda: "bwrap (bubblewrap) is not on PATH")
    refused = cli("check", "recipe=bike_pricing_tools", tools)
    assert refused.returncode == 2 and "set rollout.tools[0].sandbox=none" in refused.stdout + refused.stderr
    bare = cli("check", "recipe=bike_pricing_tools", "rollout.tools=[{function:python,sandbox:none}]")
    assert bare.returncode == 0 and "warning: rollout.tools[0].sandbox=none: python runs model-written code" in bare.stdout
    boxed = cli("check", "recipe=bike_pricing_tools", "rollout.tools=[{function:calculator,sandbox:bwrap}]")
    assert boxed.returncode == 2 and "set rollout.tools[0].sandbox=auto" in boxed.stdout + boxed.stderr


# ------------------------------------------------------- a trusted tool's worker in the sandbox (sandbox: bwrap)


def snoops(argument):
    """A trusted tool gone wrong (its parser exploited, say): what it can reach from its worker."""
    import json
    import os
    import socket

    host, port, secret = argument.split("|")
    seen = {"uid": os.getuid(), "processes": sum(p.isdigit() for p in os.listdir("/proc")),
            "home": os.path.exists(os.path.expanduser("~root")) and os.listdir("/root") != [],
            "secret": os.path.exists(secret), "own_module": os.path.exists(__file__)}
    try:
        socket.create_connection((host, int(port)), timeout=2).sendall(b"leak")
        seen["network"] = "connected"
    except OSError as e:
        seen["network"] = type(e).__name__
    try:
        with open(__file__, "a") as f:
            f.write("# tampered\n")
        seen["tamper"] = "written"
    except OSError as e:
        seen["tamper"] = type(e).__name__
    return json.dumps(seen)


def test_a_trusted_tools_worker_in_the_sandbox_reaches_nothing_of_the_host(tmp_path):
    """With `sandbox: bwrap` a tool that is not model-written code still gets its worker in a sandbox: the
    model's arguments reach it, so a tool that can be made to misbehave reads no host file but its own code,
    writes none, connects nowhere and sees no host process. Before, the key was accepted and ignored."""
    secret = tmp_path / "heldout_answers.jsonl"
    secret.write_text('{"answer": 42}\n')
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.setblocking(False)
    (tool,) = load_tools([ToolSpec(function="test_sandbox:snoops", timeout_s=30, sandbox="bwrap")])
    try:
        assert type(tool.worker) is SandboxedWorker
        result = call_tool(tool, f"127.0.0.1|{server.getsockname()[1]}|{secret}")
        with pytest.raises(BlockingIOError):  # nothing knocked
            server.accept()
    finally:
        server.close()
        tool.worker.close()
    assert result.ok, result.text
    seen = json.loads(result.text)
    assert seen["uid"] in (sandbox.spare_ids() or (sandbox.SANDBOX_UID,)) and seen["processes"] <= 3 and not seen["secret"] and not seen["home"]
    assert seen["own_module"] and seen["tamper"] != "written" and seen["network"] != "connected"
    assert not Path(__file__).read_text().endswith("# tampered\n")


def test_a_sandboxed_worker_answers_like_a_plain_one_and_dies_whole_on_its_timeout():
    (boxed,) = load_tools([ToolSpec(function="calculator", timeout_s=10, sandbox="bwrap")])
    (slow,) = load_tools([ToolSpec(function="test_tools:sleeps", open="<s>", close="</s>", timeout_s=1.0,
                                   sandbox="bwrap")])
    try:
        assert [call_tool(boxed, e).text for e in ("3 * 18.5", "1/0", "2 ** 9")] == \
            ["55.50", calculator_error := "error: not an arithmetic expression (numbers, + - * / and parentheses)",
             calculator_error]
        late = call_tool(slow, "x")
        assert late.failure == "timeout" and slow.worker.process is None and slow.worker.group is None
        assert call_tool(boxed, "1 + 1").text == "2.00"
    finally:
        boxed.worker.close()
        slow.worker.close()
    with pytest.raises(UsageError, match=r"rollout.tools\[0\].sandbox: bwrap runs the tool in a worker process "
                                         r"inside the sandbox; give it a rollout.tools\[0\].timeout_s"):
        load_tools([ToolSpec(function="calculator", timeout_s=None, sandbox="bwrap")])


def forges_a_frame(argument):
    """A tool steered into running code in its sandboxed worker writes its own answer frame on the worker's
    channel: a pickle that would run a command wherever it is unpickled, or half a frame, then silence."""
    import gc
    import io
    import pickle
    import struct
    import time

    channel = next(f for f in gc.get_objects() if isinstance(f, io.IOBase) and getattr(f, "mode", "") == "wb"
                   and not f.closed and f.fileno() > 2)

    class Payload:
        def __reduce__(self):
            return (__import__("os").system, (f"touch {argument}",))

    if argument == "half":
        channel.write(struct.pack("<I", 100) + b"x")
        channel.flush()
        time.sleep(60)
    data = pickle.dumps(("ok", [Payload()]))
    channel.write(struct.pack("<I", len(data)) + data)
    channel.flush()
    time.sleep(60)


def test_what_a_sandboxed_worker_sends_back_is_never_unpickled_and_half_a_frame_cannot_stall(tmp_path):
    marker = tmp_path / "ran_in_the_trainer"
    (tool,) = load_tools([ToolSpec(function="test_sandbox:forges_a_frame", timeout_s=3, sandbox="bwrap")])
    try:
        forged = call_tool(tool, str(marker))
        assert not forged.ok and not marker.exists()  # read as JSON: a pickle is junk, not code to run
        started = time.monotonic()
        half = call_tool(tool, "half")
        assert half.failure == "timeout" and time.monotonic() - started < 10  # the call's limit, not forever
    finally:
        tool.worker.close()


# --------------------------------------------------------------------------------- issue 53: whoever runs it
# The trainer runs as root here, as in many containers: each attack below got through before issue 53.

SYSCALLS = {"x86_64": {"add_key": 248, "request_key": 249, "keyctl": 250, "unshare": 272, "mount": 165,
                       "clone3": 435},
            "aarch64": {"add_key": 217, "request_key": 218, "keyctl": 219, "unshare": 97, "mount": 40,
                        "clone3": 435}}[os.uname().machine]
SYSCALL_HELPER = f"""import ctypes, errno, json
NR = {SYSCALLS!r}
libc = ctypes.CDLL(None, use_errno=True)
def call(name, *args):
    return "ok" if libc.syscall(NR[name], *args) >= 0 else errno.errorcode[ctypes.get_errno()]
"""


def test_the_code_is_no_host_root_for_the_kernel():
    """It runs as an unprivileged host uid with no capability: a kernel setting written back with its own value
    (harmless if it got through) and root-only /proc files are refused."""
    code = """import json, os
seen = {"ids": [*os.getresuid(), *os.getresgid()], "groups": os.getgroups()}
status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines())
seen["caps"] = [status[k].strip() for k in ("CapEff", "CapPrm", "CapBnd")]
for path in ("/proc/sys/kernel/core_pattern", "/proc/sys/vm/overcommit_ratio", "/proc/sys/kernel/hostname"):
    try:
        value = open(path).read()
        with open(path, "w") as f:
            f.write(value)
        seen[path] = "written"
    except OSError as e:
        seen[path] = type(e).__name__
for path in ("/proc/kcore", "/proc/1/environ", "/proc/keys"):
    try:
        seen[path] = len(open(path, "rb").read(16))
    except OSError as e:
        seen[path] = type(e).__name__
print(json.dumps(seen))
"""
    text, ok = run(code)
    assert ok, text
    seen = json.loads(text)
    uid = seen["ids"][0]
    assert uid in (sandbox.spare_ids() or (sandbox.SANDBOX_UID,)) and seen["ids"] == [uid] * 6, seen
    assert seen["groups"] == [], seen
    assert seen["caps"] == ["0000000000000000"] * 3, seen
    assert all(seen[p] in ("PermissionError", "OSError", "FileNotFoundError") for p in (  # /proc/sys: hidden
               "/proc/sys/kernel/core_pattern", "/proc/sys/vm/overcommit_ratio", "/proc/sys/kernel/hostname")), seen
    assert all(isinstance(seen[p], str) or seen[p] == 0 for p in ("/proc/kcore", "/proc/1/environ", "/proc/keys"))


def test_the_code_cannot_make_a_namespace_or_mount_to_lift_its_limits():
    """A nested user namespace (every capability inside) could mount the cgroup hierarchy and raise the call's
    memory and pids limits: no namespace of any kind can be made, nothing mounted, while plain forks and
    subprocess (clone3 answers ENOSYS, and the C library falls back to clone) still work."""
    code = SYSCALL_HELPER + """import os, subprocess
seen = {"userns": call("unshare", 0x10000000), "mountns": call("unshare", 0x00020000),
        "cgroupns": call("unshare", 0x02000000), "clone3": call("clone3", 0, 0),
        "mount": call("mount", b"none", b"/tmp", b"cgroup2", 0, 0)}
seen["subprocess"] = subprocess.run(["/bin/echo", "child"], capture_output=True, text=True).stdout.strip()
print(json.dumps(seen))
"""
    text, ok = run(code)
    assert ok, text
    assert json.loads(text) == {"userns": "EPERM", "mountns": "EPERM", "cgroupns": "EPERM", "clone3": "ENOSYS",
                                "mount": "EPERM", "subprocess": "child"}


def _keyctl(*args):
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    result = libc.syscall(SYSCALLS["keyctl"], *args)
    return result if result >= 0 else -ctypes.get_errno()


def test_keyrings_do_not_cross_the_boundary():
    """A secret in the trainer's session keyring is out of reach (no keyring call at all once the bootstrap has
    joined a new empty one, /proc/keys masked); a key planted in any keyring stays nowhere: not on the host, not
    for the next call."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    name = f"grpo-test-{uuid.uuid4().hex}".encode()
    assert _keyctl(1, name) > 0  # this test process joins a session keyring of its own, then stores a secret
    secret = libc.syscall(SYSCALLS["add_key"], b"user", b"grpo-secret", b"hunter2", 7, -3)  # @s
    assert secret > 0
    plant = SYSCALL_HELPER + """seen = {}
for ring, spec in (("session", -3), ("user", -4), ("user_session", -5)):
    seen["add_" + ring] = call("add_key", b"user", b"planted", b"from-the-sandbox", 16, spec)
    seen["search_" + ring] = call("keyctl", 10, spec, b"user", b"grpo-secret", 0)  # KEYCTL_SEARCH
seen["read_secret"] = call("keyctl", 11, """ + str(secret) + """, 0, 0)  # KEYCTL_READ by id
seen["join_named"] = call("keyctl", 1, b\"""" + name.decode() + """\")
seen["join_new"] = call("keyctl", 1, 0)
seen["request"] = call("request_key", b"user", b"planted", 0, -3)
try:
    seen["proc_keys"] = open("/proc/keys").read()
except OSError as e:
    seen["proc_keys"] = type(e).__name__
print(json.dumps(seen))
"""
    for _ in range(2):  # the second call finds nothing of the first
        text, ok = run(plant)
        assert ok, text
        seen = json.loads(text)
        assert "hunter2" not in text and "grpo-secret" not in seen["proc_keys"], seen
        assert seen.pop("proc_keys") in ("", "PermissionError"), seen
        assert set(seen.values()) == {"EPERM"}, seen
    assert _keyctl(10, -3, b"user", b"planted", 0) < 0 and _keyctl(10, -4, b"user", b"planted", 0) < 0
    buf = ctypes.create_string_buffer(64)
    assert libc.syscall(SYSCALLS["keyctl"], 11, secret, buf, 64) == 7 and buf.value == b"hunter2"  # still ours


def test_the_code_spends_no_host_disk(tmp_path, monkeypatch):
    """Its output is a pipe the tool reads up to the limit: fallocate on it reserves nothing, output past 16 KiB
    ends the call, and a sandboxed call leaves no folder on the host. `sandbox: none` still needs a home folder:
    those of killed processes are swept."""
    import tempfile

    before = set(Path(tempfile.gettempdir()).glob("grpo-*"))
    code = """import os
try:
    os.posix_fallocate(1, 0, 2**31)
    print("reserved")
except OSError as e:
    print(type(e).__name__, e.errno)
"""
    text, ok = run(code)
    assert ok and text.startswith("OSError") and "reserved" not in text, text
    text, ok = run("import sys\nfor _ in range(100):\n    sys.stdout.write('y' * 1024)\n")
    assert not ok and "over 16 KiB of output" in text
    assert set(Path(tempfile.gettempdir()).glob("grpo-*")) == before
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    stale = Path(tempfile.gettempdir()) / f"{builtin.HOME_PREFIX}{gone.pid}-x1"
    stale.mkdir()
    (stale / "reserved").write_bytes(b"\0" * 2**20)
    assert builtin.python_unsandboxed("print(3)") == "3"
    assert not stale.exists()


def writes_where_told(argument):
    """A trusted tool the model can steer: it writes the given bytes (hex) to the given path."""
    path, data = argument.split("|")
    with open(path, "wb") as f:
        f.write(bytes.fromhex(data))
    return "written"


def test_a_steered_trusted_tool_cannot_forge_its_workers_reply(tmp_path):
    """The worker's pipes are paths (/proc/self/fd/N): a tool told to write a frame there makes its call fail
    and its worker restart, never a forged answer, and the next call gets its own answer."""
    import struct

    frames = [json.dumps(["ok", ["forged"]]).encode(), json.dumps(["0" * 32, "ok", ["forged"]]).encode(),
              json.dumps(["0" * 32, ["forged"], {}]).encode()]
    (tool,) = load_tools([ToolSpec(function="test_sandbox:writes_where_told", timeout_s=10, sandbox="bwrap")])
    try:
        for fd in range(0, 8):
            for frame in frames:
                result = call_tool(tool, f"/proc/self/fd/{fd}|{(struct.pack('<I', len(frame)) + frame).hex()}")
                assert "forged" not in result.text, (fd, frame)
                honest = call_tool(tool, f"{'/tmp/own'}|{b'mine'.hex()}")
                assert (honest.text, honest.ok) == ("written", True), (fd, frame, honest)
    finally:
        tool.worker.close()


def test_the_code_sees_the_standard_library_only():
    """Not /usr/local, not the interpreter's site-packages nor the system's: a package installed into the base
    interpreter is out of reach even on sys.path; the standard library (C modules included) imports."""
    hidden = sandbox._hidden_dirs()
    assert hidden, "a machine with neither /usr/local nor a site-packages"
    code = f"""import json, os, sqlite3, sys, zlib
seen = {{d: (os.listdir(d) if os.path.isdir(d) else "absent") for d in {hidden!r}}}
sys.path[:0] = {hidden!r}
try:
    import pip
    seen["pip"] = "imported"
except ImportError:
    seen["pip"] = "ImportError"
print(json.dumps(seen))
"""
    text, ok = run(code)
    assert ok, text
    seen = json.loads(text)
    assert seen.pop("pip") == "ImportError"
    assert all(v in ([], "absent") for v in seen.values()), seen


def test_a_part_the_machine_lacks_fails_closed_in_one_line(monkeypatch):
    """No spare uid for a root trainer's code, no libseccomp: `problem()` names it (the run stops at the edge
    with it, as for a missing bwrap); nothing falls back to running as root or unfiltered."""
    from grpo_cli.tools import seccomp

    def forget():
        for cached in (sandbox.problem, uids.spare_ids, seccomp.program, seccomp.keyring_boot):
            cached.cache_clear()

    def missing():
        raise OSError("libseccomp is not installed (libseccomp.so.2: cannot open shared object file)")

    try:
        if os.geteuid() == 0:
            forget()
            monkeypatch.setattr(uids, "SPARE_HOST_IDS", range(0, 1))  # root's own: taken
            assert sandbox.problem().startswith("no spare uid in 0-0 for the code to run as")
            monkeypatch.undo()
        forget()
        monkeypatch.setattr(seccomp, "_library", missing)
        assert sandbox.problem().startswith("libseccomp is not installed")
    finally:
        monkeypatch.undo()
        forget()
    assert sandbox.problem() is None


# ------------------------------------------------------------------------ issue 64: calls against each other
# GRPO runs a group's calls at once, and a policy gains relative advantage by making its group-mates' calls fail,
# or by passing them bits. Each attack below got through before issue 64 (the trainer as root here, every call
# as one shared spare uid).

ROOT = os.geteuid() == 0


def _concurrently(hog: str, victim: str, victims: int, start_s: float = 0.7) -> tuple[tuple[str, bool], list]:
    """Run `hog` as one call and, once it has had `start_s` to set up, `victims` calls of `victim` one after the
    other while it still runs: (the hog's (text, ok), the victims' (text, ok))."""
    import threading

    hogged: list[tuple[str, bool]] = []
    thread = threading.Thread(target=lambda: hogged.append(run(hog)))
    thread.start()
    time.sleep(start_s)
    try:
        seen = [run(victim) for _ in range(victims)]
    finally:
        thread.join(30)
    return hogged[0], seen


def test_one_call_cannot_drain_the_key_quota_of_its_group_mates():
    """Joining new session keyrings in a loop (each one charged to the uid's quota of 200 keys) filled the shared
    uid's quota, and every concurrent call failed at its bootstrap's join: now the bootstrap's join is the last
    keyring call a call makes, and a concurrent call runs as another uid anyway."""
    hog = SYSCALL_HELPER + """import time
joined, end = 0, time.monotonic() + 2.5
while time.monotonic() < end:
    joined += call("keyctl", 1, 0) == "ok"
print(joined)
"""
    (hog_text, hog_ok), seen = _concurrently(hog, "print('answered')", victims=4)
    assert hog_ok and hog_text == "0", hog_text
    assert seen == [("answered", True)] * 4, seen


PIPE_HOG = """import os, time
held = [os.pipe() for _ in range(1200)]  # 1200 x 16 pages: past the uid's 16384 pipe pages
for _ in range(12):
    if os.fork() == 0:
        time.sleep(4)
        os._exit(0)
time.sleep(3)
print("held")
"""


@pytest.mark.skipif(not ROOT, reason="a uid of its own per call is a root trainer's")
def test_per_uid_quotas_and_process_counts_do_not_cross_calls():
    """Pipe pages and RLIMIT_NPROC's task count are per uid: with one uid for all calls, one call's 1200 pipes
    shrank a concurrent call's pipes to 2 pages, and its 12 sleeping processes made the other's fork fail under a
    small RLIMIT_NPROC (a count another call can read: a channel). Now each call runs as a uid of its own."""
    victim = """import fcntl, json, os, resource
r, w = os.pipe()
seen = {"pipe": fcntl.fcntl(r, 1032), "uid": os.getuid()}  # F_GETPIPE_SZ
resource.setrlimit(resource.RLIMIT_NPROC, (4, 4))
try:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    seen["fork"] = "ok"
except OSError as e:
    seen["fork"] = type(e).__name__
print(json.dumps(seen))
"""
    (hog_text, hog_ok), seen = _concurrently(PIPE_HOG.replace("print(\"held\")", "print(os.getuid())"), victim,
                                             victims=2)
    assert hog_ok, hog_text
    for text, ok in seen:
        assert ok, text
        got = json.loads(text)
        assert got["pipe"] == 65536 and got["fork"] == "ok" and got["uid"] != int(hog_text), (got, hog_text)


def test_inotify_message_queues_and_pipe_resizing_are_refused():
    """The rest of the per-uid quotas: inotify instances (and their watches on the shared read-only /usr, which
    would see what another call reads), POSIX message-queue bytes and F_SETPIPE_SZ are refused outright."""
    code = SYSCALL_HELPER + """import fcntl, os, resource
NR.update({"x86_64": {"inotify_init1": 294, "mq_open": 240}, "aarch64": {"inotify_init1": 26, "mq_open": 180}}[os.uname().machine])
seen = {"inotify": call("inotify_init1", 0), "mq_open": call("mq_open", b"/q", 0o100 | 2, 0o600, 0),
        "msgqueue_limit": list(resource.getrlimit(resource.RLIMIT_MSGQUEUE))}
r, w = os.pipe()
for name, command in (("setpipe", 1031), ("setpipe_high_bits", 1031 | 1 << 32)):
    try:
        seen[name] = libc.fcntl(r, ctypes.c_uint64(command), 1 << 20) >= 0 and "ok" or errno.errorcode[ctypes.get_errno()]
    except OSError as e:
        seen[name] = type(e).__name__
print(json.dumps(seen))
"""
    text, ok = run(code)
    assert ok, text
    assert json.loads(text) == {"inotify": "EPERM", "mq_open": "EPERM", "msgqueue_limit": [0, 0],
                                "setpipe": "EPERM", "setpipe_high_bits": "EPERM"}


def test_file_locks_on_shared_files_are_refused():
    """A lock on a file bound read-only from the host is seen by every call and by host processes: a channel, and
    a way to hold off the host. flock and fcntl's record, open-file-description and lease commands are refused
    (ENOLCK), high bits on the command included; a lock held on the host is not even readable."""
    import fcntl

    target = os.path.realpath(os.__file__)  # the standard library: bound inside, the same inode
    code = SYSCALL_HELPER + f"""import fcntl, os, struct
f = open({target!r}, "rb")
seen = {{}}
for name, do in (("flock", lambda: fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)),
                 ("lockf", lambda: fcntl.lockf(f, fcntl.LOCK_SH | fcntl.LOCK_NB)),
                 ("getlk", lambda: fcntl.fcntl(f, fcntl.F_GETLK, struct.pack("hhqqi", fcntl.F_WRLCK, 0, 0, 0, 0))),
                 ("ofd", lambda: fcntl.fcntl(f, 37, struct.pack("hhqqi", fcntl.F_RDLCK, 0, 0, 0, 0))),
                 ("lease", lambda: fcntl.fcntl(f, 1024, fcntl.F_RDLCK)),
                 ("notify", lambda: fcntl.fcntl(os.open("/usr", os.O_RDONLY), 1026, 1))):
    try:
        do()
        seen[name] = "ok"
    except OSError as e:
        seen[name] = errno.errorcode[e.errno]
lock = struct.pack("hhqqi", fcntl.F_RDLCK, 0, 0, 0, 0)
seen["setlk_high_bits"] = libc.fcntl(f.fileno(), ctypes.c_uint64(6 | 1 << 32), lock) >= 0 and "ok" or errno.errorcode[ctypes.get_errno()]
try:  # the host's locks, with their files' inodes: masked
    seen["proc_locks"] = open("/proc/locks").read()
except OSError as e:
    seen["proc_locks"] = type(e).__name__
print(json.dumps(seen))
"""
    with open(target, "rb") as held:  # the host holds a lock the code must not see
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        text, ok = run(code)
    assert ok, text
    seen = json.loads(text)
    assert seen.pop("proc_locks") in ("", "PermissionError"), seen
    assert seen == {k: "ENOLCK" for k in ("flock", "lockf", "getlk", "ofd", "lease", "notify", "setlk_high_bits")}


def test_the_page_cache_cannot_be_probed_or_evicted():
    """Whether a page of a shared read-only file is cached is host state: a call that evicted pages
    (posix_fadvise DONTNEED) could leave bits that a later call reads back (preadv2 RWF_NOWAIT, mincore,
    cachestat). Every such call is refused; reading the file still works."""
    code = SYSCALL_HELPER + """import mmap, os
NR.update({"x86_64": {"readahead": 187, "cachestat": 451, "preadv2": 327},
           "aarch64": {"readahead": 213, "cachestat": 451, "preadv2": 286}}[os.uname().machine])
fd = os.open(os.__file__, os.O_RDONLY)
seen = {"read": len(os.pread(fd, 16, 0))}
for name, do in (("fadvise", lambda: os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)),
                 ("willneed", lambda: os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)),
                 ("nowait", lambda: os.preadv(fd, [bytearray(16)], 0, os.RWF_NOWAIT))):
    try:
        do()
        seen[name] = "ok"
    except OSError as e:
        seen[name] = errno.errorcode[e.errno]
seen["readahead"] = call("readahead", fd, 0, 4096)
seen["cachestat"] = call("cachestat", fd, 0, 0, 0)
m = mmap.mmap(fd, 4096, prot=mmap.PROT_READ)
libc.mmap.restype, libc.mmap.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                                          ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
page, residency = libc.mmap(None, 4096, 1, 2, fd, 0), ctypes.create_string_buffer(1)  # PROT_READ, MAP_PRIVATE
seen["mincore"] = "ok" if libc.mincore(page, 4096, residency) == 0 else errno.errorcode[ctypes.get_errno()]
for name, advice in (("pageout", 21), ("cold", 20)):
    try:
        m.madvise(advice)
        seen[name] = "ok"
    except OSError as e:
        seen[name] = errno.errorcode[e.errno]
print(json.dumps(seen))
"""
    text, ok = run(code)
    assert ok, text
    seen = json.loads(text)
    assert seen.pop("read") == 16, seen
    import errno

    assert seen == {"fadvise": "EPERM", "willneed": "EPERM", "nowait": errno.errorcode[errno.EOPNOTSUPP],
                    "readahead": "EPERM",
                    "cachestat": "EPERM", "mincore": "EPERM", "pageout": "EPERM", "cold": "EPERM"}, seen


def test_only_local_socket_families_can_be_made():
    """AF_VSOCK sockets are outside the call's network namespace: a port one call binds is taken for the others
    and for the host. Only AF_UNIX and the internet families (inside its own empty network namespace) are made;
    vsock, netlink, packet and the rest, and a family with high bits set, are refused."""
    code = SYSCALL_HELPER + """import os, socket
NR.update({"x86_64": {"socket": 41, "socketpair": 53}, "aarch64": {"socket": 198, "socketpair": 199}}[os.uname().machine])
seen = {}
for name, family in (("unix", 1), ("inet", 2), ("inet6", 10), ("vsock", 40), ("netlink", 16), ("packet", 17),
                     ("bluetooth", 31), ("alg", 38), ("zero", 0), ("rose", 11), ("vsock_high_bits", 40 | 1 << 32),
                     ("unix_high_bits", 1 | 1 << 32)):
    seen[name] = call("socket", ctypes.c_uint64(family), ctypes.c_long(2), ctypes.c_long(0))  # SOCK_DGRAM
seen["pair_unix"] = "ok" if len(socket.socketpair()) == 2 else "?"
seen["pair_vsock"] = call("socketpair", 40, 1, 0, ctypes.addressof((ctypes.c_int * 2)()))
print(json.dumps(seen))
"""
    text, ok = run(code)
    assert ok, text
    seen = json.loads(text)
    assert {k: seen.pop(k) for k in ("unix", "inet", "inet6", "pair_unix")} == dict.fromkeys(
        ("unix", "inet", "inet6", "pair_unix"), "ok")
    assert set(seen.values()) == {"EAFNOSUPPORT"}, seen


def reads_a_path(argument):
    """A trusted tool whose path argument the model steers: it lists what it is pointed at."""
    import json
    import os

    seen = {}
    for path in json.loads(argument):
        try:
            seen[path] = sorted(os.listdir(path)) if os.path.isdir(path) else os.stat(path) and "file"
        except OSError as e:
            seen[path] = type(e).__name__
    return json.dumps(seen)


def test_a_steered_bwrap_tool_sees_the_package_and_its_module_not_the_checkout():
    """Under `make install`'s editable install the folder holding grpo_cli is the checkout: a `sandbox: bwrap`
    tool steered to list it read runs/ (held-out data, checkpoints), recipes/ and .git. It now sees the grpo_cli
    package and its own module's file, and nothing beside them."""
    tests = Path(__file__).resolve().parent
    paths = [str(REPO), str(REPO / ".git"), str(REPO / "recipes"), str(REPO / "runs"), str(REPO / "pyproject.toml"),
             str(tests), str(tests / "conftest.py"), str(REPO / "grpo_cli" / "tools")]
    (tool,) = load_tools([ToolSpec(function="test_sandbox:reads_a_path", timeout_s=30, sandbox="bwrap")])
    try:
        result = call_tool(tool, json.dumps(paths))
    finally:
        tool.worker.close()
    assert result.ok, result.text
    seen = json.loads(result.text)
    venv = {Path(p).resolve().relative_to(REPO).parts[0] for p in sys.path  # its site-packages, where a venv is in it
            if "site-packages" in p and Path(p).resolve().is_relative_to(REPO)}
    assert seen[str(REPO)] == sorted({"grpo_cli", "tests"} | venv) and seen[str(tests)] == ["test_sandbox.py"], seen
    assert all(seen[p] == "FileNotFoundError" for p in paths[1:5] + paths[6:7]), seen
    assert "sandbox.py" in seen[str(REPO / "grpo_cli" / "tools")]


def test_the_sweeper_outlives_a_cgroup_removed_under_it():
    """The thread that empties and removes finished calls' cgroups died on a cgroup that was already gone, and
    no later call's cgroup was removed (nor its uid given back) for the rest of the run."""
    import threading

    assert sandbox.problem() is None  # its trial call made now, not inside the recording below
    vanished = sandbox.CallGroup(sandbox.Limits(wall_s=1, memory_bytes=2**26, processes=4))
    vanished.remove()  # gone before the sweeper gets there
    sandbox._sweep_later(vanished)
    made = []

    class Recorded(sandbox.CallGroup):
        def __init__(self, limits):
            super().__init__(limits)
            made.append(self)

    original = sandbox.CallGroup
    sandbox.CallGroup = Recorded
    try:
        assert run("print(6 * 7)") == ("42", True)
    finally:
        sandbox.CallGroup = original
    waiter = threading.Thread(target=sandbox.settle, daemon=True)
    waiter.start()
    waiter.join(15)
    assert not waiter.is_alive(), "the sweeper stopped: a later call's cgroup was never removed"
    assert made and not any(d.exists() for group in made for d in group.dirs)


def test_a_call_gets_at_most_its_cpu_share():
    """Nothing limited a call's CPU: 28 busy processes of one call slowed a concurrent call 1.6x with the kernel's
    autogroup on, and would starve it with autogroup off. A call's cgroup now has a CPU quota: four busy
    processes of a call allowed a quarter of a CPU get about that, on a machine with CPUs to spare."""
    code = """import os, time
end = time.monotonic() + 1.5
children = []
for _ in range(4):
    if (pid := os.fork()) == 0:
        while time.monotonic() < end:
            pass
        os._exit(0)
    children.append(pid)
for pid in children:
    os.waitpid(pid, 0)
t = os.times()
print(t.children_user + t.children_system)
"""
    limits = sandbox.Limits(wall_s=10, memory_bytes=2**28, processes=8, cpus=0.25)
    finished = sandbox.run([sandbox.interpreter(), "-I", "-S", "-c", code], limits, 4096)
    assert finished.exit_code == 0, finished.output
    cpu_s = float(finished.output)
    assert 0.1 < cpu_s < 0.25 * 1.5 * 1.3, cpu_s  # 1.5 s of wall at a quarter CPU, and a margin
    assert builtin.PYTHON_CPUS == 1.0


@pytest.mark.skipif(not ROOT, reason="a uid of its own per call is a root trainer's")
def test_sixteen_concurrent_calls_answer_each_as_a_uid_of_its_own():
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(16) as pool:
        seen = list(pool.map(lambda _: run("import os, time; time.sleep(1.5); print(os.getuid())"), range(16)))
    assert all(ok for _, ok in seen), seen
    uids = {int(text) for text, _ in seen}
    assert len(uids) == 16 and uids <= set(sandbox.spare_ids()), uids


@pytest.mark.skipif(not ROOT, reason="a uid of its own per call is a root trainer's")
def test_two_trainers_on_one_host_never_share_a_uid():
    """Another trainer process (here a second Python) calling at the same time leases another uid: the leases are
    files under /run that every trainer on the host locks."""
    other = subprocess.Popen([sys.executable, "-c", "from grpo_cli.tools import builtin; print(builtin.python("
                              "'import os, time; print(os.getuid()); time.sleep(3)'), flush=True)"],
                             stdout=subprocess.PIPE, text=True, cwd=REPO)
    time.sleep(1.5)
    try:
        mine, ok = run("import os; print(os.getuid())")
    finally:
        theirs = other.communicate(timeout=60)[0].strip()
    assert ok and other.returncode == 0 and int(mine) != int(theirs), (mine, theirs)


@pytest.mark.skipif(not ROOT, reason="a uid of its own per call is a root trainer's")
def test_a_lease_left_by_a_killed_trainer_is_recovered_with_its_processes_killed():
    """A trainer SIGKILLed while it holds a uid leaves no lease (the kernel drops its lock) but may leave that
    uid's processes: the next trainer's first lease kills them and marks the uid clean."""
    sandbox.settle()  # this process's own leases given back
    holder = subprocess.Popen([sys.executable, "-c", "from grpo_cli.tools import uids; import time; "
                               "print(uids.lease_uid().uid, flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        uid = int(holder.stdout.readline())
        leftover = subprocess.Popen(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "sleep", "60"])
        time.sleep(0.3)
        assert leftover.pid in uids.uid_processes(uid)
    finally:
        holder.kill()  # SIGKILL: no cleanup of its own
        holder.wait()
    assert (uids.LEASE_DIR / str(uid)).read_bytes()[:1] == b"1"  # marked in use when it died
    uids._recover_leases.cache_clear()  # as in a trainer started now
    lease = uids.lease_uid()
    try:
        assert uids.uid_processes(uid) == [] and leftover.wait(5) == -9
        assert (uids.LEASE_DIR / str(uid)).read_bytes()[:1] == (b"1" if lease.uid == uid else b"0")
    finally:
        lease.give_back()


def test_host_wide_counters_another_call_moves_are_not_readable():
    """The RLIMIT_NPROC channel's variants: the host's task count is in /proc/loadavg (its total), /proc/stat
    (processes, procs_running) and sysinfo(2), open files in /proc/sys/fs/file-nr, free memory in /proc/meminfo;
    a call that forks, opens or allocates moves them and another reads them at once. They are masked (sysinfo
    refused, /proc/sys an empty folder), while the code's own /proc stays readable."""
    code = SYSCALL_HELPER + """import os
NR["sysinfo"] = {"x86_64": 99, "aarch64": 179}[os.uname().machine]
seen = {"sysinfo": call("sysinfo", ctypes.addressof(ctypes.create_string_buffer(256))),
        "own_status": open("/proc/self/status").read().startswith("Name:")}
for path in ("/proc/loadavg", "/proc/stat", "/proc/meminfo", "/proc/vmstat", "/proc/uptime",
             "/proc/sys/fs/file-nr", "/proc/sys/kernel/pty/nr", "/proc/pressure/cpu"):
    try:
        seen[path] = open(path).read()[:40]
    except OSError as e:
        seen[path] = type(e).__name__
seen["sys"] = os.listdir("/proc/sys")
print(json.dumps(seen))
"""
    text, ok = run(code)
    assert ok, text
    seen = json.loads(text)
    assert seen.pop("sysinfo") == "EPERM" and seen.pop("own_status") is True and seen.pop("sys") == [], seen
    assert all(v in ("", "PermissionError", "FileNotFoundError") for v in seen.values()), seen


def test_a_stray_cgroup_name_does_not_stop_calls():
    """A folder named like a call's cgroup but not one (no pid in its name) beside the calls' cgroups made every
    call fail while it looked for orphans to remove."""
    _, parents = cgroups._cgroup_parents()
    stray = next(iter(parents.values())) / "grpo-sandbox-stray-0"
    stray.mkdir()
    try:
        assert run("print('still answers')") == ("still answers", True)
    finally:
        stray.rmdir()


def test_one_sweeper_removes_the_folders_of_dead_processes_only(tmp_path):
    """cgroups.sweep_stale is the one sweeper of per-process folders (a call's cgroup, a `sandbox: none` home;
    issue 66): a folder whose creator is gone goes, one of a live process or of this one stays."""
    import shutil


    dead = next(pid for pid in range(4_000_000, 4_100_000) if not Path(f"/proc/{pid}").exists())
    names = {"dead": f"grpo-python-{dead}-ab", "mine": f"grpo-python-{os.getpid()}-cd", "init": "grpo-python-1-ef",
             "other": f"grpo-sandbox-{dead}-1"}
    for name in names.values():
        (tmp_path / name / "inside").mkdir(parents=True)
    cgroups.sweep_stale(tmp_path, "grpo-python-", shutil.rmtree)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(v for k, v in names.items() if k != "dead")
    cgroups.sweep_stale(tmp_path, "grpo-sandbox-", Path.rmdir)  # rmdir fails on a folder with files: left for later
    assert (tmp_path / names["other"]).is_dir()


def test_a_failed_trial_is_tried_again_and_a_passed_one_kept(monkeypatch):
    """problem() cached its first answer for the process's life, a failure too: one cgroup write refused for a
    moment (seen with two test workers side by side) failed every later tool load closed."""
    calls = []
    real_run = sandbox.run

    def glitch_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise PermissionError(13, "Permission denied", "cgroup.procs")
        return real_run(*args, **kwargs)

    sandbox.problem.cache_clear()
    monkeypatch.setattr(sandbox, "run", glitch_once)
    try:
        assert sandbox.problem().startswith("cannot make the call's uid lease or cgroup")
        assert sandbox.problem() is None and sandbox.problem() is None
        assert len(calls) == 2  # the failure was tried again; the pass is kept
    finally:
        monkeypatch.undo()
