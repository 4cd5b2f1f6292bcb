"""Built-in tools. A tool takes the text the model wrote between its call tags and returns the result text."""

from __future__ import annotations

import math
import os
import sys
import tempfile
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path

import grpo_cli.tools.cgroups as cgroups
import grpo_cli.tools.sandbox as sandbox
import grpo_cli.tools.seccomp as seccomp
from grpo_cli.tools.arithmetic import parse_expression

ToolFn = Callable[[str], str]


class ToolFailed(Exception):
    """Raised by a tool that could not do its job (a limit hit): the model reads `error: MESSAGE`, and the
    call counts as failed."""


def format_amount(value: Fraction) -> str:
    """An exact value to two decimals, halves away from zero: Fraction(1, 8) -> '0.13', -2.5 -> '-2.50'."""
    cents = math.floor(abs(value) * 100 + Fraction(1, 2))
    sign = "-" if value < 0 and cents else ""
    return f"{sign}{cents // 100}.{cents % 100:02d}"


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly: numbers (decimals too), + - * / and parentheses.

    Returns the value to two decimals ('3 * 18.5' -> '55.50'), or a short error for anything else (a
    name, a power, a division by zero, over 120 characters). Parsed, never `eval`ed.

    Args:
        expression: numbers, + - * / and parentheses, e.g. (72.00 + 5.00) * 0.9
    """
    parsed = parse_expression(expression.replace("x", "*"), decimals=True)
    if parsed is None:
        return "error: not an arithmetic expression (numbers, + - * / and parentheses)"
    return format_amount(parsed[0])


# The `python` tool's limits, per call (docs/tools.md; docs/sandbox.md says what the sandbox isolates).
PYTHON_CPU_SECONDS = 5  # CPU time (RLIMIT_CPU); a loop forever is killed by the kernel
PYTHON_WALL_SECONDS = 8.0  # wall time (a sleep uses no CPU), then every process of the call is killed; under timeout_s's 10
PYTHON_MEMORY_BYTES = 512 * 2**20  # address space per process (RLIMIT_AS); in the sandbox also all processes together
PYTHON_PROCESSES = 32  # processes (and threads) at once, in the sandbox (its cgroup's pids.max)
PYTHON_CPUS = 1.0  # CPU seconds per wall second, all its processes together, in the sandbox (its cgroup's quota)
PYTHON_OUTPUT_BYTES = 16 * 2**10  # stdout + stderr, read from a pipe up to this; more ends the call (and RLIMIT_FSIZE)
PYTHON_KEPT_ENV = ("PATH", "LANG", "LC_ALL", "TZ")  # unsandboxed: everything else (API keys, tokens) is dropped


# The child joins a new session keyring and locks the keyrings (seccomp.keyring_boot) and sets its own limits
# (from its arguments), then runs the code; no preexec_fn, which is unsafe in a process with threads (the
# trainer's, when a tool runs in process). No POSIX message queue bytes (RLIMIT_MSGQUEUE): they count against
# the uid (issue 64; the filter refuses mq_open too).
_BOOTSTRAP = """import resource, sys
_F(("prctl", _D))(1, 9)  # PR_SET_PDEATHSIG, SIGKILL: killed with its parent (a tool worker killed on its timeout)
cpu, memory, output, code = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
for limit, value in ((resource.RLIMIT_CPU, cpu), (resource.RLIMIT_AS, memory), (resource.RLIMIT_FSIZE, output),
                     (resource.RLIMIT_CORE, 0), (resource.RLIMIT_MSGQUEUE, 0)):
    resource.setrlimit(limit, (value, value + (limit == resource.RLIMIT_CPU)))  # CPU: SIGXCPU, then SIGKILL
del sys.argv[1:5]
exec(compile(code, "<code>", "exec"), {"__name__": "__main__"})
"""


def _signal_of(exit_code: int, sandboxed: bool) -> int | None:
    """The signal that ended the code: a negative exit code from Popen, or 128 + N from bwrap, which reports
    its child's death by signal N that way."""
    if exit_code < 0:
        return -exit_code
    return exit_code - 128 if sandboxed and 128 < exit_code < 160 else None


def _stopped(exit_code: int | None, oom_killed: bool, full: bool, sandboxed: bool) -> str | None:
    """Why the code did not finish cleanly, in the model's words; None when it did."""
    if exit_code is None:
        return f"stopped: over {PYTHON_WALL_SECONDS:g} s of wall time"
    if oom_killed:
        return f"stopped: over {PYTHON_MEMORY_BYTES // 2**20} MiB of memory, all its processes together"
    signal = _signal_of(exit_code, sandboxed)
    if signal == 24:  # SIGXCPU at the CPU limit (a process that ignores it gets SIGKILL a second later)
        return f"stopped: over {PYTHON_CPU_SECONDS} s of CPU time"
    if full:  # Python ignores SIGXFSZ: its writes past the limit fail, and the output stays cut there
        return f"stopped: over {PYTHON_OUTPUT_BYTES // 1024} KiB of output"
    if signal is not None:
        return f"killed by signal {signal}"
    return f"exited with code {exit_code}" if exit_code != 0 else None


