"""Built-in tools. A tool takes the text the model wrote between its call tags and returns the result text."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from fractions import Fraction

from grpo_cli.rewards.arithmetic import parse_expression

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


# The `python` tool's limits, per call (docs/tools.md says what they do not isolate).
PYTHON_CPU_SECONDS = 5  # CPU time (RLIMIT_CPU); a loop forever is killed by the kernel
PYTHON_WALL_SECONDS = 8.0  # wall time (a sleep uses no CPU), then the process group is killed; under timeout_s's 10
PYTHON_MEMORY_BYTES = 512 * 2**20  # address space (RLIMIT_AS): an unbounded allocation fails with MemoryError
PYTHON_OUTPUT_BYTES = 16 * 2**10  # stdout + stderr (RLIMIT_FSIZE on the file they go to)
PYTHON_KEPT_ENV = ("PATH", "LANG", "LC_ALL", "TZ")  # everything else (API keys, tokens, proxies) is dropped


# The child sets its own limits (from its arguments), then runs the code; no preexec_fn, which is unsafe in
# a process with threads (the trainer's, when a tool runs in process).
_BOOTSTRAP = """import resource, sys
try:  # Linux: killed with its parent (a tool worker killed on its timeout takes the code with it)
    import ctypes
    ctypes.CDLL(None).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
except Exception:
    pass
cpu, memory, output, code = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
for limit, value in ((resource.RLIMIT_CPU, cpu), (resource.RLIMIT_AS, memory), (resource.RLIMIT_FSIZE, output),
                     (resource.RLIMIT_CORE, 0)):
    resource.setrlimit(limit, (value, value + (limit == resource.RLIMIT_CPU)))  # CPU: SIGXCPU, then SIGKILL
del sys.argv[1:5]
exec(compile(code, "<code>", "exec"), {"__name__": "__main__"})
"""


def python(code: str) -> str:
    """Run Python code in a fresh process and return what it printed (stdout, then stderr).

    Each call gets an empty temporary directory as its working directory and home, an environment with
    only PATH and the locale, `python -I` (no user site, no PYTHON* variables), and limits: 5 s of CPU,
    8 s of wall time, 512 MiB of address space, 16 KiB of output. Code that raises, or goes over a
    limit, fails (ToolFailed): the model reads why and the end of what the code printed.

    Args:
        code: a Python program; what it prints is the result
    """
    limits = [str(PYTHON_CPU_SECONDS), str(PYTHON_MEMORY_BYTES), str(PYTHON_OUTPUT_BYTES)]
    with tempfile.TemporaryDirectory(prefix="grpo-python-") as root:
        home, out_path = os.path.join(root, "home"), os.path.join(root, "output")  # the output file out of its sight
        os.mkdir(home)
        env = {k: os.environ[k] for k in PYTHON_KEPT_ENV if k in os.environ} | {"HOME": home, "TMPDIR": home}
        with open(out_path, "wb") as out:
            try:
                proc = subprocess.Popen([sys.executable, "-I", "-c", _BOOTSTRAP, *limits, code], cwd=home, env=env,
                                        stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                        start_new_session=True)  # its own group: a timeout kills what it started
            except (OSError, ValueError) as e:  # e.g. a NUL byte in the code
                raise ToolFailed(f"could not run the code ({type(e).__name__})") from None
            try:
                exit_code: int | None = proc.wait(PYTHON_WALL_SECONDS)
            except subprocess.TimeoutExpired:
                exit_code = None
            try:  # whatever it started in the background goes too
                os.killpg(proc.pid, 9)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
        with open(out_path, "rb") as f:
            text = f.read(PYTHON_OUTPUT_BYTES).decode("utf-8", errors="replace").rstrip("\n")
        full = os.path.getsize(out_path) >= PYTHON_OUTPUT_BYTES
    if exit_code is None:
        stopped = f"stopped: over {PYTHON_WALL_SECONDS:g} s of wall time"
    elif exit_code in (-9, -24):  # SIGXCPU at the CPU limit, SIGKILL a second later
        stopped = f"stopped: over {PYTHON_CPU_SECONDS} s of CPU time"
    elif full:  # Python ignores SIGXFSZ: its writes past the limit fail, and the output stays cut there
        stopped = f"stopped: over {PYTHON_OUTPUT_BYTES // 1024} KiB of output"
    elif exit_code != 0:
        stopped = f"exited with code {exit_code}" if exit_code > 0 else f"killed by signal {-exit_code}"
    else:
        return text
    raise ToolFailed(f"{stopped}; it printed: {text[-160:]}" if text.strip() else stopped)


BUILTIN_TOOLS: dict[str, ToolFn] = {"calculator": calculator, "python": python}
