"""The ``etcd-v3`` rendezvous handler: torch's ``DynamicRendezvousHandler`` over our etcd backend and store.

This module owns how a handler is built from torchrun's ``RendezvousParameters`` (endpoints, TLS/auth, timing
with elasticd's defaults) and its registration, both in torch's registry (:func:`register`) and as the
``torchrun.handlers`` entry point (:func:`handler_factory`), so ``torchrun --rdzv-backend etcd-v3`` works
without the elasticd daemon.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (
    RendezvousError,
    RendezvousHandlerCreator,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousTimeout,
    _Action,
    _BackendRendezvousStateHolder,
    _RendezvousContext,
)

from elasticd import envvars
from elasticd import options as o
from elasticd.endpoints import parse_endpoints
from elasticd.errors import ConfigError
from elasticd.etcd.client import EtcdClient, EtcdError
from elasticd.keys import RunKeys, validate_run_id
from elasticd.logging import get_logger
from elasticd.rendezvous import event_names, faults, wakeup
from elasticd.rendezvous.backend import EtcdV3RendezvousBackend
from elasticd.rendezvous.lapsed import LapsedNodes
from elasticd.rendezvous.liveness import RoundView, RoundWatch
from elasticd.rendezvous.quorum import CloseWhenEveryoneIsIn, ReformingExecutor, StateHandler
from elasticd.rendezvous.store import EtcdV3Store

BACKEND_NAME = "etcd-v3"

# Heartbeats come from the agent's timer thread, not from the busy workers, so a short interval costs nothing
# while training: every second (torch's default is 5 s).
KEEP_ALIVE_INTERVAL_S = 1
# A node is evicted after this many missed heartbeats: 3 x 1 s, so a dead node is noticed 3 s after its last
# one.
KEEP_ALIVE_MAX_ATTEMPT = 3
# Once min_nodes have joined, wait this long for stragglers before closing the round (torch: 30 s). Nodes of
# one job start together, and a late one joins the next round through torch's wait list anyway.
LAST_CALL_TIMEOUT_S = 2
# How long a round may take to form (torch's default): covers slow image pulls and node scheduling.
JOIN_TIMEOUT_S = 600
# Time allowed to mark the rendezvous closed at shutdown (torch's default).
CLOSE_TIMEOUT_S = 30
# One heartbeat (a state read + compare-and-set) must finish within this; etcd answers in milliseconds.
HEARTBEAT_TIMEOUT_S = 5
# Bound on reaching etcd when the handler is built; an unreachable etcd is a configuration error, reported
# fast.
CONNECT_TIMEOUT_S = o.ETCD_CONNECT_TIMEOUT.default


class ElasticdRendezvousHandler(DynamicRendezvousHandler):
    """torch's dynamic rendezvous with a fresh worker store every round, plus what the daemon reports.

    Every wait on the round's store while the round forms (the worker store address, rank assignment, node ids)
    is bounded by the liveness of the round's members: see :mod:`elasticd.rendezvous.liveness`.
    """

    _completed_round: int | None = None
    _round_watch: RoundWatch | None = None
    _round_store: EtcdV3Store | None = None
    _formed: Callable[[], bool] | None = None
    _on_lost: Callable[[dict[str, int], dict[str, int]], None] | None = None
    state_wakeup: wakeup.StateWakeup | None = None
    _closing_round: int | None = None
    _closing: CloseWhenEveryoneIsIn | None = None
    closed_early: int = 0  # rounds this node saw closed without the last call
    _private_round: int | None = None  # the next rendezvous is this node alone, to join that round in place
    _client: EtcdClient | None = None
    _lapsed: LapsedNodes | None = None  # drops a node whose liveness lease is gone (use_liveness_lease)

    def reform_fast(self, client: EtcdClient, backend: EtcdV3RendezvousBackend) -> bool:
        """Rendezvous waits that end when the state changes (``wakeup.py``) and re-forming rounds that close as
        soon as every live node is in (``quorum.py``). False, torch's behaviour kept, when torch's private parts
        these rely on moved (logged once, with what moved)."""
        holder = self._state_holder
        if not isinstance(holder, _BackendRendezvousStateHolder) or not wakeup.install():
            get_logger().warning("rendezvous_polling", reason="; ".join(wakeup.surface_problems()) or "no holder")
            return False
        self._client = client
        self.state_wakeup = wakeup.StateWakeup(
            client,
            backend.key,
            backend.last_revision,
            holder,
            self._this_node,
            self._settings,
            also_due=self._due_in,
        )
        self._op_executor = ReformingExecutor(self._op_executor, self._closing_early, self.state_wakeup.active)
        return True

    def _due_in(self) -> float | None:
        """The next time the rendezvous loop should look again that torch's state does not hold."""
        due = [part.due_in() for part in (self._closing, self._lapsed) if part is not None]
        return min((d for d in due if d is not None), default=None)

    def use_liveness_lease(self, hold: Callable[[str, str], None]) -> None:
        """Put this daemon's rendezvous name on its node's liveness lease (``hold(key, value)``), and drop a node
        from the state once its lease is gone instead of when its heartbeat expires (``lapsed.py``). Every daemon of
        the run does this; torchrun with this handler does not, and keeps torch's rule (as when torch's private
        parts moved: :meth:`reform_fast` returned False)."""
        client = self._client
        holder = self._state_holder
        if client is None or not isinstance(holder, _BackendRendezvousStateHolder):
            return
        keys = RunKeys(self._settings.run_id)
        name = repr(self._this_node)  # torch's own name of a node: addr_pid_localid
        hold(keys.rdzv_alive(name), name)
        prefix = keys.rdzv_alive_prefix

        def alive() -> frozenset[str] | None:
            try:
                return frozenset(key[len(prefix) :] for key, _value, _rev in client.get_prefix(prefix))
            except EtcdError:
                return None  # etcd busy: torch's heartbeat rule this time

        self._lapsed = LapsedNodes(
            holder,
            self._settings,
            self._this_node,
            alive,
            on_removed=lambda node: get_logger().info("rendezvous_node_lapsed", node=node),
        )

    def _closing_early(self, join: StateHandler) -> StateHandler:
        # Only a node that has formed a round before: at a job's start, nodes still starting need the last call.
        self._closing = CloseWhenEveryoneIsIn(join, lambda: self._completed_round is not None, self._closed_early)
        return self._closing

    def _closed_early(self, round_: int, nodes: int) -> None:
        self._closing_round = round_  # logged once the round is ours (another node's close may win the race)

    @property
    def use_agent_store(self) -> bool:
        """Never: workers get their own TCPStore address each round (see :meth:`next_rendezvous`)."""
        return False

    def join_in_place(self, round_: int) -> None:
        """Make the next rendezvous a private round of this node alone: it joins ``round_``'s group, which trains
        in place, through its workers instead of a new round (``elasticd/agent/joining.py``)."""
        self._private_round = round_

    def next_rendezvous(self) -> RendezvousInfo:
        """See base class. Each round publishes a fresh MASTER_ADDR/MASTER_PORT picked by its rank 0."""
        if self._private_round is not None:
            self._completed_round, self._private_round = self._private_round, None
            self._round_watch = None  # no round of the rendezvous forms here: none of its members can be lost
            return _private_round(self._this_node.addr)
        # torch reads this inside next_rendezvous. Sharing round 1's TCPStore with the workers breaks recovery
        # when the node hosting it dies: every later round points at the dead host (pytorch issue #135712).
        os.environ[envvars.TORCH_DISABLE_SHARED_STORE] = "1"
        self.end_round_watch()
        info = super().next_rendezvous()  # publishing the store address waits through _get_store's bounded store
        self._completed_round = self._state_holder.state.round
        if self._closing_round == self._completed_round:
            self.closed_early += 1
            last_call_s = self._settings.timeout.last_call.total_seconds()
            get_logger().info("rendezvous_closed_early", round=self._completed_round, last_call_skipped_s=last_call_s)
        self._closing_round = None
        faults.maybe_die("published", rank=info.rank, round_=self._completed_round)
        return info

    def _get_store(self) -> dist.Store:
        """torch's hook between deciding the round and publishing the store address: the round's store, whose
        waits end as soon as a member of this round is gone (``RoundAbandonedError``)."""
        state = self._state_holder.state
        rank = state.participants[self._this_node]
        faults.maybe_die("joined", rank=rank, round_=state.round)
        if not isinstance(self._store, EtcdV3Store):
            return super()._get_store()
        watch = RoundWatch(state.round, {str(node): r for node, r in state.participants.items()}, self._round_view)
        self._round_watch = watch
        # Referenced here for the round's lifetime: torch's PrefixStore holds only the C++ half of a Python store.
        self._round_store = self._store.bounded_by(watch)
        return self._wrap_store(self._round_store)

    def end_round_watch(self) -> None:
        """The round formed (or is being left): its store waits are over."""
        if self._round_watch is not None:
            self._round_watch.end()

    def watch_members(
        self, formed: Callable[[], bool], on_lost: Callable[[dict[str, int], dict[str, int]], None] | None = None
    ) -> None:
        """Until ``formed()`` (the workers built their process group), count a member lost from this round as a
        node waiting in :meth:`num_nodes_waiting`, so the agent re-rendezvouses at once (a membership change).

        Workers of a round whose rank-0 node died before its worker opened the worker store would otherwise wait
        out torch's 30 min connect timeout; once the group has formed, a lost member fails the workers' collectives
        (torch's monitor sees it) or stalls them (the hang watchdog sees it). ``on_lost`` hears the members that
        are gone, as two maps to their group ranks (lost: dead; left: queued for the next round), once per round."""
        self._formed, self._on_lost = formed, on_lost

    def num_nodes_waiting(self) -> int:
        """See base class; plus, while the round's workers are still forming, the members it lost."""
        waiting = super().num_nodes_waiting()
        formed, watch = self._formed, self._round_watch
        if formed is None or watch is None or watch.round != self._completed_round or formed():
            return waiting
        view = self._round_view()  # the state super() just synced (cached for a second)
        if view is None:
            return waiting
        if view.round != watch.round:
            # Every other member left our round (we were dropped from it): all of them count.
            view = RoundView(watch.round, frozenset({self.member}), frozenset(watch.members))
        lost, left = watch.gone(view)
        if (lost or left) and self._on_lost is not None:
            on_lost, self._on_lost = self._on_lost, None
            on_lost({m: watch.ranks.get(m, -1) for m in lost}, {m: watch.ranks.get(m, -1) for m in left})
        return waiting + len(lost) + len(left)

    @property
    def member(self) -> str:
        """This node as the rendezvous state names it (``addr_pid_localid``); lost members are named this way."""
        return str(self._this_node)

    def _round_view(self) -> RoundView | None:
        try:
            with self._heartbeat_lock:
                self._state_holder.sync()  # also drops members whose keep-alive expired
                state = self._state_holder.state
                waiting = state.wait_list | state.redundancy_list
                return RoundView(
                    state.round, frozenset(str(n) for n in state.participants), frozenset(str(n) for n in waiting)
                )
        except RendezvousError:
            return None  # etcd away: the store wait itself reports a lasting outage

    @property
    def round(self) -> int | None:
        """The round of the last rendezvous this node completed (None before the first)."""
        return self._completed_round

    def leave(self) -> bool:
        """Stop heartbeats and take this node out of the rendezvous without closing it (``shutdown`` closes it
        for every node): the others re-form without waiting out the keep-alive timeout. False when etcd could
        not be reached; the keep-alive timeout then evicts this node anyway."""
        self._stop_heartbeats()
        try:
            with self._heartbeat_lock:
                self._op_executor.run(_LeaveOp(), self._get_deadline(self._settings.timeout.close))
        except RendezvousError:
            return False
        return True

    def participants(self) -> int:
        """Nodes in the current round, from the shared state (read from etcd at most once a second)."""
        with self._heartbeat_lock:
            self._state_holder.sync()
            return len(self._state_holder.state.participants)