HOME_PREFIX = "grpo-python-"  # `sandbox: none`'s home folders: grpo-python-PID-XXXX in the system's temp folder


def _sweep_homes() -> None:
    """Remove the home folders of `sandbox: none` calls whose process is gone (a tool worker killed on its
    timeout mid-call leaves its folder and what the code wrote there): cgroups.sweep_stale, the one sweeper."""
    import shutil

    cgroups.sweep_stale(Path(tempfile.gettempdir()), HOME_PREFIX, lambda d: shutil.rmtree(d, ignore_errors=True))


def _run_bare(program: list[str]) -> tuple[int | None, bytes, bool]:
    """The code as the trainer's user, in an empty folder, without the trainer's environment (no sandbox)."""
    _sweep_homes()
    with tempfile.TemporaryDirectory(prefix=f"{HOME_PREFIX}{os.getpid()}-") as home:
        env = {k: os.environ[k] for k in PYTHON_KEPT_ENV if k in os.environ} | {"HOME": home, "TMPDIR": home}
        # its own session: what it started in its group goes too at the end (a setsid escapes this: docs/sandbox.md)
        return sandbox.supervise([sys.executable, "-I", *program], PYTHON_WALL_SECONDS, PYTHON_OUTPUT_BYTES, env,
                                 cwd=home)


def _run_python(code: str, sandboxed: bool) -> str:
    limits = [str(PYTHON_CPU_SECONDS), str(PYTHON_MEMORY_BYTES), str(PYTHON_OUTPUT_BYTES)]
    program = ["-c", seccomp.keyring_boot(lock=sandboxed) + _BOOTSTRAP, *limits, code]
    if "\0" in code:
        raise ToolFailed("could not run the code (ValueError: a NUL byte)")
    oom_killed = False
    try:
        if sandboxed:  # stdlib only (-S)
            call = cgroups.Limits(PYTHON_WALL_SECONDS, PYTHON_MEMORY_BYTES, PYTHON_PROCESSES, PYTHON_CPUS)
            finished = sandbox.run([sandbox.interpreter(), "-I", "-S", *program], call, PYTHON_OUTPUT_BYTES)
            exit_code, oom_killed = finished.exit_code, finished.oom_killed
            output, full = finished.output, finished.output_cut
        else:
            exit_code, output, full = _run_bare(program)
    except OSError as e:  # the sandbox could not be made for this call: fail closed
        raise ToolFailed(f"could not run the code ({type(e).__name__}: {e})"[:200]) from None
    text = output.decode("utf-8", errors="replace").rstrip("\n")
    stopped = _stopped(exit_code, oom_killed, full, sandboxed)
    if stopped is None:
        return text
    raise ToolFailed(f"{stopped}; it printed: {text[-160:]}" if text.strip() else stopped)


def python(code: str) -> str:
    """Run Python code in a sandbox and return what it printed (stdout, then stderr).

    Each call runs in a fresh sandbox: no network, no files but the Python standard library (read-only) and
    an empty working directory, and limits: 5 s of CPU, 8 s of wall time, 512 MiB of memory, 32 processes,
    16 KiB of output. Code that raises, or goes over a limit, fails: the model reads why and the end of
    what the code printed.

    Args:
        code: a Python program; what it prints is the result
    """
    return _run_python(code, sandboxed=True)


def python_unsandboxed(code: str) -> str:
    """Run Python code in a fresh process and return what it printed (stdout, then stderr).

    The code runs as the trainer's user in an empty temporary directory, without the trainer's environment,
    under limits: 5 s of CPU, 8 s of wall time, 512 MiB of address space, 16 KiB of output. Code that
    raises, or goes over a limit, fails: the model reads why and the end of what the code printed.

    Args:
        code: a Python program; what it prints is the result
    """
    return _run_python(code, sandboxed=False)


python.untrusted_code = True  # type: ignore[attr-defined]  # load_tools: needs the sandbox, or `sandbox: none`


def runs_untrusted_code(fn: ToolFn | None) -> bool:
    """A tool that runs model-written code: it says so with `untrusted_code = True` (the built-in python does)."""
    return bool(getattr(fn, "untrusted_code", False))


UNSANDBOXED_TOOLS: dict[str, ToolFn] = {"python": python_unsandboxed}  # what `sandbox: none` runs instead


BUILTIN_TOOLS: dict[str, ToolFn] = {"calculator": calculator, "python": python}
