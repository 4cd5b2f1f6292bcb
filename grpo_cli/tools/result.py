"""What one tool call gives back to the trajectory, and what counts as its failure: its own module, so the
environment, the pool and the loader share it without importing one another."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

MAX_RESULT_CHARS = 4096  # a result is cut to this many characters before it is tokenized (a tool may print 1 MB)
MAX_ERROR_CHARS = 240  # an error the model reads


class ToolResult(NamedTuple):
    text: str  # what the model reads (a short error text when the call failed)
    ok: bool  # False: it raised, timed out or returned junk
    failure: str | None = None  # "timeout": it ran out of time | "budget": the step's tool time was spent (tools.pool)


def timeouts(results: Iterable[ToolResult]) -> int:
    """How many of these calls count toward rollout.max_tool_timeouts: those that ran out of time, their own or the
    step's tool budget (a call that raised or returned junk does not)."""
    return sum(result.failure is not None for result in results)


def result_of(tag: str, out: Any) -> ToolResult:
    """A worker's answer to one call, ("ok", [value]) or (failure tag, reason), as what the model reads: the
    value if it is text, else `error: ...` in a tool's own words (a `ToolFailed`) or in what happened to it.
    Only running out of time is a "timeout" (it counts toward rollout.max_tool_timeouts); raising or returning
    junk is a plain failure."""
    if tag == "ok":
        value = out[0]
        if not isinstance(value, str):
            return ToolResult(f"error: the tool returned {type(value).__name__}, not text", False)
        return ToolResult(value[:MAX_RESULT_CHARS], True)
    reason = str(out).removeprefix("raised ")
    if reason.startswith("ToolFailed: "):  # the tool's own account of what stopped it
        reason = reason.removeprefix("ToolFailed: ")
    else:
        reason = f"the tool {reason}"
    return ToolResult(f"error: {reason}"[:MAX_ERROR_CHARS], False, "timeout" if tag == "timeout" else None)
