"""What one tool call gives back to the trajectory: its own module, so the environment, the pool and the loader
share it without importing one another."""

from __future__ import annotations

from typing import NamedTuple


class ToolResult(NamedTuple):
    text: str  # what the model reads (a short error text when the call failed)
    ok: bool  # False: it raised, timed out or returned junk
    failure: str | None = None  # "timeout": it ran out of time | "budget": the step's tool time was spent (tools.pool)
