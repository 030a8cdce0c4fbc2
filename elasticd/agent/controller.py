"""The supervisor's loop as a state machine you can step: each :meth:`Controller.step` observes, decides, acts once.

``supervisor.py`` calls :meth:`Controller.step` every monitor interval until it returns the run's result. Everything
a step reads or does goes through :class:`Node`, the adapter that ``ElasticdAgent`` implements over torch's
``LocalElasticAgent`` (start, monitor, stop, restart the workers), the rendezvous, the worker reports and etcd; the
decision itself is :class:`~elasticd.agent.policy.SupervisorPolicy`'s. A test steps a controller over a scripted node
and a fake clock, with no process, no etcd and no torch (after Ray Train v2's controller, which steps over injected
worker groups and a failure policy).

The node's state (:class:`NodeState`) is what the registry shows: running, joining (hot: warm workers wait to be
admitted in place), reforming (hot: the workers re-form their group in place), restarting (cold: stopped, through
the rendezvous again), and the ends: finished, draining, failed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from enum import StrEnum
from pathlib import Path
from typing import Any, Protocol

from torch.distributed.elastic.agent.server.api import RunResult, WorkerState

from elasticd.agent.policy import Action, Decision, GroupState, HangReport, Observation, SupervisorPolicy
from elasticd.board import Phase
from elasticd.errors import EXIT_REJOIN

# Seconds between reads of the run's drain request, the lineage and the peers' hang claims; each read is an etcd get.
CONTROL_POLL_S = 1.0
# Seconds between straggler checks, which also publish this node's per-rank own times and read the other nodes'.
STRAGGLER_POLL_S = 2.0


class NodeState(StrEnum):
    """The node as its registry record shows it."""

    RUNNING = "running"
    JOINING = "joining"  # hot: the workers are imported and prepared, waiting to be admitted to the group in place
    REFORMING = "reforming"  # hot: the workers re-form their group in place (a peer lost or hung, a join, a leave)
    RESTARTING = "restarting"  # cold: the workers are stopped and start again after the next rendezvous
    FINISHED = "finished"
    DRAINING = "draining"
    FAILED = "failed"


class Node(Protocol):
    """What one step of the loop reads and does: the adapter over torch's agent, the rendezvous and etcd.

    Reads of etcd answer their fallback while etcd is away (the workers train on; the next step looks again)."""

    # -- observe --
    def monitor(self) -> RunResult: ...  # the local workers' state (torch's _monitor_workers); recorded on the group
    def hang_suspicion(self) -> Any | None: ...  # a local worker silent beyond its allowance (the watchdog)
    def drain_requested(self) -> bool: ...  # `elasticd stop` asked the whole run to stop
    def lineage_lost(self) -> bool: ...  # the workers' fencing token is no longer the run's
    def waiting_to_join(self) -> bool: ...  # this node's workers wait to be admitted to a group in place
    def peer_hang_claim(self) -> str | None: ...  # the name of a hang another node claimed in this round
    def diagnose_hang(self, suspicion: Any | None) -> HangReport | None: ...  # agree on a hang with the others
    def workers_exiting(self) -> bool: ...  # an exception escaped a worker: a failure about to be reported
    def nodes_waiting(self) -> int: ...  # nodes queued for the next round
    def fatal(self) -> tuple[str, int] | None: ...  # (message, exit code) of a worker that must stop for good
    def restarts_left(self) -> int: ...
    def all_saved(self) -> bool: ...  # every local worker saved the checkpoint a node asked for
    def all_in_place(self) -> bool: ...  # every local worker armed hot recovery
    def resize_needed(self, state: GroupState, failures: dict[int, Any]) -> bool: ...
    def worker_phases(self) -> Sequence[Phase]: ...  # where each local worker is, as its board slot says
    @property
    def node_id(self) -> str: ...

    leave_requested: bool  # SIGTERM: this node leaves, the others go on

    # -- act --
    def set_graceful(self, graceful: bool) -> None: ...  # may a signal wait for a clean leave now
    def publish_state(self, state: NodeState) -> None: ...  # the registry record's state
    def check_stragglers(self, now: float) -> None: ...
    def leave_hang_to_culprits(self, hang: HangReport) -> None: ...  # excuse the watchdog meanwhile, say so
    def log_failures(self, result: RunResult) -> None: ...
    def leave_in_place(self) -> bool: ...  # hot: this node's workers left the group at a step boundary
    def checkpoint_first(self, reason: str) -> None: ...  # ask the workers for a checkpoint and wait for it
    def tell_group_of_hang(self, hang: HangReport) -> None: ...
    def kill_workers(self) -> None: ...  # SIGKILL: hung or stopped processes ignore the polite signals
    def restart(self, decision: Decision, nodes_waiting: int) -> None: ...  # stop, rendezvous, start again
    def finish(self) -> None: ...  # wait for the other nodes at torch's exit barrier
    def drain(self, *, leave: bool) -> RunResult: ...  # stop the workers: the run (or this node) ends cleanly
    def give_up(self, decision: Decision, exit_code: int, result: RunResult) -> RunResult: ...  # stop, exit non-zero


class Controller:
    """One node's supervisor loop, one :meth:`step` at a time."""

    def __init__(
        self,
        node: Node,
        policy: SupervisorPolicy | None = None,
        clock: Callable[[], float] = time.monotonic,
        *,
        control_poll_s: float = CONTROL_POLL_S,
        straggler_poll_s: float = STRAGGLER_POLL_S,
    ) -> None:
        self.node = node
        self.policy = policy or SupervisorPolicy()
        self.clock = clock
        self.control_poll_s = control_poll_s
        self.straggler_poll_s = straggler_poll_s
        self.state = NodeState.RUNNING
        self.drain = False  # a drain request, once seen, holds
        self.handled_hangs: set[str] = set()  # hangs (claim names) this node acted on: never twice
        self._next_control_poll = self._next_straggler_poll = 0.0

    def step(self) -> RunResult | None:
        """One turn of the loop: None to go on (the caller waits a monitor interval), or the run's result."""
        node = self.node
        node.set_graceful(True)
        result = node.monitor()
        now = self.clock()
        state = group_state(result.state)
        suspicion = node.hang_suspicion() if state is GroupState.HEALTHY else None
        peer_hang = lineage_lost = False
        if now >= self._next_control_poll:
            self.drain = self.drain or node.drain_requested()
            lineage_lost = state is GroupState.HEALTHY and node.lineage_lost()
            # a node still waiting to join in place has no part in the group's hangs; a hang handled once is done
            if state is GroupState.HEALTHY and not node.waiting_to_join():
                claim = node.peer_hang_claim()
                peer_hang = claim is not None and claim not in self.handled_hangs
            self._next_control_poll = now + self.control_poll_s
        if now >= self._next_straggler_poll and state is GroupState.HEALTHY:
            node.check_stragglers(now)
            self._next_straggler_poll = now + self.straggler_poll_s
        hang = node.diagnose_hang(suspicion) if suspicion is not None or peer_hang else None
        if hang is not None and hang.path:
            self.handled_hangs.add(Path(hang.path).name)
        if hang is not None and hang.attempt == 0:
            # not a counted hang (a lost node, an evicted one): a worker that exited meanwhile is a failure
            again = node.monitor()
            if group_state(again.state) is GroupState.FAILED:
                result, state, hang = again, GroupState.FAILED, None
        # a worker on its way out (an exception escaped) is a failure about to be reported: no join first
        failing = state is GroupState.HEALTHY and node.workers_exiting()
        waiting = node.nodes_waiting() if state is GroupState.HEALTHY and not failing else 0
        fatal = node.fatal()
        decision = self.policy.decide(
            Observation(
                state,
                waiting,
                drain_requested=self.drain,
                leave_requested=node.leave_requested,
                restarts_left=node.restarts_left(),
                peer_checkpointed=state is GroupState.HEALTHY and node.all_saved(),
                fatal_message=fatal[0] if fatal else "",
                hang=hang,
                lineage_lost=lineage_lost,
                resize=node.resize_needed(state, result.failures),
                hang_elsewhere=hang is not None
                and bool(hang.culprit_nodes)
                and node.node_id not in hang.culprit_nodes
                and node.all_in_place(),
                rejoin=bool(result.failures) and all(f.exitcode == EXIT_REJOIN for f in result.failures.values()),
            )
        )
        if decision.action is Action.CONTINUE:
            if decision.reason == "hang_in_place" and hang is not None:
                node.leave_hang_to_culprits(hang)
            self._show(self._running_state(state))
            return None
        return self._act(decision, result, state, hang, waiting, fatal)

    def _act(
        self,
        decision: Decision,
        result: RunResult,
        state: GroupState,
        hang: HangReport | None,
        waiting: int,
        fatal: tuple[str, int] | None,
    ) -> RunResult | None:
        node = self.node
        node.set_graceful(decision.planned)  # a second signal while we act ends the daemon at once
        if state is GroupState.FAILED:
            node.log_failures(result)
        left_in_place = decision.action is Action.LEAVE and node.leave_in_place()
        if decision.planned and state is GroupState.HEALTHY and not left_in_place:
            node.checkpoint_first(decision.reason)
        if hang is not None:
            node.tell_group_of_hang(hang)
            node.kill_workers()
        if decision.action is Action.RESTART:
            self._show(NodeState.RESTARTING)
            node.restart(decision, waiting)
            self.state = NodeState.RUNNING  # the rendezvous and the new workers publish their own states
            return None
        if decision.action is Action.FINISH:
            self._show(NodeState.FINISHED)
            node.finish()
            return result
        if decision.action in (Action.DRAIN, Action.LEAVE):
            self._show(NodeState.DRAINING)
            return node.drain(leave=decision.action is Action.LEAVE)
        self._show(NodeState.FAILED)
        return node.give_up(decision, fatal[1] if fatal else 1, result)

    def _running_state(self, state: GroupState) -> NodeState:
        if state is not GroupState.HEALTHY:
            return self.state
        phases = self.node.worker_phases()
        if Phase.JOINING in phases:
            return NodeState.JOINING
        if Phase.LOADING in phases and self.node.all_in_place():
            return NodeState.REFORMING  # armed workers load only to re-form or heal in place
        return NodeState.RUNNING

    def _show(self, state: NodeState) -> None:
        if state is not self.state:
            self.state = state
            self.node.publish_state(state)


def group_state(state: WorkerState) -> GroupState:
    """torch's worker state, reduced to what the policy distinguishes."""
    if state is WorkerState.SUCCEEDED:
        return GroupState.SUCCEEDED
    if state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
        return GroupState.FAILED
    return GroupState.HEALTHY
