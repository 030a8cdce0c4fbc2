"""A forming round's waits, bounded by the liveness of its members.

After torch's rendezvous decides a round, its members still exchange keys through the round's store before any
worker starts: rank 0 publishes the worker store address (``MASTER_ADDR``/``MASTER_PORT``), every member its role
info, rank 0 the assigned ranks, every member its node id. A member that dies in between never writes its key, and
its peers would wait out the store timeout (300 s) and then fail the run. A :class:`RoundWatch` is asked between
short slices of every such wait; it raises :class:`RoundAbandonedError` as soon as the round lost a member (its
rendezvous keep-alive expired or it left) or was replaced by a newer round, and the agent then re-rendezvouses
as after any membership change.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass

from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo

from elasticd.errors import ElasticdError

# Seconds between two looks at the rendezvous state while a forming round waits. A dead member is taken out of
# the state once its keep-alive expires (3 x 1 s), so noticing it costs at most this much more.
CHECK_INTERVAL_S = 1.0

# What a forming round waits for, by the store key it waits on (torch's and ours), in the order they happen.
_PHASES = (
    (RendezvousStoreInfo.MASTER_ADDR_KEY, "store_address"),
    (RendezvousStoreInfo.MASTER_PORT_KEY, "store_address"),
    ("torchelastic/role_info/", "rank_assignment"),
    ("torchelastic/assigned_ranks/", "rank_assignment"),
    ("elasticd/training_nodes", "rank_assignment"),  # agent/spares.py: how many nodes train, before torch's ranks
    ("elasticd/node/", "node_ids"),
    ("elasticd/token", "fencing_token"),  # agent/supervisor.py: the round's fencing token (elasticd/lineage.py)
)


class RoundAbandonedError(ElasticdError):
    """A forming round cannot complete: re-rendezvous (a membership change, not a failure).

    ``reason`` is ``member_lost`` (``lost`` names the rendezvous members that are gone: dead, their keep-alive
    expired), ``member_left`` (``left`` names members that gave the round up themselves and wait for the next one),
    ``superseded`` (the run moved on to a newer round without us) or ``timeout`` (every member looked alive, but a
    key did not come within the store timeout). ``keys`` are the store keys that were still missing.
    """

    def __init__(
        self,
        round_: int,
        reason: str,
        lost: Iterable[str] = (),
        keys: Iterable[str] = (),
        waited_s: float = 0.0,
        left: Iterable[str] = (),
    ) -> None:
        self.round = round_
        self.reason = reason
        self.lost = tuple(lost)
        self.left = tuple(left)
        self.keys = tuple(keys)
        self.waited_s = waited_s  # from the round's decision to giving it up
        who = f" (lost: {', '.join(self.lost)})" if self.lost else ""
        super().__init__(f"rendezvous round {round_} abandoned: {reason}{who}")

    @property
    def phase(self) -> str:
        """What the round was waiting for: ``store_address``, ``rank_assignment``, ``node_ids``, ``fencing_token``
        or ``unknown``."""
        return phase_of(self.keys)

    def with_keys(self, keys: Iterable[str]) -> RoundAbandonedError:
        return RoundAbandonedError(self.round, self.reason, self.lost, keys, self.waited_s, self.left)


def phase_of(keys: Iterable[str]) -> str:
    """The forming phase a wait on ``keys`` belongs to (keys may carry a store prefix)."""
    for key in keys:
        for marker, phase in _PHASES:
            if marker in key:
                return phase
    return "unknown"


@dataclass(frozen=True, slots=True)
class RoundView:
    """What the shared rendezvous state says now: its round, the members still in it, and the nodes waiting for
    the next round (a member that gave our round up moves there; a dead one is nowhere)."""

    round: int
    members: frozenset[str]
    waiting: frozenset[str] = frozenset()


class RoundWatch:
    """Watches one decided round while its members exchange keys.

    ``read`` returns the current :class:`RoundView`, or None when the state cannot be read (etcd away: the store
    wait itself reports a lasting outage). :meth:`check` raises :class:`RoundAbandonedError` when the round lost a
    member or was superseded; it reads at most once per ``interval_s``. :meth:`end` turns it off once the round has
    formed: from then on a lost member is a worker failure, seen by torch's monitor.
    """

    def __init__(
        self,
        round_: int,
        members: Mapping[str, int] | Collection[str] | Callable[[], Mapping[str, int]],
        read: Callable[[], RoundView | None],
        *,
        interval_s: float = CHECK_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.round = round_
        # a callable is asked once, when a member is first looked for (a large round's names are read only if needed)
        self._load = members if callable(members) else None
        self._members = frozenset() if callable(members) else frozenset(members)
        self._ranks: dict[str, int] = dict(members) if isinstance(members, Mapping) else {}
        self._read = read
        self._interval_s = interval_s
        self._clock = clock
        self._decided_at = clock()
        self._next_check = self._decided_at + interval_s
        self.active = True

    @property
    def members(self) -> frozenset[str]:
        self._loaded()
        return self._members

    @property
    def ranks(self) -> dict[str, int]:
        """Each member's group rank (empty when the round was given as names alone)."""
        self._loaded()
        return self._ranks

    def _loaded(self) -> None:
        if self._load is not None:
            ranks = dict(self._load())
            self._load, self._members, self._ranks = None, frozenset(ranks), ranks

    @property
    def interval_s(self) -> float:
        return self._interval_s

    def check(self) -> None:
        if not self.active:
            return
        now = self._clock()
        if now < self._next_check:
            return
        self._next_check = now + self._interval_s
        view = self._read()
        if view is None:
            return
        waited_s = now - self._decided_at
        if view.round != self.round:
            raise RoundAbandonedError(self.round, "superseded", waited_s=waited_s)
        lost, left = self.gone(view)
        if lost or left:
            reason = "member_lost" if lost else "member_left"
            raise RoundAbandonedError(self.round, reason, lost, waited_s=waited_s, left=left)

    def gone(self, view: RoundView) -> tuple[list[str], list[str]]:
        """Members of this round missing from ``view``: (lost, left). Lost ones are nowhere in the state (dead:
        their keep-alive expired); left ones gave the round up and queue for the next. A member caught between
        leaving and queueing again (one etcd write apart) counts as lost."""
        gone = self.members - view.members
        return sorted(gone - view.waiting), sorted(gone & view.waiting)

    def timed_out(self, keys: Iterable[str]) -> RoundAbandonedError:
        """The error for a wait that outlived the store timeout while every member looked alive."""
        return RoundAbandonedError(self.round, "timeout", keys=keys, waited_s=self._clock() - self._decided_at)

    def end(self) -> None:
        self.active = False
