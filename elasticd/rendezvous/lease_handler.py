"""The lease rendezvous of ``elasticd start``: rounds made of one small key per node, so etcd's work grows as O(N).

torch's dynamic rendezvous keeps a round in one pickled value (~150 bytes a node) that every node rewrites through
compare-and-set on each join and each one-second heartbeat: O(N) bytes per write, N writers, conflicts growing with
N. ``bench/control_plane.py`` measured it: 32 nodes formed in 0.7 s, 64 never within 60 s (61,212 requests). Here a
round is (keys in ``elasticd/keys.py``, rules in ``lease_round.py``):

- **joining**: a node puts ``rdzv/joined/<round>/<name>`` on its node's liveness lease (``agent/node_lease.py``), one
  small write; its liveness is that lease, so there is no heartbeat to write at all;
- **deciding**: one node, the first to take ``rdzv/lobby/decider`` (on its lease, so a dead decider is replaced at
  once), counts the joined keys (a count-only read) until :class:`~elasticd.rendezvous.lease_round.CloseRule` says the
  round forms, and forms it with one compare-and-set of the round record (``rdzv/lobby/round``);
- **placing**: the members are the joined keys as of that write's revision: each node counts the keys before its
  own (its rank) and all of them (the world) at that revision, two count-only reads; a key written later is not a
  member (that node waits for the next round);
- **following**: every node follows the lobby (``lobby.py``: one watch, woken by membership changes only). A member
  that comes back to the rendezvous (its workers failed or a node waits) opens the next round, which the others see
  as a node waiting; a node that comes while a round trains waits in ``rdzv/lobby/waiting/`` (unless the round is
  full: ``max_nodes``, as torch's redundancy list).

It keeps torch's ``RendezvousHandler`` interface and what the daemon asks of ``handler.py``'s handler (private
rounds, the members lost while a round forms, leaving). ``torchrun --rdzv-backend etcd-v3`` keeps ``handler.py``.
"""

from __future__ import annotations

import itertools
import os
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)

from elasticd.etcd.client import EtcdClient, EtcdError
from elasticd.keys import RunKeys
from elasticd.logging import get_logger
from elasticd.rendezvous import faults
from elasticd.rendezvous.handler import JOIN_TIMEOUT_S, LAST_CALL_TIMEOUT_S, connect, seconds_option
from elasticd.rendezvous.lease_round import FIRST_ROUND, CloseRule
from elasticd.rendezvous.liveness import RoundView, RoundWatch
from elasticd.rendezvous.lobby import Lobby, LobbySeen
from elasticd.rendezvous.store import EtcdV3Store

# The decider looks at the joined count this often while a round is open (seconds): 20 small reads a second, by one
# node of the run.
DECIDE_POLL_S = 0.05
# Any other node looks at the lobby at least this often while it waits (a change wakes it at once; seconds).
WAIT_SLICE_S = 1.0
# A view of the forming round for the members-lost check is reused this long (seconds; torch's state cache: 1 s).
VIEW_CACHE_S = 0.5
# A rendezvous goes on through etcd errors for this long (seconds: an election, a member restarting, a host too busy
# to answer a watch in time), looking again every RETRY_S; an etcd away longer fails it, as torch's does at once.
ETCD_OUTAGE_S = 30.0
RETRY_S = 0.5

_local_ids = itertools.count()  # torch's node descriptors number the handlers of one process the same way


class LeaseHolder(Protocol):
    """The node's liveness lease (``agent/node_lease.py``): keys on it vanish about a second after the node."""

    def hold(self, key: str, value: str) -> None: ...

    def hold_if(self, key: str, value: str, mod_revision: int) -> bool: ...

    def release(self, key: str) -> None: ...


