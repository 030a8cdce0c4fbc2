"""The lease rendezvous's round record and its rule for closing a round: pure, no etcd.

A run's rendezvous is one small record (``rdzv/lobby/round``, :class:`RoundRecord`): the round's number, whether it
still takes joins (open) or has formed, and whether the run's rendezvous is closed for good. A round's members are its
joined keys (``rdzv/joined/<round>/<name>``, one per node, on the node's liveness lease) as of the revision of the
write that formed it, so nothing that grows with the number of nodes is ever rewritten.

One node decides when an open round forms (:class:`CloseRule`, asked by ``lease_handler.py``): the same rules as
torch's dynamic rendezvous and ``quorum.py`` give it, on counts and names instead of a shared state:

- ``max_nodes`` joined: form now;
- ``min_nodes`` joined and the last call passed since the decider first saw them: form (nodes still starting when a
  job begins come within the last call; a later one waits for the next round);
- a *re-forming* round (its decider formed a round before) with every node still to come in: form once that has held
  for ``grace_s`` (``quorum.py``'s :data:`~elasticd.rendezvous.quorum.CLOSE_GRACE_S`), no last call to sit out. Still to
  come are the live members of the round before (their joined keys are on their leases: a dead one's is gone) and
  the nodes waiting for this round.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

from elasticd.rendezvous.quorum import CLOSE_GRACE_S


@dataclass(frozen=True, slots=True)
class RoundRecord:
    """``rdzv/lobby/round``: the round in force."""

    round: int
    open: bool  # taking joins; False: formed, its members fixed
    closed: bool = False  # the run's rendezvous is over (finished or stopped): no round forms any more

    def encode(self) -> str:
        return json.dumps({"round": self.round, "open": self.open, "closed": self.closed})

    @classmethod
    def decode(cls, raw: bytes) -> RoundRecord:
        data = json.loads(raw)
        return cls(int(data["round"]), bool(data["open"]), bool(data.get("closed", False)))

    def formed(self) -> RoundRecord:
        return RoundRecord(self.round, open=False, closed=self.closed)

    def next(self) -> RoundRecord:
        return RoundRecord(self.round + 1, open=True, closed=self.closed)

    def closing(self) -> RoundRecord:
        return RoundRecord(self.round, self.open, closed=True)


FIRST_ROUND = RoundRecord(0, open=True)  # torch's first round is 0 too (the fault options and the logs name it so)


class CloseRule:
    """Whether the decider of an open round forms it now (:meth:`due`); one per round it decides."""

    def __init__(
        self,
        min_nodes: int,
        max_nodes: int,
        last_call_s: float,
        *,
        reforming: bool,
        grace_s: float = CLOSE_GRACE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._min, self._max = min_nodes, max_nodes
        self._last_call_s = last_call_s
        self._reforming = reforming
        self._grace_s = grace_s
        self._clock = clock
        self._enough_since: float | None = None  # when min_nodes were first seen in
        self._all_in: tuple[frozenset[str], float] | None = None  # (who was in, since when) with nobody to come
        self.reason = ""  # why it formed: max_nodes, last_call, everyone_in

    def due(self, joined: int, names: Callable[[], tuple[Collection[str], Collection[str]]]) -> bool:
        """``joined`` nodes are in now; ``names()`` (read only when needed) are the names in and those still to come."""
        now = self._clock()
        if joined >= self._max:
            self.reason = "max_nodes"
            return True
        if joined < self._min:
            self._enough_since, self._all_in = None, None
            return False
        if self._enough_since is None:
            self._enough_since = now
        if now - self._enough_since >= self._last_call_s:
            self.reason = "last_call"
            return True
        if not self._reforming:
            return False
        inside, to_come = names()
        if set(to_come) - set(inside):
            self._all_in = None
            return False
        key = frozenset(inside)
        if self._all_in is None or self._all_in[0] != key:
            self._all_in = (key, now)
        if now - self._all_in[1] >= self._grace_s:
            self.reason = "everyone_in"
            return True
        return False

    def due_in(self) -> float:
        """Seconds until :meth:`due` may answer otherwise with the same nodes in (the decider looks again then)."""
        now = self._clock()
        waits = []
        if self._enough_since is not None:
            waits.append(self._enough_since + self._last_call_s - now)
        if self._all_in is not None:
            waits.append(self._all_in[1] + self._grace_s - now)
        return max(min(waits, default=float("inf")), 0.0)
