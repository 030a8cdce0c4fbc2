"""Collectives given up on: each held until it has ended, and each old gloo group until none is pending in it.

A step, a heal or a checkpoint agreement that fails in place gives up on its collectives. Gloo in torch 2.13 cannot
cancel one: it stays pending in a thread of its group until a peer's connection breaks. Two things may not happen
to it meanwhile: its ``Work`` may not be destroyed (a pending gloo Work's destructor can throw its stored
``IoException`` once it fails, and abort the process), and its group may not be (the group's destructor joins the
thread that waits, for up to the group's timeout). Both are safe once the collective has ended, successfully or
not: measured here, a failed Work dropped and its group destroyed take milliseconds.

Holding a group until *its own* given-up collectives have ended, then releasing it, also ends its peers' pending
collectives: releasing closes its connections. Measured with 4 gloo ranks in a ring and one killed mid-all-reduce
(``bench/collective_design.py``): the dead rank's two neighbours see a reset at once, the rank across the ring
waits on the neighbours, which are alive, and its collective ends only when they release the group: 0.05-0.07 s
after the kill when they do so at once, 5.05 s when they hold it 5 s. So every member releases as soon as it can, and a
chain of members that wait on one another unwinds hop by hop. What stays pending is a collective on a peer that is
alive and never answers (a frozen node, SIGSTOP): until the group's timeout, or until that peer's process ends.

Process-wide (:data:`GIVEN_UP`): the hook, the heal and the checkpoint coordination give collectives up on the same
groups, and :class:`~elasticd.worker.hot.backend.AbandonedGroups` asks about all of them.
"""

from __future__ import annotations

import threading
from typing import Any


class GivenUp:
    """Collectives given up on, each with the group it was issued on, until each has ended."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: list[tuple[object | None, Any]] = []  # (the group, or None when not known; the Work)

    def hold(self, work: Any, group: object | None) -> None:
        """Keep ``work`` (issued on ``group``; None: not known, which pins every group) until it has ended."""
        with self._lock:
            self._held.append((group, work))

    def pending(self, group: object | None = None) -> int:
        """How many held collectives have not ended: in ``group`` (with those of no known group), or in all.
        Those that ended are let go."""
        with self._lock:
            self._held = [(g, work) for g, work in self._held if not ended(work)]
            if group is None:
                return len(self._held)
            return sum(1 for g, _ in self._held if g is None or g is group)


def ended(work: Any) -> bool:
    try:
        return bool(work.is_completed())
    except Exception:
        return True  # a Work that cannot say has failed: nothing of it is left in gloo's threads (waiting on it raises)


GIVEN_UP = GivenUp()