class LeaseRendezvousHandler(RendezvousHandler):
    """torch's rendezvous interface over joined keys on liveness leases (module docstring)."""

    def __init__(
        self,
        client: EtcdClient,
        params: RendezvousParameters,
        lease: LeaseHolder,
        *,
        join_timeout_s: float,
        last_call_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._client = client
        self._run_id = params.run_id
        self._keys = RunKeys(params.run_id)
        self._min, self._max = params.min_nodes, params.max_nodes
        self._addr = params.local_addr or socket.getfqdn()
        self._lease = lease
        self._join_timeout_s = join_timeout_s
        self._last_call_s = last_call_s
        self._clock = clock
        # torch's form, addr_pid_localid, with the pid zero-padded: keys sort (and ranks follow) as torch sorts its
        # node descriptors, by address, then pid as a number
        self.member = f"{self._addr}_{os.getpid():07d}_{next(_local_ids)}"
        self._store = EtcdV3Store(client, self._keys.store_prefix)
        self._lobby = Lobby(client, self._keys)
        self._lobby.start()
        self._member_of: int | None = None  # the last round this node formed with others (through etcd)
        self._formed_at = 0  # that round's revision
        self._world = 0
        self._rank = 0
        self._held: set[str] = set()  # keys on the lease now
        self._completed_round: int | None = None  # the round of the last rendezvous (a private one too)
        self._private_round: int | None = None
        self._round_watch: RoundWatch | None = None
        self._round_store: EtcdV3Store | None = None
        self._formed: Callable[[], bool] | None = None
        self._on_lost: Callable[[dict[str, int], dict[str, int]], None] | None = None
        self._view: tuple[float, RoundView | None] = (-VIEW_CACHE_S, None)
        self.closed_early = 0  # rounds this node formed with everyone in, without the last call
        self.formed_by = ""  # why the last round this node decided formed: max_nodes, last_call, everyone_in

    # -- torch's interface ---------------------------------------------------------------------------------------

    def get_backend(self) -> str:
        return "etcd-v3"

    def get_run_id(self) -> str:
        return self._run_id

    @property
    def use_agent_store(self) -> bool:
        """Never: workers get their own TCPStore address each round."""
        return False

    def is_closed(self) -> bool:
        with _connection():
            record = self._lobby.read_now().record
        return record is not None and record.closed

    def set_closed(self) -> None:
        with _connection():
            while True:
                seen = self._lobby.read_now()
                record = seen.record or FIRST_ROUND
                if record.closed or self._client.compare_and_swap(
                    self._keys.rdzv_round, record.closing().encode(), seen.revision
                ):
                    return

    def shutdown(self) -> bool:
        """Close the run's rendezvous (it finished or was stopped) and leave it; False when etcd did not answer."""
        try:
            self.set_closed()
        except RendezvousConnectionError:
            return False
        return self.leave()

    def num_nodes_waiting(self) -> int:
        """Nodes waiting for the next round, from memory (``lobby.py``); a member that left this node's round for a
        newer one counts as one. Plus, while the round's workers are still forming, the members it lost."""
        seen = self._lobby.seen()
        if seen is None or seen.record is None or seen.record.closed:
            return 0
        waiting = len(seen.waiting - {self.member})
        if self._completed_round is not None and seen.record.round > self._completed_round:
            waiting = max(waiting, 1)
        return waiting + self._lost_while_forming()

    def next_rendezvous(self) -> RendezvousInfo:
        if self._private_round is not None:
            self._completed_round, self._private_round = self._private_round, None
            self._round_watch = None
            alone = dist.HashStore()
            return RendezvousInfo(alone, 0, 1, RendezvousStoreInfo.build(0, alone, self._addr))
        self.end_round_watch()
        deadline = self._clock() + self._join_timeout_s
        with _connection():
            round_ = self._join(deadline)
        self._completed_round = round_
        faults.maybe_die("joined", rank=self._rank, round_=round_)
        watch = RoundWatch(round_, self._ranks_at_formation, self._round_view)
        self._round_watch = watch
        # Referenced for the round's lifetime: torch's PrefixStore holds only the C++ half of a Python store.
        self._round_store = self._store.bounded_by(watch)
        store = dist.PrefixStore(f"torch.rendezvous.{self._run_id}.{round_}", self._round_store)
        info = RendezvousInfo(
            store, self._rank, self._world, RendezvousStoreInfo.build(self._rank, store, local_addr=self._addr)
        )
        faults.maybe_die("published", rank=self._rank, round_=round_)
        return info

    # -- what the daemon asks of its handler (as of handler.py's) -------------------------------------------------

    @property
    def round(self) -> int | None:
        """The round of the last rendezvous this node completed (None before the first)."""
        return self._completed_round

    def join_in_place(self, round_: int) -> None:
        """Make the next rendezvous a private round of this node alone (see ``handler.py``)."""
        self._private_round = round_

    def end_round_watch(self) -> None:
        if self._round_watch is not None:
            self._round_watch.end()

    def watch_members(
        self, formed: Callable[[], bool], on_lost: Callable[[dict[str, int], dict[str, int]], None] | None = None
    ) -> None:
        """As ``handler.py``'s: until ``formed()``, a member lost from this round counts as a node waiting."""
        self._formed, self._on_lost = formed, on_lost

    def participants(self) -> int:
        """Nodes in the round in force now (a count-only read)."""
        seen = self._lobby.seen()
        round_ = seen.record.round if seen is not None and seen.record is not None else self._member_of
        return 0 if round_ is None else self._client.count_prefix(self._keys.rdzv_joined_prefix(round_))

    def leave(self) -> bool:
        """Take this node out of the rendezvous (its keys deleted) without closing it; False when etcd did not
        answer (the keys then vanish with the node's lease)."""
        self._lobby.close()
        try:
            for key in sorted(self._held):
                self._lease.release(key)
            self._held.clear()
        except EtcdError:
            return False
        return True

    def stop(self) -> None:
        """Stop following the lobby (a killed node in the benchmark: its keys vanish with its lease)."""
        self._lobby.close()

    def liveness(self) -> tuple[int, bool, dict[int, float], int | None] | None:
        """The round in force, whether it formed, each live member's group rank (age 0: its lease holds) and this
        node's rank in it, for the hang diagnosis (``agent/liveness.py``); None when etcd did not answer."""
        seen = self._lobby.seen()
        if seen is None or seen.record is None:
            return None
        record = seen.record
        try:
            if record.round != self._member_of:
                return record.round, not record.open, {}, None
            ranks, alive = self._ranks_at_formation(), self._names(self._keys.rdzv_joined_prefix(record.round))
        except EtcdError:
            return None
        live = {rank: 0.0 for name, rank in ranks.items() if name in alive}
        mine = ranks.get(self.member)
        return record.round, True, live, mine if mine in live else None

    # -- the protocol -------------------------------------------------------------------------------------------

    def _join(self, deadline: float) -> int:
        return _through_outages(lambda: self._take_part(deadline), self._clock, deadline)

    def _take_part(self, deadline: float) -> int:
        """Take part in rounds until one forms with this node in it; its number (rank and world set)."""
        seen = self._lobby.read_now()
        while True:
            if self._clock() > deadline:
                raise RendezvousTimeoutError(f"no round of {self._run_id!r} formed with this node in time")
            record = seen.record
            if record is None:
                self._client.create(self._keys.rdzv_round, FIRST_ROUND.encode())
                seen = self._lobby.read_now()
                continue
            if record.closed:
                raise RendezvousClosedError()
            if record.open:
                self._enter(record.round)
                seen = self._await_formed(record.round, deadline)
                formed = seen.record is not None and seen.record.round == record.round and not seen.record.open
                if formed and self._place(record.round, seen.revision):
                    return record.round
                continue
            if self._member_of == record.round or self._nobody_left(record.round):
                # this node leaves the round it trained in (or none of it is left): the next one opens
                self._client.compare_and_swap(self._keys.rdzv_round, record.next().encode(), seen.revision)
                seen = self._lobby.read_now()
                continue
            seen = self._wait_for_next(record.round, seen)

    def _enter(self, round_: int) -> None:
        """Put this node in open round ``round_`` (and no longer among the nodes waiting)."""
        self._hold(self._keys.rdzv_joined(round_, self.member), self._addr)
        self._drop(self._keys.rdzv_waiting(self.member))

    def _await_formed(self, round_: int, deadline: float) -> LobbySeen:
        """Wait until open round ``round_`` forms or is replaced; decide it while this node is its decider."""
        rule: CloseRule | None = None
        while True:
            seen = self._lobby.seen() or self._lobby.read_now()
            record = seen.record
            if record is None or record.round != round_ or not record.open or record.closed:
                return seen
            if self._clock() > deadline:
                raise RendezvousTimeoutError(f"round {round_} of {self._run_id!r} did not form in time")
            wait_s = WAIT_SLICE_S
            if self._is_decider(round_, seen):
                if rule is None:
                    rule = CloseRule(self._min, self._max, self._last_call_s, reforming=self._member_of is not None)
                joined = self._client.count_prefix(self._keys.rdzv_joined_prefix(round_))
                if rule.due(joined, lambda: self._in_and_to_come(round_)):
                    if self._client.compare_and_swap(self._keys.rdzv_round, record.formed().encode(), seen.revision):
                        self._formed_it(round_, joined, rule.reason)
                    self._lobby.read_now()
                    continue
                wait_s = min(DECIDE_POLL_S, rule.due_in()) if joined >= self._min else DECIDE_POLL_S
            self._lobby.wait_newer(seen, wait_s)

    def _is_decider(self, round_: int, seen: LobbySeen) -> bool:
        if seen.decider is not None and seen.decider[0] == round_:
            return seen.decider[1] == self.member
        # no decider for this round yet (or it died: its key went with its lease): take it, or see who did
        taken = self._lease.hold_if(self._keys.rdzv_decider, f"{round_} {self.member}", seen.decider_revision)
        if taken:
            self._held.add(self._keys.rdzv_decider)
        return taken

    def _formed_it(self, round_: int, joined: int, reason: str) -> None:
        self.formed_by = reason
        if reason == "everyone_in":
            self.closed_early += 1
            skipped = self._last_call_s
            get_logger().info("rendezvous_closed_early", round=round_, nodes=joined, last_call_skipped_s=skipped)

    def _in_and_to_come(self, round_: int) -> tuple[set[str], set[str]]:
        """Names in open round ``round_``, and those expected: live members of the round before, nodes waiting."""
        inside = self._names(self._keys.rdzv_joined_prefix(round_))
        before = self._names(self._keys.rdzv_joined_prefix(round_ - 1)) if round_ > 0 else set()
        seen = self._lobby.seen()
        return inside, before | (seen.waiting if seen is not None else frozenset())

    def _names(self, prefix: str, revision: int | None = None) -> set[str]:
        return {key[len(prefix) :] for key in self._client.keys_under(prefix, revision=revision)}

    def _place(self, round_: int, revision: int) -> bool:
        """This node's rank and the world of formed round ``round_`` (members: joined keys at ``revision``); False
        when this node is not a member (it joined too late, or its lease lapsed)."""
        prefix = self._keys.rdzv_joined_prefix(round_)
        mine = self._keys.rdzv_joined(round_, self.member)
        if self._client.count_range(mine, mine + "\0", revision) == 0:
            self._drop(mine)
            return False
        self._rank = self._client.count_range(prefix, mine, revision)
        self._world = self._client.count_range(prefix, _prefix_end(prefix), revision)
        self._member_of, self._formed_at = round_, revision
        for key in [k for k in self._held if k.startswith(self._keys.rdzv_joined_root) and k != mine]:
            self._drop(key)  # earlier rounds: a re-forming round no longer waits for this node
        return True

    def _nobody_left(self, round_: int) -> bool:
        return self._client.count_prefix(self._keys.rdzv_joined_prefix(round_)) == 0

    def _wait_for_next(self, round_: int, seen: LobbySeen) -> LobbySeen:
        """Wait, counted among the nodes waiting unless formed round ``round_`` is full, until the lobby changes."""
        world = self._client.count_range(
            self._keys.rdzv_joined_prefix(round_), _prefix_end(self._keys.rdzv_joined_prefix(round_)), seen.revision
        )
        waiting = self._keys.rdzv_waiting(self.member)
        if world < self._max:
            self._hold(waiting, self._addr)
        else:
            self._drop(waiting)  # a full round: this node is a spare for the next one, not a reason to re-form
        return self._lobby.wait_newer(seen, WAIT_SLICE_S) or self._lobby.read_now()

    def _hold(self, key: str, value: str) -> None:
        if key not in self._held:
            self._lease.hold(key, value)
            self._held.add(key)

    def _drop(self, key: str) -> None:
        if key in self._held:
            self._lease.release(key)
            self._held.discard(key)

    # -- the members of the round being formed ------------------------------------------------------------------

    def _ranks_at_formation(self) -> dict[str, int]:
        """Every member of this node's last formed round and its group rank (one read of the names at that revision)."""
        if self._member_of is None:
            return {}
        names = sorted(self._names(self._keys.rdzv_joined_prefix(self._member_of), self._formed_at))
        return {name: rank for rank, name in enumerate(names)}

    def _round_view(self) -> RoundView | None:
        """The round in force and its live members, for :class:`RoundWatch` (cached :data:`VIEW_CACHE_S`)."""
        at, cached = self._view
        if self._clock() - at < VIEW_CACHE_S:
            return cached
        seen = self._lobby.seen()
        view: RoundView | None = None
        if seen is not None and seen.record is not None and self._member_of is not None:
            try:
                if seen.record.round != self._member_of:
                    view = RoundView(seen.record.round, frozenset())
                elif self._client.count_prefix(self._keys.rdzv_joined_prefix(self._member_of)) == self._world:
                    view = RoundView(self._member_of, frozenset(self._ranks_at_formation()))
                else:  # someone is gone: who
                    live = self._names(self._keys.rdzv_joined_prefix(self._member_of))
                    view = RoundView(self._member_of, frozenset(live))
            except EtcdError:
                view = None
        self._view = (self._clock(), view)
        return view

    def _lost_while_forming(self) -> int:
        formed, watch = self._formed, self._round_watch
        if formed is None or watch is None or watch.round != self._completed_round or formed():
            return 0
        view = self._round_view()
        if view is None:
            return 0
        if view.round != watch.round:
            # Someone left this round for a newer one. Its members that are still alive hold their keys of it (until
            # they form the next): those left; a dead one's key went with its lease: lost.
            try:
                alive = self._names(self._keys.rdzv_joined_prefix(watch.round))
            except EtcdError:
                return 0
            view = RoundView(watch.round, frozenset({self.member}), frozenset(alive))
        lost, left = watch.gone(view)
        if (lost or left) and self._on_lost is not None:
            on_lost, self._on_lost = self._on_lost, None
            on_lost({m: watch.ranks.get(m, -1) for m in lost}, {m: watch.ranks.get(m, -1) for m in left})
        return len(lost) + len(left)


def _through_outages(attempt: Callable[[], int], clock: Callable[[], float], deadline: float) -> int:
    """``attempt()``, again while etcd answers with errors for up to :data:`ETCD_OUTAGE_S` (not past ``deadline``)."""
    failing_since: float | None = None
    while True:
        try:
            return attempt()
        except EtcdError as exc:
            now = clock()
            failing_since = now if failing_since is None else failing_since
            if exc.refused or now - failing_since > ETCD_OUTAGE_S or now > deadline:
                raise
            get_logger().warning("rendezvous_etcd_retry", error=str(exc), failing_s=round(now - failing_since, 1))
            time.sleep(RETRY_S)


def _prefix_end(prefix: str) -> str:
    """The end of the key range of ``prefix`` (its last character raised by one)."""
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)


@contextmanager
def _connection() -> Iterator[None]:
    """etcd errors as torch's: the agent and the daemon handle a RendezvousConnectionError."""
    try:
        yield
    except EtcdError as exc:
        raise RendezvousConnectionError(f"The connection to etcd has failed: {exc}") from exc


def create_lease_handler(
    params: RendezvousParameters, lease: LeaseHolder, client: EtcdClient | None = None
) -> LeaseRendezvousHandler:
    """A lease rendezvous handler from torchrun's parameters (``handler.py``'s options: ``join_timeout``,
    ``last_call_timeout``, and the connection's), over ``client`` or a connection of its own, holding its keys on
    ``lease``."""
    return LeaseRendezvousHandler(
        client if client is not None else connect(params),
        params,
        lease,
        join_timeout_s=seconds_option(params, "join_timeout", JOIN_TIMEOUT_S),
        last_call_s=seconds_option(params, "last_call_timeout", LAST_CALL_TIMEOUT_S),
    )
