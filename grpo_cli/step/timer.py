"""`StepTimer`: the seconds of each phase of a step, which the stages fill and the metrics line reads."""

from __future__ import annotations

import contextlib
import time
from typing import Any


class StepTimer(dict):
    """Seconds per phase of a step, `{"generate": 1.0, ...}`: `with timings("update"): ...` times one
    (a phase timed twice in a step, e.g. several sampling rounds, adds up)."""

    def __call__(self, phase: str) -> Any:
        @contextlib.contextmanager
        def timed() -> Any:
            tick = time.time()
            try:
                yield
            finally:
                self[phase] = self.get(phase, 0.0) + (time.time() - tick)

        return timed()
