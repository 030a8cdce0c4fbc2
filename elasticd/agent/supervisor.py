"""The supervisor: torch's ``LocalElasticAgent`` with our decision loop, events, metrics and registry updates.

torch keeps what it does well: spawning and stopping workers, monitoring exit codes, the rendezvous and the rank
assignment. We replace only ``_invoke_run``, the loop that decides what happens next, so each decision comes from
:class:`~elasticd.agent.policy.SupervisorPolicy` and each lifecycle step is one structlog event with run id, node id
and round. After every rendezvous the agents swap node ids through the round's store, which is how a survivor
names the node that was lost and how everyone names the node that joined.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from datetime import timedelta
from functools import partial
from typing import Any, TypeVar

from torch.distributed.elastic.agent.server.api import RunResult, Worker, WorkerGroup, WorkerSpec, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

from elasticd import envvars
from elasticd.agent.controller import Controller, NodeState, group_state
from elasticd.agent.hangs import HangHandler
from elasticd.agent.joining import join_name
from elasticd.agent.policy import Decision, GroupState, HangReport, SupervisorPolicy
from elasticd.agent.progress import ProgressTracker
from elasticd.agent.reconfig import Reconfigurations
from elasticd.agent.registry import NodeRegistry
from elasticd.agent.reports import WorkerReports
from elasticd.agent.spares import Sizing
from elasticd.agent.stragglers import StragglerDetector
from elasticd.board import Phase
from elasticd.etcd.client import EtcdError
from elasticd.group_record import GroupToJoin
from elasticd.lineage import CheckpointRecord, Lineage, TokenWriteError
from elasticd.logging import get_logger
from elasticd.membership import Membership
from elasticd.messages import Kind, kind_of
from elasticd.metrics import Metrics
from elasticd.rendezvous import faults as rdzv_faults
from elasticd.rendezvous.handler import ElasticdRendezvousHandler
from elasticd.rendezvous.liveness import RoundAbandonedError

T = TypeVar("T")

_NODE_KEY = "elasticd/node/"
# The round's fencing token, published by its rank-0 agent in the round's store ("" when it could not be written).
_TOKEN_KEY = "elasticd/token"
# Seconds to wait for every agent of a fresh round to publish its node id. A peer that dies in between is noticed
# within seconds (the round's store waits are bounded by its members' keep-alive: RoundAbandonedError); this only
# bounds a member that is alive but never writes.
_MEMBERSHIP_TIMEOUT_S = 60
# Seconds between two etcd_unavailable warnings while etcd stays away.
_ETCD_WARN_INTERVAL_S = 10.0
# Seconds between telling the group of a hang whose culprits are here and killing them: the others abandon their
# collective on the notice (their failure watch pushes it to the hook) rather than on the reset, so they count a hang.
_HANG_NOTICE_S = 0.1


class ElasticdAgent(LocalElasticAgent):
    """One node's agent. ``drain_requested`` is polled; ``on_round`` lets the daemon see each new round."""

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
        sizing: Sizing | None = None,
        membership: Membership | None = None,
        join_finder: Callable[[], GroupToJoin | None] | None = None,
        announce_leaving: Callable[[], None] | None = None,
        group_nodes: Callable[[], list[str] | None] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self._run_id = run_id
        self._node_id = node_id
        self._metrics = metrics
        self._registry = registry
        self._drain_requested = drain_requested
        self._policy = policy or SupervisorPolicy()
        self._clock = clock
        self._log = get_logger(run_id=run_id, node_id=node_id)
        self._members: list[str] = []
        self.round: int | None = None
        self.drained = False
        self.stop_message = ""
        self.exit_code = 0
        self.left = False
        self.leave_requested = False  # set by the daemon's SIGTERM handler
        self.graceful = False  # True while workers run under the loop: a signal can wait for a clean leave
        self._lineage = lineage
        self._adopt = adopt
        self.token: str | None = None  # the fencing token of the current group's workers
        self._round_token: str | None = None  # the token the round started with: its workers' member names
        self._membership = membership  # hot recovery's epochs: each one moves the token in place
        self.regrouped_in_place = False  # the workers re-formed their group in place during this round
        # local rank -> the rank its worker's latest beat gave: in the group it trains in now (in place the round's
        # ranks are stale, and a joiner's private round numbers its workers from 0 like the first node's)
        self._beat_ranks: dict[int, int] = {}
        self._join_finder = join_finder  # hot recovery: a group that trains in place, for a starting node to join
        self.joining: GroupToJoin | None = None  # this round is private: its workers join that group in place
        self._through_rendezvous = False  # the next round comes from the rendezvous, not from joining in place
        self.joined_in_place = False  # this node came into the run by joining a group in place (ever)
        self._announce_leaving = announce_leaving  # hot recovery: this node's workers leave their group in place
        self._group_nodes = group_nodes  # the nodes of the group that trains in place now (None: none does)
        self._checkpoint_timeout_s = checkpoint_timeout_s
        self.reports = WorkerReports()
        self.stragglers = stragglers or StragglerDetector(factor=0, window_s=30)
        self.progress = ProgressTracker(metrics, registry, self.reports, lambda: self._log, clock, self.stragglers)
        self.reconfigurations = Reconfigurations(metrics, registry.update, lambda: self._log, note=registry.note)
        self.hangs = hangs
        self._read_peers = read_peers
        self._workers_started_at = clock()
        self._etcd_warned = -_ETCD_WARN_INTERVAL_S
        self.sizing = sizing or Sizing()

    @property
    def log(self) -> Any:
        """The agent's event logger, bound to run id, node id and the current round."""
        return self._log

    # -- torch hooks ---------------------------------------------------------------------------------------------

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        self.graceful = False  # nothing to checkpoint while we wait for a round: a signal ends the daemon
        handler = worker_group.spec.rdzv_handler
        self._registry.update(state="rendezvous", rdzv_member=getattr(handler, "member", None))
        start = self._clock()
        # a node that starts, or restarts its workers (they died, were left out, or fell back), joins the run's group
        # in place while it trains that way; after giving up on that once, through the rendezvous
        try_join, self._through_rendezvous, self.joining = not self._through_rendezvous, False, None
        if try_join and self._join_finder is not None and isinstance(handler, ElasticdRendezvousHandler):
            self.joining = self._poll(self._join_finder, None)
            if self.joining is not None:
                self.joined_in_place = True
                handler.join_in_place(self.joining.round)
                self._log.info("joining_in_place", round=self.joining.round, group_nodes=list(self.joining.nodes))
        while True:
            try:
                super()._rendezvous(worker_group)
                self.round = getattr(handler, "round", None)
                members = self._exchange_node_ids(worker_group)
                self.token = self._agree_token(worker_group)
                self.regrouped_in_place = False
                self._beat_ranks = {}
                if self.hangs is not None:
                    self.hangs.epoch, self.hangs.in_place = 0, False  # a new round agrees on its hangs afresh
                break
            except RoundAbandonedError as exc:
                # A member died (or left) before the round could start training: form the next one, as after
                # any membership change. Not a failure, and not one of --max-restarts.
                self._round_abandoned(exc)
        if isinstance(handler, ElasticdRendezvousHandler):
            handler.end_round_watch()
            # Until the workers have formed their process group, a member lost from this round is a membership
            # change (workers would wait for a dead rank 0's store for torch's 30 min connect timeout).
            handler.watch_members(self.reports.all_capable, on_lost=self._round_member_lost)
        duration_s = self._clock() - start
        previous, self._members = self._members, members
        world_size = (worker_group.group_world_size or 0) * worker_group.spec.local_world_size
        self._log = get_logger(run_id=self._run_id, node_id=self._node_id, round=self.round)
        self._log.info(
            "rendezvous_done",
            nodes=len(members),
            members=members,
            group_rank=worker_group.group_rank,
            world_size=world_size,
            duration_s=round(duration_s, 3),
        )
        if previous and self.joining is None:  # a private round names no other node: nobody was lost
            for lost in sorted(set(previous) - set(members)):
                self._log.warning("node_lost", lost_node=lost)
            for joined in sorted(set(members) - set(previous)):
                self._log.info("node_joined", joined_node=joined)
        hangs = self.hangs
        if worker_group.group_rank == 0 and self.round is not None and hangs is not None:
            self._poll(lambda: hangs.forget_rounds_before(self.round or 0), None)
        self._metrics.rendezvous_total.inc()
        self._metrics.rendezvous_duration_seconds.observe(duration_s)
        self._metrics.nodes.set(len(members))
        self._metrics.world_size.set(world_size)
        self._registry.update(
            state="starting",
            round=self.round,
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
        def named(ranks: dict[str, int]) -> list[str]:
            return sorted(self._members[rank] for rank in ranks.values() if 0 <= rank < len(self._members))

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

    def _agree_token(self, worker_group: WorkerGroup) -> str | None:
        """The new group's fencing token: written by the round's rank 0 (a checked etcd transaction, bounded
        retries) and passed to the others through the round's store. A round whose token could not be written
        starts no workers (they could never commit): it is abandoned, and the nodes form another."""
        if self.joining is not None:
            # no token of the run's until an epoch admits this node's workers (on_beat adopts it then)
            self._round_token = join_name(self._node_id)
            return None
        if self._lineage is None:
            return None
        store = worker_group.store
        assert store is not None
        if worker_group.group_rank == 0:
            try:
                token = self._lineage.begin(self.round or 0, self._adopt)
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
            raise RoundAbandonedError(self.round or 0, "no fencing token could be written")
        self._log.info("lineage_token", token=token)
        self._round_token = token
        return token

    def lineage_lost(self) -> bool:
        """True when the workers' token is no longer the run's: etcd lost its data, or a newer group took over."""
        if self._lineage is None or self.token is None:
            return False
        unchanged: str | None = self.token
        current = self._poll(self._lineage.token, unchanged)  # etcd away: nothing to conclude
        if current == self.token:
            return False
        if current is not None and self._moved_in_place(current):
            return False
        cause = "etcd lost the run's keys" if current is None else "a newer group holds the run's fencing token"
        self._log.warning("lineage_lost", cause=cause, token=self.token, current=current)
        return True

    def run_was_drained(self) -> bool:
        """Did ``elasticd stop`` ask the whole run to stop (etcd away: no)?"""
        return bool(self._poll(self._drain_requested, False))

    def _moved_in_place(self, current: str) -> bool:
        """Did our workers' group re-form in place under ``current``? Then it is their token now (hot recovery's
        membership epoch moved the fence with one transaction), and this node's workers are still in it."""
        if self._membership is None or self._round_token is None:
            return False
        found = self._poll(self._membership.current, None)
        if found is None or found[0].token != current:
            return False
        ours = f"{self._round_token}."
        if not any(member.startswith(ours) for member in found[0].members):
            return False  # the group went on without this node: its workers are fenced off
        self._log.info("lineage_token", token=current, epoch=found[0].number)
        self.token = current
        return True

    def _assign_worker_ranks(
        self, store: Any, group_rank: int, group_world_size: int, spec: WorkerSpec
    ) -> list[Worker]:
        if self.joining is not None:
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
        # Workers inherit the daemon's environment: the round (for manifests) and the token that fences commits.
        os.environ[envvars.ROUND] = str(self.round if self.round is not None else 0)
        if self.token is not None:
            os.environ[envvars.FENCE_TOKEN] = self.token
        if self.joining is not None and self._round_token is not None:
            os.environ[envvars.FENCE_TOKEN] = self._round_token  # fences nothing in: never the run's token
            os.environ[envvars.JOIN_ROUND] = str(self.joining.round)
        else:
            os.environ.pop(envvars.JOIN_ROUND, None)
        self.reports.reset({w.local_rank for w in worker_group.workers})
        self.stragglers.reset()
        self._workers_started_at = self._clock()
        if self.hangs is not None:
            self.hangs.reset(tuple(sorted(w.local_rank for w in worker_group.workers)), self._workers_started_at)
        if self.sizing.started(self._log, worker_group.spec.local_world_size):
            self._pcontext = None  # a spare this round: nothing to start, stop or watch
            return {}
        pids = super()._start_workers(worker_group)
        rdzv_faults.maybe_die(
            "started", rank=worker_group.group_rank or 0, round_=self.round, pids=pids.values(), log=self._log.warning
        )
        self._log.info("workers_started", pids=sorted(pids.values()), local_world_size=len(pids))
        self._registry.update(state="running")
        return pids

    def on_beat(self, beat: dict[str, Any]) -> None:
        """Called on the beat receiver's thread for every beat of a local worker."""
        self.progress.on_beat(beat)
        self.reconfigurations.on_beat(beat)
        self.sizing.on_beat(beat)
        if isinstance(beat.get("rank"), int) and isinstance(beat.get("local_rank"), int):
            self._beat_ranks[beat["local_rank"]] = beat["rank"]
        if kind_of(beat) is Kind.RECONFIGURED:
            self.regrouped_in_place = True
            if isinstance(beat.get("node_ids"), list) and beat["node_ids"]:
                self._members = [str(n) for n in beat["node_ids"]]  # the group's nodes now, not the round's
            if self.hangs is not None and isinstance(beat.get("epoch"), int):
                self.hangs.epoch = beat["epoch"]  # the next hang is agreed afresh, in this epoch
                self.hangs.in_place = True  # the round's rendezvous no longer says who is in the group
            if beat.get("token"):
                self.token = str(beat["token"])  # a joiner's workers were admitted: the epoch's token is theirs

    def _exit_barrier(self) -> None:
        # torch waits for every agent of the round here; after a recovery in place a lost node never comes, and
        # the wait would last torch's exit-barrier timeout (5 min). The group's store is etcd: nobody hosts it.
        if self.regrouped_in_place:
            self._log.info("exit_barrier_skipped", reason="the group re-formed in place since the round began")
            return
        super()._exit_barrier()

    # -- the loop: a controller steps over this agent (controller.Node) -------------------------------------------

    def _invoke_run(self, role: str = "default") -> RunResult:
        spec = self._worker_group.spec
        self._initialize_workers(self._worker_group)
        controller = Controller(self, self._policy, self._clock)
        while True:
            time.sleep(spec.monitor_interval)
            result = controller.step()
            if result is not None:
                return result

    @property
    def node_id(self) -> str:
        return self._node_id

    def monitor(self) -> RunResult:
        worker_group = self._worker_group
        result = self._monitor_workers(worker_group)
        worker_group.state = result.state
        return result

    def hang_suspicion(self) -> Any | None:
        return self.hangs.check() if self.hangs is not None else None

    def drain_requested(self) -> bool:
        return bool(self._poll(self._drain_requested, False))

    def waiting_to_join(self) -> bool:
        return self.joining is not None and not self.regrouped_in_place

    def peer_hang_claim(self) -> str | None:
        hangs = self.hangs
        return None if hangs is None else self._poll(lambda: hangs.peer_claim(self.round or 0), None)

    def workers_exiting(self) -> bool:
        return self.hangs is not None and self.hangs.exiting()

    def nodes_waiting(self) -> int:
        return int(self._poll(self._worker_group.spec.rdzv_handler.num_nodes_waiting, 0))

    def fatal(self) -> tuple[str, int] | None:
        fatal = self.reports.fatal
        return (fatal.message, fatal.exit_code) if fatal else None

    def restarts_left(self) -> int:
        return int(self._remaining_restarts)

    def all_saved(self) -> bool:
        return self.reports.all_saved()

    def all_in_place(self) -> bool:
        return self.reports.all_in_place()

    def resize_needed(self, state: GroupState, failures: dict[int, Any]) -> bool:
        return bool(self._poll(partial(self.sizing.reform_needed, state, failures), False))

    def worker_phases(self) -> list[Phase]:
        if self.hangs is None:
            return []
        return [slot.phase for slot in self.hangs.watchdog.slots().values() if slot is not None]

    def set_graceful(self, graceful: bool) -> None:
        self.graceful = graceful

    def publish_state(self, state: NodeState) -> None:
        self._registry.update(state=state.value)

    def leave_hang_to_culprits(self, hang: HangReport) -> None:
        if self.hangs is not None:
            watchdog = self.hangs.watchdog
            watchdog.excuse(self._clock() + watchdog.startup_s)
        self._log.info("hang_left_to_culprits", culprit_nodes=list(hang.culprit_nodes), step=hang.step)

    def log_failures(self, result: RunResult) -> None:
        for global_rank, failure in sorted(result.failures.items()):
            self._log.warning(
                "worker_failed",
                rank=global_rank,
                local_rank=failure.local_rank,
                pid=failure.pid,
                exitcode=failure.exitcode,
                signal=failure.signal_name() if failure.exitcode < 0 else None,
            )

    def restart(self, decision: Decision, nodes_waiting: int) -> None:
        # joining in place did not work out: next time through the rendezvous
        self._through_rendezvous = self.joining is not None and not self.regrouped_in_place
        self.progress.fault()
        if decision.counts_as_restart:
            self._remaining_restarts -= 1
        self._metrics.worker_restarts_total.labels(reason=decision.reason).inc()
        self._registry.note("restart", reason=decision.reason)
        self._log.info(
            "restart", reason=decision.reason, restarts_left=self._remaining_restarts, nodes_waiting=nodes_waiting
        )
        self._restart_workers(self._worker_group)

    def finish(self) -> None:
        self._log.info("workers_finished")
        self._exit_barrier()

    def drain(self, *, leave: bool) -> RunResult:
        worker_group = self._worker_group
        self.left = leave
        self._log.info("draining", scope="node" if leave else "run")
        self._metrics.worker_restarts_total.labels(reason="drain").inc()
        self._stop_workers(worker_group)
        worker_group.state = WorkerState.STOPPED
        self.drained = True
        # torch's run() records an event per worker and expects each in the result.
        stopped = {w.global_rank: None for w in worker_group.workers}
        return RunResult(state=WorkerState.SUCCEEDED, return_values=stopped)

    def give_up(self, decision: Decision, exit_code: int, result: RunResult) -> RunResult:
        worker_group = self._worker_group
        self.stop_message = decision.message
        self.exit_code = exit_code
        self._log.error("gave_up", reason=decision.reason, message=decision.message)
        self._stop_workers(worker_group)
        worker_group.state = WorkerState.FAILED
        # torch's run() records an event per worker: each must be a failure or a return value.
        others = {w.global_rank: None for w in worker_group.workers if w.global_rank not in result.failures}
        return RunResult(state=WorkerState.FAILED, failures=result.failures, return_values=others)

    def diagnose_hang(self, suspicion: Any | None) -> HangReport | None:
        worker_group = self._worker_group
        assert self.hangs is not None
        if self.sizing.spare:
            return None  # no workers here: the training nodes diagnose their hang without this node
        pcontext = self._pcontext
        pids = dict(pcontext.pids()) if pcontext is not None else {}
        return self.hangs.handle(
            round_=self.round or 0,
            # in place, the group's nodes as its last epoch named them; otherwise the round's that train
            members=list(self._members) if self.regrouped_in_place else self.sizing.training_members(self._members),
            pids=pids,
            ranks={w.local_rank: self._current_rank(w) for w in worker_group.workers},
            can_dump=self.reports.can_dump_stacks(),
            started_at=self._workers_started_at,
            suspicion=suspicion,
        )

    def _current_rank(self, worker: Any) -> int:
        """A local worker's rank in the group it trains in now: as its beats say, else the round's."""
        rank = self._beat_ranks.get(worker.local_rank)
        return int(worker.global_rank) if rank is None else rank

    def leave_in_place(self) -> bool:
        """SIGTERM under hot recovery: this node's workers leave the group at a step boundary it agrees on, and the
        others train on in place; no checkpoint first, nothing restarts. True when every local worker left (exit 0);
        False (nothing asked, or they did not leave in time) keeps today's path: checkpoint, stop, leave."""
        announce, group_nodes = self._announce_leaving, self._group_nodes
        if announce is None or group_nodes is None or not self.reports.all_in_place():
            return False
        nodes = self._poll(group_nodes, None)
        if not nodes or self._node_id not in nodes or len(nodes) - 1 < self.sizing.min_nodes:
            return False  # not a member, or the rest would be too few: the cold path stops the group
        if not self._poll(lambda: (announce(), True)[1], False):
            return False
        self._log.info("leaving_in_place", group_nodes=nodes)
        deadline = self._clock() + self._checkpoint_timeout_s
        while self._clock() < deadline:
            state = group_state(self._monitor_workers(self._worker_group).state)
            if state is GroupState.SUCCEEDED:
                return True
            if state is GroupState.FAILED:
                return False
            time.sleep(0.05)
        self._log.warning("leave_in_place_unanswered", timeout_s=self._checkpoint_timeout_s)
        return False

    def tell_group_of_hang(self, hang: HangReport) -> None:
        """This node holds a culprit of a hang and its workers re-form in place: tell the group first, so that the
        others abandon the collective they wait in (and count a hang, not a failure) before the kill resets it."""
        membership = self._membership
        if membership is None or self._node_id not in hang.culprit_nodes or not self.reports.all_in_place():
            return
        text = f"hang: {', '.join(hang.culprit_nodes)} stopped progressing"
        if self._poll(lambda: membership.notify_group(text), False):
            time.sleep(_HANG_NOTICE_S)

    def kill_workers(self) -> None:
        """SIGKILL each worker's process group: a stopped or wedged process ignores the polite signals."""
        pcontext = self._pcontext
        if pcontext is None:
            return
        own_group = os.getpgid(0)
        for pid in pcontext.pids().values():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                group = os.getpgid(pid)
                if group != own_group:  # torch starts each worker in its own session; never signal our own group
                    os.killpg(group, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def check_stragglers(self, now: float) -> None:
        detector = self.stragglers
        if not detector.enabled:
            return
        if len(self._members) > 1:  # alone in the round: no other node to tell or hear from
            medians = detector.local_medians(now)
            self._registry.update(own_s={str(rank): round(m, 6) for rank, m in medians.items()})
            peers: dict[int, float] = {}
            records: list[dict[str, Any]] = self._poll(self._read_peers, [])
            for record in records:
                if record.get("node_id") != self._node_id and record.get("round") == self.round:
                    peers.update({int(r): float(m) for r, m in (record.get("own_s") or {}).items()})
            detector.peers(peers)
        else:
            detector.peers({})
        for event in detector.check(now):
            if event.kind == "detected":
                self._metrics.stragglers_total.inc()
                self._log.warning(
                    "straggler_detected",
                    rank=event.rank,
                    own_s=round(event.own_s, 4),
                    others_s=round(event.others_s, 4),
                    ratio=round(event.ratio, 2),
                    step_s=round(event.step_s, 4),
                )
            else:
                self._log.info("straggler_recovered", rank=event.rank, own_s=round(event.own_s, 4))

    def checkpoint_first(self, reason: str) -> None:
        """Before a planned change: ask the workers for a checkpoint and wait until every local one has saved it.

        Only workers that announced the protocol (``hello``) are asked; any others are stopped at once, as torch
        would. A peer node may have asked already (its request reaches every rank): then the answer is here.
        """
        if not self.reports.all_saved():
            if not self.reports.all_capable():
                return
            pcontext = self._pcontext
            pids = list(pcontext.pids().values()) if pcontext is not None else []
            self._log.info("checkpoint_requested", reason=reason, pids=pids)
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGUSR2)
            deadline = self._clock() + self._checkpoint_timeout_s
            while not self.reports.all_saved() and self._clock() < deadline:
                if group_state(self._monitor_workers(self._worker_group).state) is not GroupState.HEALTHY:
                    break
                time.sleep(0.05)
        step = self.reports.saved_step()
        fenced = self.reports.saved_but_fenced()
        if fenced is not None:
            # not a success: the restart resumes from the last committed checkpoint and redoes the steps since
            self._log.warning("checkpoint_request_fenced", reason=reason, step=fenced)
        elif step is None:
            self._log.warning("checkpoint_request_unanswered", reason=reason, timeout_s=self._checkpoint_timeout_s)
        else:
            self._log.info("checkpoint_saved", reason=reason, step=step)
        self.reports.clear_saved()

    def _poll(self, read: Callable[[], T], fallback: T) -> T:
        """An etcd read of the loop; while etcd is away the workers train on and we look again next time."""
        try:
            return read()
        except (EtcdError, RendezvousConnectionError) as exc:
            now = self._clock()
            if now - self._etcd_warned >= _ETCD_WARN_INTERVAL_S:
                self._etcd_warned = now
                self._log.warning("etcd_unavailable", error=str(exc) or type(exc).__name__)
            return fallback
