"""The verdict on the current optimizer step: did its gradient all-reduce fail, and why.

One :class:`StepHealth` is shared by the communication hook (which records a failure, from whatever thread saw it:
gloo's, the hook's deadline watcher, or an out-of-band notice) and the step guard (which reads it at the optimizer
step and consumes it at the step boundary). Consuming a failure starts a new *generation*: a late report from an
all-reduce that was abandoned in an earlier generation (gloo finishes or times out an abandoned collective long after
we stopped waiting) is then ignored instead of failing a step that has nothing to do with it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class StepFailure:
    """Why a step's gradients were not reduced: ``bucket`` is DDP's bucket index, None for an abort from outside."""

    generation: int
    reason: str
    bucket: int | None = None
    at: float = field(default_factory=time.monotonic)  # when it was recorded (time.monotonic() seconds)


class StepHealth:
    """Thread-safe record of the first failure of the current generation."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._generation = 0
        self._failure: StepFailure | None = None

    @property
    def generation(self) -> int:
        with self._lock:
            return self._generation

    def state(self) -> tuple[int, bool]:
        """The current generation and whether it failed, read together."""
        with self._lock:
            return self._generation, self._failure is not None

    @property
    def failure(self) -> StepFailure | None:
        with self._lock:
            return self._failure

    @property
    def failed(self) -> bool:
        with self._lock:
            return self._failure is not None

    def fail(self, reason: str, *, generation: int | None = None, bucket: int | None = None) -> bool:
        """Record a failure of ``generation`` (default: the current one); True when this call recorded it.

        A report for an older generation, or a second report for the current one, changes nothing: the first reason
        is the one worth logging (later ones are mostly consequences of it).
        """
        with self._lock:
            if generation is not None and generation != self._generation:
                return False
            if self._failure is not None:
                return False
            self._failure = StepFailure(self._generation, reason, bucket)
            return True

    def consume(self) -> StepFailure | None:
        """The failure recorded for the current generation, if any; a failure also starts the next generation."""
        with self._lock:
            failure, self._failure = self._failure, None
            if failure is not None:
                self._generation += 1
            return failure


def ask_notice(notice: Callable[[], str | None] | None) -> str | None:
    """The failure notice's text, if any; None also when the notice board cannot be read: an unreachable board must
    not fail a step or end a watch (the collectives' deadline still bounds every wait)."""
    if notice is None:
        return None
    try:
        return notice()
    except Exception:
        return None
