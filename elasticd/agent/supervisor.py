"""The supervisor: torch's ``LocalElasticAgent`` with our decision loop, events, metrics and registry updates.

torch keeps what it does well: spawning and stopping workers, monitoring exit codes, the rendezvous and the rank
assignment. ``ElasticdAgent`` overrides torch's hooks (``_rendezvous``, ``_assign_worker_ranks``,
``_start_workers``, ``_monitor_workers``, ``_exit_barrier``) and replaces ``_invoke_run``, the loop that decides
what happens next: a :class:`~elasticd.agent.controller.Controller` stepped every monitor interval over the parts
wired here (``group.py``, ``reports.py``, ``run_view.py``, ``node_hangs.py``), until it returns the node's
:class:`~elasticd.agent.controller.Outcome`, which ``run()`` hands to the daemon. After every rendezvous the agents
swap node ids through the round's store, which is how a survivor names the node that was lost and how everyone
names the node that joined; the round's state lives in :class:`~elasticd.agent.round.RoundState`.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import Any

from torch.distributed.elastic.agent.server.api import RunResult, Worker, WorkerGroup, WorkerSpec, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

from elasticd import envvars
from elasticd.agent.controller import Controller, Outcome, Signals
from elasticd.agent.group import GroupActions
from elasticd.agent.hangs import HangHandler
from elasticd.agent.joining import join_name
from elasticd.agent.node_hangs import NodeHangs
from elasticd.agent.policy import SupervisorPolicy
from elasticd.agent.polling import EtcdPoll
from elasticd.agent.progress import ProgressTracker
from elasticd.agent.reconfig import Reconfigurations
from elasticd.agent.registry import NodeRegistry
from elasticd.agent.reports import WorkerReports
from elasticd.agent.round import RoundState
from elasticd.agent.run_view import EtcdRunView
from elasticd.agent.spares import Sizing
from elasticd.agent.stragglers import StragglerDetector
from elasticd.agent.workers import LocalWorkers
from elasticd.group_record import GroupToJoin
from elasticd.lineage import CheckpointRecord, Lineage, TokenWriteError
from elasticd.logging import get_logger
from elasticd.membership import Membership
from elasticd.metrics import Metrics
from elasticd.rendezvous import faults as rdzv_faults
from elasticd.rendezvous.handler import ElasticdRendezvousHandler
from elasticd.rendezvous.lease_handler import LeaseRendezvousHandler
from elasticd.rendezvous.liveness import RoundAbandonedError

# The daemon's rendezvous handlers (agent/daemon.py picks one): private rounds, members lost while a round forms.
DAEMON_HANDLERS = (ElasticdRendezvousHandler, LeaseRendezvousHandler)
DaemonHandler = ElasticdRendezvousHandler | LeaseRendezvousHandler
_NODE_KEY = "elasticd/node/"
# The round's fencing token, published by its rank-0 agent in the round's store ("" when it could not be written).
_TOKEN_KEY = "elasticd/token"
# Seconds to wait for every agent of a fresh round to publish its node id. A peer that dies in between is noticed
# within seconds (the round's store waits are bounded by its members' keep-alive: RoundAbandonedError); this only
# bounds a member that is alive but never writes.
_MEMBERSHIP_TIMEOUT_S = 60


class ElasticdAgent(LocalElasticAgent):
    """One node's agent: torch's hooks, and the wiring of the loop's parts. ``drain_requested`` is polled."""

    def __init__(
        self,
        *args: Any,
        run_id: str,
        node_id: str,
        metrics: Metrics,
        registry: NodeRegistry,
        drain_requested: Callable[[], bool],
        lineage: Lineage | None = None,
        adopt: Callable[[], CheckpointRecord | None] | None = None,
        checkpoint_timeout_s: float = 120.0,
        policy: SupervisorPolicy | None = None,
        hangs: HangHandler | None = None,
        stragglers: StragglerDetector | None = None,
        read_peers: Callable[[], list[dict[str, Any]]] = list,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        sizing: Sizing | None = None,
        membership: Membership | None = None,
        join_finder: Callable[[], GroupToJoin | None] | None = None,
        announce_leaving: Callable[[], None] | None = None,
        group_nodes: Callable[[], list[str] | None] | None = None,
        worker_starts: Callable[[], AbstractContextManager[None]] = contextlib.nullcontext,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self._worker_starts = worker_starts  # around torch's start of the workers: warm starts (agent/warm_start.py)
        self._run_id = run_id
        self._node_id = node_id
        self._metrics = metrics
        self._registry = registry
        self._policy = policy or SupervisorPolicy()
        self._clock = clock
        self._log = get_logger(run_id=run_id, node_id=node_id)
        self._lineage = lineage
        self._adopt = adopt
        self._join_finder = join_finder  # hot recovery: a group that trains in place, for a starting node to join
        self._read_peers = read_peers
        self.round_state = RoundState()
        self.signals = Signals()  # the daemon's signal handler and the loop: may a signal wait for a clean leave
        self.reports = WorkerReports()
        self.stragglers = stragglers or StragglerDetector(factor=0, window_s=30)
        self.sizing = sizing or Sizing()
        self.progress = ProgressTracker(metrics, registry, self.reports, lambda: self._log, clock, self.stragglers)
        self.reconfigurations = Reconfigurations(metrics, registry.update, lambda: self._log, note=registry.note)
        self.workers = LocalWorkers(self, clock=clock, sleep=sleep)
        poll = self._poll = EtcdPoll(clock, lambda: self._log)
        self.group = GroupActions(
            self.workers,
            node_id=node_id,
            round_state=self.round_state,
            reports=self.reports,
            progress=self.progress,
            sizing=self.sizing,
            metrics=metrics,
            registry=registry,
            log=lambda: self._log,
            poll=poll,
            checkpoint_timeout_s=checkpoint_timeout_s,
            announce_leaving=announce_leaving,
            group_nodes=group_nodes,
        )
        self.run_view = EtcdRunView(
            node_id=node_id,
            round_state=self.round_state,
            registry=registry,
            metrics=metrics,
            log=lambda: self._log,
            poll=poll,
            drain_requested=drain_requested,
            nodes_waiting=self.workers.group.spec.rdzv_handler.num_nodes_waiting,
            sizing=self.sizing,
            stragglers=self.stragglers,
            read_peers=read_peers,
            lineage=lineage,
            membership=membership,
        )
        self.hangs = NodeHangs(
            hangs,
            node_id=node_id,
            workers=self.workers,
            round_state=self.round_state,
            reports=self.reports,
            sizing=self.sizing,
            log=lambda: self._log,
            poll=poll,
            membership=membership,
        )

    @property
    def log(self) -> Any:
        """The agent's event logger, bound to run id, node id and the current round."""
        return self._log

    # -- torch hooks ---------------------------------------------------------------------------------------------

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        self.signals.graceful = False  # nothing to checkpoint while we wait for a round: a signal ends the daemon
        handler = worker_group.spec.rdzv_handler
        self._registry.update(state="rendezvous", rdzv_member=getattr(handler, "member", None))
        start = self._clock()
        rounds = self.round_state
        # a node that starts, or restarts its workers (they died, were left out, or fell back), joins the run's group
        # in place while it trains that way; after giving up on that once, through the rendezvous
        may_join = rounds.next_round_may_join()
        if may_join and self._join_finder is not None and isinstance(handler, DAEMON_HANDLERS):
            joining = self._poll(self._join_finder, None)
            if joining is not None:
                rounds.join(joining)
                handler.join_in_place(joining.round)
                self._log.info("joining_in_place", round=joining.round, group_nodes=list(joining.nodes))
        joining = rounds.joining
        while True:
            try:
                super()._rendezvous(worker_group)
                round_: int | None = getattr(handler, "round", None)
                members = self._exchange_node_ids(worker_group)
                token, round_token = self._agree_token(worker_group, round_, joining)
                break
            except RoundAbandonedError as exc:
                # A member died (or left) before the round could start training: form the next one, as after
                # any membership change. Not a failure, and not one of --max-restarts.
                self._round_abandoned(exc)
        previous = rounds.start(round_, members, token, round_token)
        if isinstance(handler, DAEMON_HANDLERS):
            handler.end_round_watch()
            # Until the workers have formed their process group, a member lost from this round is a membership
            # change (workers would wait for a dead rank 0's store for torch's 30 min connect timeout).
            handler.watch_members(self.reports.all_capable, on_lost=self._round_member_lost)
        duration_s = self._clock() - start
        world_size = (worker_group.group_world_size or 0) * worker_group.spec.local_world_size
        self._log = get_logger(run_id=self._run_id, node_id=self._node_id, round=round_)
        self._log.info(
            "rendezvous_done",
            nodes=len(members),
            members=members,
            group_rank=worker_group.group_rank,
            world_size=world_size,
            duration_s=round(duration_s, 3),
        )
        if previous and joining is None:  # a private round names no other node: nobody was lost
            for lost in sorted(set(previous) - set(members)):
                self._log.warning("node_lost", lost_node=lost)
            for joined in sorted(set(members) - set(previous)):
                self._log.info("node_joined", joined_node=joined)
        self.hangs.round_started(round_, worker_group.group_rank)
        self._metrics.rendezvous_total.inc()
        self._metrics.rendezvous_duration_seconds.observe(duration_s)
        self._metrics.nodes.set(len(members))
        self._metrics.world_size.set(world_size)
        self._registry.update(
            state="starting",
            round=round_,
            nodes=len(members),
            world_size=world_size,
            workers=worker_group.spec.local_world_size,
        )

    def _round_abandoned(self, exc: RoundAbandonedError) -> None:
        records: list[dict[str, Any]] = self._poll(self._read_peers, []) if exc.lost else []
        # A killed daemon's registry record outlives it by its lease TTL (10 s): it still names the lost member.
        lost_nodes = sorted(str(r.get("node_id")) for r in records if r.get("rdzv_member") in exc.lost)
        self._log.warning(
            "round_abandoned",
            abandoned_round=exc.round,
            reason=exc.reason,
            phase=exc.phase,
            lost_members=list(exc.lost),
            lost_nodes=lost_nodes,
            left_members=list(exc.left),
            waited_s=round(exc.waited_s, 3),
        )
        self._registry.update(state="rendezvous")

    def _round_member_lost(self, lost: dict[str, int], left: dict[str, int]) -> None:
        members = self.round_state.members

        def named(ranks: dict[str, int]) -> list[str]:
            return sorted(members[rank] for rank in ranks.values() if 0 <= rank < len(members))

        self._log.warning(
            "round_member_lost", lost_members=sorted(lost), lost_nodes=named(lost), left_nodes=named(left)
        )

    def _exchange_node_ids(self, worker_group: WorkerGroup) -> list[str]:
        store = worker_group.store
        assert store is not None
        store.set(f"{_NODE_KEY}{worker_group.group_rank}", self._node_id)
        keys = [f"{_NODE_KEY}{rank}" for rank in range(worker_group.group_world_size)]
        old_timeout = store.timeout
        store.set_timeout(timedelta(seconds=_MEMBERSHIP_TIMEOUT_S))
        try:
            return [value.decode() for value in store.multi_get(keys)]
        finally:
            store.set_timeout(old_timeout)

    def _agree_token(
        self, worker_group: WorkerGroup, round_: int | None, joining: GroupToJoin | None
    ) -> tuple[str | None, str | None]:
        """The new group's fencing token and the round's own (its workers' member names): the first written by the
        round's rank 0 (a checked etcd transaction, bounded retries) and passed to the others through the round's
        store. A round whose token could not be written starts no workers (they could never commit): it is
        abandoned, and the nodes form another."""
        if joining is not None:
            # no token of the run's until an epoch admits this node's workers (on_beat adopts it then)
            return None, join_name(self._node_id)
        if self._lineage is None:
            return None, None
        store = worker_group.store
        assert store is not None
        if worker_group.group_rank == 0:
            try:
                token = self._lineage.begin(round_ or 0, self._adopt)
            except TokenWriteError as exc:
                self._metrics.fence_token_failures_total.inc()
                self._log.error("token_write_failed", error=str(exc))
                token = ""
            store.set(_TOKEN_KEY, token)
        else:
            old_timeout = store.timeout
            store.set_timeout(timedelta(seconds=_MEMBERSHIP_TIMEOUT_S))
            try:
                token = store.get(_TOKEN_KEY).decode()
            finally:
                store.set_timeout(old_timeout)
        if not token:
            raise RoundAbandonedError(round_ or 0, "no fencing token could be written")
        self._log.info("lineage_token", token=token)
        return token, token

    def _assign_worker_ranks(
        self, store: Any, group_rank: int, group_world_size: int, spec: WorkerSpec
    ) -> list[Worker]:
        if self.round_state.joining is not None:
            self.sizing.joining(getattr(spec.rdzv_handler, "round", None))
            return super()._assign_worker_ranks(store, group_rank, group_world_size, spec)
        # Only the nodes that train get ranks, counted among themselves (WORLD_SIZE, RANK); a spare gets none.
        training = self.sizing.agree(store, group_rank, group_world_size, getattr(spec.rdzv_handler, "round", None))
        if group_rank >= training:
            return []
        return super()._assign_worker_ranks(store, group_rank, training, spec)

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        if self.sizing.spare:  # no workers: healthy until a training node finished the run
            finished = self._poll(self.sizing.run_finished, False)
            return RunResult(state=WorkerState.SUCCEEDED if finished else WorkerState.HEALTHY)
        return super()._monitor_workers(worker_group)

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        rounds = self.round_state
        round_, token, round_token, joining = rounds.round, rounds.token, rounds.round_token, rounds.joining
        # Workers inherit the daemon's environment: the round (for manifests) and the token that fences commits.
        os.environ[envvars.ROUND] = str(round_ if round_ is not None else 0)
        if token is not None:
            os.environ[envvars.FENCE_TOKEN] = token
        if joining is not None and round_token is not None:
            os.environ[envvars.FENCE_TOKEN] = round_token  # fences nothing in: never the run's token
            os.environ[envvars.JOIN_ROUND] = str(joining.round)
        else:
            os.environ.pop(envvars.JOIN_ROUND, None)
        self.reports.reset({w.local_rank for w in worker_group.workers})
        self.stragglers.reset()
        self.hangs.workers_starting(tuple(sorted(w.local_rank for w in worker_group.workers)))
        if self.sizing.started(self._log, worker_group.spec.local_world_size):
            self.workers.forget_processes()  # a spare this round: nothing to start, stop or watch
            return {}
        with self._worker_starts():
            pids = super()._start_workers(worker_group)
        rdzv_faults.maybe_die(
            "started", rank=worker_group.group_rank or 0, round_=round_, pids=pids.values(), log=self._log.warning
        )
        self._log.info("workers_started", pids=sorted(pids.values()), local_world_size=len(pids))
        self._registry.update(state="running")
        return pids

    def _exit_barrier(self) -> None:
        # torch waits for every agent of the round here; after a recovery in place a lost node never comes, and
        # the wait would last torch's exit-barrier timeout (5 min). The group's store is etcd: nobody hosts it.
        if self.round_state.regrouped_in_place:
            self._log.info("exit_barrier_skipped", reason="the group re-formed in place since the round began")
            return
        super()._exit_barrier()

    # -- the beats, on the beat receiver's thread ------------------------------------------------------------------

    def on_beat(self, beat: dict[str, Any]) -> None:
        """Called on the beat receiver's thread for every beat of a local worker; each part takes its own lock."""
        self.progress.on_beat(beat)
        self.reconfigurations.on_beat(beat)
        self.sizing.on_beat(beat)
        self.round_state.on_beat(beat)

    # -- the loop ------------------------------------------------------------------------------------------------

    def controller(self) -> Controller:
        """The supervisor loop over this agent's parts."""
        return Controller(
            workers=self.group,
            reports=self.reports,
            run=self.run_view,
            hangs=self.hangs,
            signals=self.signals,
            policy=self._policy,
            clock=self._clock,
        )

    def _invoke_run(self, role: str = "default") -> RunResult:
        self.workers.initialize()
        controller = self.controller()
        while True:
            self.workers.pause()
            outcome = controller.step()
            if outcome is not None:
                return outcome

    def run(self, role: str = "default") -> Outcome:
        """torch's run (rendezvous, the loop, shutdown, its events), answering the loop's :class:`Outcome`."""
        outcome = super().run(role)
        # torch answers None only for a node its rendezvous lets out "gracefully" (in a closed run's redundancy
        # list), which the daemon never handled; an Outcome in every other case
        assert isinstance(outcome, Outcome), outcome
        return outcome
