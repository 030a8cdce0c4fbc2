"""A step's own time: what a rank spends waiting for no other rank (the library's data work, the forward passes).

DDP syncs in backward, so forward passes and data loading are the part of a step that tells a slow rank apart from
one that waits for it; the daemon's straggler detector compares it across ranks (``agent/stragglers.py``).
"""

from __future__ import annotations

import time
from typing import Any


class OwnTime:
    """Seconds of own time since the last :meth:`take`."""

    def __init__(self) -> None:
        self._seconds = 0.0
        self._forward_started = 0.0

    def add(self, seconds: float) -> None:
        self._seconds += seconds

    def take(self) -> float:
        """The own time of the step that just ended; the next step starts from zero."""
        seconds, self._seconds = self._seconds, 0.0
        return seconds

    def time_forward(self, model: Any) -> None:
        """Count ``model``'s forward passes (a module without forward hooks is not timed)."""
        if not hasattr(model, "register_forward_pre_hook"):
            return

        def before(*_args: Any) -> None:
            self._forward_started = time.perf_counter()

        def after(*_args: Any) -> None:
            if self._forward_started:
                self._seconds += time.perf_counter() - self._forward_started
                self._forward_started = 0.0

        model.register_forward_pre_hook(before)
        model.register_forward_hook(after)