class _LeaveOp:
    """Like torch's exit op, which only leaves the participants, but also leaves the wait and redundancy lists."""

    def __call__(self, ctx: _RendezvousContext, deadline: float) -> _Action:
        state = ctx.state
        if ctx.node in state.participants:
            action = _Action.REMOVE_FROM_PARTICIPANTS
        elif ctx.node in state.wait_list:
            action = _Action.REMOVE_FROM_WAIT_LIST
        elif ctx.node in state.redundancy_list:
            action = _Action.REMOVE_FROM_REDUNDANCY_LIST
        else:
            return _Action.FINISH
        return _Action.ERROR_TIMEOUT if time.monotonic() > deadline else action


def _private_round(local_addr: str | None) -> RendezvousInfo:
    """torch's ``RendezvousInfo`` of a round of this node alone: an in-memory store, rank 0 of 1, a free port."""
    store = dist.HashStore()
    return RendezvousInfo(store, 0, 1, RendezvousStoreInfo.build(0, store, local_addr))


def create_handler(params: RendezvousParameters) -> ElasticdRendezvousHandler:
    """Build a connected handler from torchrun's parameters.

    ``params.endpoint`` is ``HOST:PORT[,HOST:PORT...]``; optional config keys (``--rdzv-conf``):
    ``connect_timeout``, ``cacert``, ``cert``, ``key``, ``user``, ``password``, ``join_timeout``,
    ``last_call_timeout``, ``close_timeout``, ``heartbeat_timeout`` (seconds), ``keep_alive_interval`` (whole
    seconds), ``keep_alive_max_attempt``. Raises ConfigError for bad parameters and EtcdUnavailableError when
    etcd does not answer in time."""
    return build_handler(connect(params), params)


