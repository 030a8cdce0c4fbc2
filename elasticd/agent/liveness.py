"""Who of a round is still there, for the hang diagnosis: registry records and rendezvous heartbeats.

Two signals, each read from etcd by every daemon:

- the **node registry** (``registry.py``): a daemon's record lives on a lease it refreshes every few seconds; a
  killed daemon's record is gone one TTL (10 s) later;
- the **rendezvous state** (torch's, ``handler.py``): every daemon of a round writes a heartbeat there every
  keep-alive interval (1 s) from its agent's timer thread, and torch evicts a node whose heartbeat is
  ``keep_alive_interval * keep_alive_max_attempt`` old (3 s). A stopped (SIGSTOP) or dead daemon's heartbeat ages
  at once, so this is the fast signal: a heartbeat older than :data:`STALE_INTERVALS` intervals means the daemon
  is stopped or dead.

:func:`lost_members` says which members of a round are gone or frozen (the diagnosis does not wait for their
evidence and names them first); :func:`evicted` says whether this node itself has been left behind by a round that
went on without it (its late hang report is then not a hang of the run). Both are pure; :class:`RoundLiveness`
reads the two signals.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from torch.distributed.elastic.rendezvous.api import RendezvousError

from elasticd.agent import node_lease
from elasticd.etcd.client import EtcdError
from elasticd.rendezvous.lease_handler import LeaseRendezvousHandler

# A daemon writes a rendezvous heartbeat every interval; one this many intervals old (2.5 s at elasticd's 1 s) means
# it is stopped or dead: a live daemon's timer thread would have to miss two ticks in a row. Below torch's eviction
# (3 intervals), so the diagnosis knows before the rendezvous acts.
STALE_INTERVALS = 2.5
# Seconds a reading is reused: the owner of a hang asks every 50 ms while it waits for reports.
CACHE_S = 0.25


@dataclass(frozen=True, slots=True)
class RoundView:
    """The rendezvous as one daemon read it."""

    round: int
    complete: bool
    heartbeat_age_s: Mapping[int, float]  # group rank -> seconds since that participant's last heartbeat
    my_rank: int | None  # this node's group rank; None when it is not a participant (any more)
    interval_s: float  # the keep-alive interval


def lost_members(
    round_: int, members: Sequence[str], view: RoundView | None, records: Sequence[Mapping[str, Any]] | None
) -> dict[str, str]:
    """Members of ``round_`` (``members[group rank]`` = node id) whose daemon is gone or frozen, with the reason.

    ``records`` are the registry's live records (None: unknown, etcd did not answer); ``view`` the rendezvous
    (None: unknown). A member is lost when its registry record has expired, when it is no longer a participant of
    the round, or when its heartbeat is stale."""
    lost: dict[str, str] = {}
    if records is not None:
        alive = {str(r.get("node_id")) for r in records}
        for node in members:
            if node not in alive:
                lost[node] = "its daemon is gone (its registry record expired)"
    if view is not None and view.round == round_ and view.complete:
        stale_s = STALE_INTERVALS * view.interval_s
        for rank, node in enumerate(members):
            if node in lost:
                continue
            age = view.heartbeat_age_s.get(rank)
            if age is None:
                lost[node] = "it left the rendezvous or was evicted from it (no heartbeat)"
            elif age > stale_s:
                lost[node] = f"its daemon is stopped or dead (no rendezvous heartbeat for {age:.1f} s)"
    return lost


def evicted(
    round_: int, node_id: str, view: RoundView | None, records: Sequence[Mapping[str, Any]] | None
) -> str | None:
    """Why this node is no longer part of the run's current round, or None while it is (or nothing says not).

    torch opens round n+1 only once every participant of round n has left or been evicted, so a rendezvous past
    ``round_`` means round ``round_`` is over, this node's part included (it was stopped, say, and evicted)."""
    if view is not None:
        if view.round > round_:
            return f"the rendezvous went on to round {view.round} without this node"
        if view.round == round_ and view.complete and view.my_rank is None:
            return f"this node was evicted from round {round_} (its heartbeat expired)"
    for record in records or ():
        later = record.get("round")
        if record.get("node_id") != node_id and isinstance(later, int) and later > round_:
            return f"node {record.get('node_id')} is in round {later} already"
    return None


def read_view(handler: Any, wall: Callable[[], datetime] = lambda: datetime.now(UTC)) -> RoundView | None:
    """The rendezvous state as ``handler`` (torch's ``DynamicRendezvousHandler``) holds it, refreshed if older than
    torch's 1 s cache. Heartbeat ages are taken at the moment the state was read, so a cached state does not make
    a live node look stale. None when the state cannot be read (etcd away)."""
    if isinstance(handler, LeaseRendezvousHandler):
        reading = handler.liveness()
        if reading is None:
            return None
        round_, complete, ages, mine = reading
        return RoundView(round_, complete, ages, mine, interval_s=node_lease.TTL_S)
    try:
        with handler._heartbeat_lock:
            holder = handler._state_holder
            holder.sync()
            state = holder.state
            read_ago_s = max(0.0, time.monotonic() - holder._last_sync_time)
            read_at = wall() - timedelta(seconds=read_ago_s)
            ages = {
                int(rank): (read_at - state.last_heartbeats[node]).total_seconds()
                for node, rank in state.participants.items()
                if node in state.last_heartbeats
            }
            mine = state.participants.get(handler._this_node)
            return RoundView(
                round=int(state.round),
                complete=bool(state.complete),
                heartbeat_age_s=ages,
                my_rank=None if mine is None else int(mine),
                interval_s=handler._settings.keep_alive_interval.total_seconds(),
            )
    except (RendezvousError, EtcdError):
        return None


class RoundLiveness:
    """Reads the registry and the rendezvous for :func:`lost_members` and :func:`evicted` (cached briefly)."""

    def __init__(
        self,
        node_id: str,
        read_records: Callable[[], list[dict[str, Any]]],
        read_rendezvous: Callable[[], RoundView | None],
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._node = node_id
        self._read_records = read_records
        self._read_rendezvous = read_rendezvous
        self._clock = clock
        self._lock = threading.Lock()
        self._cached_at = -CACHE_S
        self._cached: tuple[RoundView | None, list[dict[str, Any]] | None] = (None, None)

    def _read(self) -> tuple[RoundView | None, list[dict[str, Any]] | None]:
        with self._lock:
            now = self._clock()
            if now - self._cached_at >= CACHE_S:
                try:
                    records: list[dict[str, Any]] | None = self._read_records()
                except EtcdError:
                    records = None
                self._cached = (self._read_rendezvous(), records)
                self._cached_at = now
            return self._cached

    def lost(self, round_: int, members: Sequence[str], *, rendezvous: bool = True) -> dict[str, str]:
        """``rendezvous=False``: the registry alone (a group re-formed in place is not the round's participants)."""
        view, records = self._read()
        return lost_members(round_, members, view if rendezvous else None, records)

    def evicted(self, round_: int) -> str | None:
        view, records = self._read()
        return evicted(round_, self._node, view, records)