def connect(params: RendezvousParameters) -> EtcdClient:
    """A client of the etcd that ``params`` name (endpoints, TLS, user), checked first: ConfigError for a bad run id or
    endpoint, EtcdUnavailableError when etcd does not answer within ``connect_timeout``."""
    reason = validate_run_id(params.run_id)
    if reason is not None:
        raise ConfigError("--rdzv-id", f"{params.run_id!r}: {reason}")
    endpoints = parse_endpoints(params.endpoint, key="--rdzv-endpoint")
    return EtcdClient.connect(
        endpoints,
        connect_timeout_s=seconds_option(params, "connect_timeout", CONNECT_TIMEOUT_S),
        ca_cert=params.get("cacert"),
        cert=params.get("cert"),
        key=params.get("key"),
        user=params.get("user"),
        password=params.get("password"),
    )


def build_handler(client: EtcdClient, params: RendezvousParameters) -> ElasticdRendezvousHandler:
    """A handler over ``client`` (connected; :func:`create_handler` makes one per handler, ``bench/control_plane.py``
    shares one among many simulated nodes), with ``params``' elastic range, timings and ids."""
    timeout = RendezvousTimeout(
        join=timedelta(seconds=seconds_option(params, "join_timeout", JOIN_TIMEOUT_S)),
        last_call=timedelta(seconds=seconds_option(params, "last_call_timeout", LAST_CALL_TIMEOUT_S)),
        close=timedelta(seconds=seconds_option(params, "close_timeout", CLOSE_TIMEOUT_S)),
        heartbeat=timedelta(seconds=seconds_option(params, "heartbeat_timeout", HEARTBEAT_TIMEOUT_S)),
    )
    keys = RunKeys(params.run_id)
    backend = EtcdV3RendezvousBackend(client, params.run_id)
    # from_backend constructs through cls(...), so this returns our subclass with torch's own wiring.
    handler = ElasticdRendezvousHandler.from_backend(
        params.run_id,
        EtcdV3Store(client, keys.store_prefix),
        backend,
        params.min_nodes,
        params.max_nodes,
        params.local_addr,
        timeout,
        keep_alive_interval=_positive_int(params, "keep_alive_interval", KEEP_ALIVE_INTERVAL_S),
        keep_alive_max_attempt=_positive_int(params, "keep_alive_max_attempt", KEEP_ALIVE_MAX_ATTEMPT),
    )
    assert isinstance(handler, ElasticdRendezvousHandler)
    event_names.install()  # CPU only: torch keeps its own naming when its use moved (the fallback says so)
    handler.reform_fast(client, backend)
    return handler


def handler_factory() -> RendezvousHandlerCreator:
    """The ``torchrun.handlers`` entry point: torch calls it and registers the result as ``etcd-v3``."""
    return create_handler


def register() -> None:
    """Register ``etcd-v3`` in torch's handler registry; calling it again is a no-op.

    Raises torch's ValueError if another creator already holds the name.
    """
    rendezvous_handler_registry.register(BACKEND_NAME, create_handler)


def seconds_option(params: RendezvousParameters, key: str, default: float) -> float:
    value = params.get(key, default)
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"rdzv {key}", f"{value!r} is not a number of seconds") from None
    if seconds <= 0:
        raise ConfigError(f"rdzv {key}", f"{value!r} must be a positive number of seconds")
    return seconds


def _positive_int(params: RendezvousParameters, key: str, default: int) -> int:
    value = params.get(key, default)
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"rdzv {key}", f"{value!r} is not a whole number") from None
    if number < 1:
        raise ConfigError(f"rdzv {key}", f"{value!r} must be at least 1")
    return number
