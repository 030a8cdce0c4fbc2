"""The supervisor's loop as a state machine you can step: each :meth:`Controller.step` observes, decides, acts once.

``supervisor.py`` calls :meth:`Controller.step` every monitor interval until it returns the node's
:class:`Outcome`. A step reads and acts only through four small ports: :class:`Workers` (the local worker group:
``agent/group.py`` over torch's agent), :class:`Reports` (what the workers said: ``agent/reports.py``),
:class:`RunView` (the run around this node: etcd, the rendezvous, the registry: ``agent/run_view.py``) and
:class:`Hangs` (``agent/node_hangs.py``), plus the :class:`Signals` the daemon's signal handler sets. The decision
itself is :class:`~elasticd.agent.policy.SupervisorPolicy`'s. A test steps a controller over small fakes of the
ports and a fake clock, with no process, no etcd and no torch (after Ray Train v2's controller, which steps over
injected worker groups and a failure policy).

The node's state (:class:`NodeState`) is what the registry shows: running, joining (hot: warm workers wait to be
admitted in place), reforming (hot: the workers re-form their group in place), restarting (cold: stopped, through
the rendezvous again), and the terminal ones, with which the loop ends: finished, draining, failed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, Protocol

from torch.distributed.elastic.agent.server.api import RunResult, WorkerState

from elasticd.agent.policy import Action, Decision, GroupState, HangReport, Observation, SupervisorPolicy
from elasticd.agent.reports import Fatal
from elasticd.board import Phase
from elasticd.errors import EXIT_GAVE_UP, EXIT_OK, EXIT_REJOIN

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

    @property
    def terminal(self) -> bool:
        """The loop ends in this state: nothing restarts from it."""
        return self in (NodeState.FINISHED, NodeState.DRAINING, NodeState.FAILED)


@dataclass
class Outcome(RunResult):
    """How this node's run ended: torch's ``RunResult`` (its ``run()`` records an event per worker from it) and what
    the daemon makes of it: the terminal state, the exit code, the message, and whether only this node leaves."""

    node_state: NodeState = NodeState.FINISHED
    exit_code: int = EXIT_OK
    message: str = ""
    leaves: bool = False  # this node alone leaves (SIGTERM): the others go on in a new round

    @classmethod
    def of(cls, result: RunResult, node_state: NodeState, **end: Any) -> Outcome:
        assert node_state.terminal, node_state
        return cls(result.state, result.return_values, result.failures, node_state, **end)


class Signals:
    """What the daemon's SIGTERM/SIGINT handler and the loop tell each other (both on the main thread)."""

    def __init__(self) -> None:
        self.leave_requested = False  # SIGTERM: this node leaves, the others go on
        self.graceful = False  # workers run under the loop: a signal can wait for a clean leave


class Workers(Protocol):
    """The local worker group: start, watch and stop it (torch's agent underneath)."""

    def monitor(self) -> RunResult: ...  # the local workers' state (torch's _monitor_workers); recorded on the group
    def restarts_left(self) -> int: ...
    def log_failures(self, result: RunResult) -> None: ...
    def checkpoint_first(self, reason: str) -> None: ...  # ask the workers for a checkpoint and wait for it
    def leave_in_place(self) -> bool: ...  # hot: this node's workers left the group at a step boundary
    def kill(self) -> None: ...  # SIGKILL: hung or stopped processes ignore the polite signals
    def restart(self, decision: Decision, nodes_waiting: int) -> None: ...  # stop, rendezvous, start again
    def finish(self) -> None: ...  # wait for the other nodes at torch's exit barrier
    def drain(self, *, leave: bool) -> RunResult: ...  # stop the workers: the run (or this node) ends cleanly
    def give_up(self, decision: Decision, result: RunResult) -> RunResult: ...  # stop the workers for good


class Reports(Protocol):
    """What the local workers said through their beats."""

    @property
    def fatal(self) -> Fatal | None: ...  # a worker that must stop for good, and its exit code
    def all_saved(self) -> bool: ...  # every local worker saved the checkpoint a node asked for
    def all_in_place(self) -> bool: ...  # every local worker armed hot recovery


class RunView(Protocol):
    """The run around this node. Reads of etcd answer their fallback while etcd is away (the workers train on; the
    next step looks again)."""

    @property
    def node_id(self) -> str: ...
    def drain_requested(self) -> bool: ...  # `elasticd stop` asked the whole run to stop
    def lineage_lost(self) -> bool: ...  # the workers' fencing token is no longer the run's
    def waiting_to_join(self) -> bool: ...  # this node's workers wait to be admitted to a group in place
    def nodes_waiting(self) -> int: ...  # nodes queued for the next round
    def resize_needed(self, state: GroupState, failures: dict[int, Any]) -> bool: ...
    def check_stragglers(self, now: float) -> None: ...
    def publish_state(self, state: NodeState) -> None: ...  # the registry record's state


class Hangs(Protocol):
    """Hangs on this node and the others': the watchdog, the board, the agreement through etcd."""

    def suspicion(self) -> Any | None: ...  # a local worker silent beyond its allowance (the watchdog)
    def peer_claim(self) -> str | None: ...  # the name of a hang another node claimed in this round
    def diagnose(self, suspicion: Any | None) -> HangReport | None: ...  # agree on a hang with the others
    def exiting(self) -> bool: ...  # an exception escaped a worker: a failure about to be reported
    def phases(self) -> Sequence[Phase]: ...  # where each local worker is, as its board slot says
    def leave_to_culprits(self, hang: HangReport) -> None: ...  # excuse the watchdog meanwhile, say so
    def tell_group(self, hang: HangReport) -> None: ...  # a culprit here: the group hears before the kill


class Controller:
    """One node's supervisor loop, one :meth:`step` at a time."""

    def __init__(
        self,
        *,
        workers: Workers,
        reports: Reports,
        run: RunView,
        hangs: Hangs,
        signals: Signals,
        policy: SupervisorPolicy | None = None,
        clock: Callable[[], float] = time.monotonic,
        control_poll_s: float = CONTROL_POLL_S,
        straggler_poll_s: float = STRAGGLER_POLL_S,
    ) -> None:
        self.workers = workers
        self.reports = reports
        self.run = run
        self.hangs = hangs
        self.signals = signals
        self.policy = policy or SupervisorPolicy()
        self.clock = clock
        self.control_poll_s = control_poll_s
        self.straggler_poll_s = straggler_poll_s
        self.state = NodeState.RUNNING
        self.drain = False  # a drain request, once seen, holds
        self.handled_hangs: set[str] = set()  # hangs (claim names) this node acted on: never twice
        self._next_control_poll = self._next_straggler_poll = 0.0

    def step(self) -> Outcome | None:
        """One turn of the loop: None to go on (the caller waits a monitor interval), or how the node's run ended."""
        workers, reports, run, hangs = self.workers, self.reports, self.run, self.hangs
        self.signals.graceful = True
        result = workers.monitor()
        now = self.clock()
        state = group_state(result.state)
        suspicion = hangs.suspicion() if state is GroupState.HEALTHY else None
        peer_hang = lineage_lost = False
        if now >= self._next_control_poll:
            self.drain = self.drain or run.drain_requested()
            lineage_lost = state is GroupState.HEALTHY and run.lineage_lost()
            # a node still waiting to join in place has no part in the group's hangs; a hang handled once is done
            if state is GroupState.HEALTHY and not run.waiting_to_join():
                claim = hangs.peer_claim()
                peer_hang = claim is not None and claim not in self.handled_hangs
            self._next_control_poll = now + self.control_poll_s
        if now >= self._next_straggler_poll and state is GroupState.HEALTHY:
            run.check_stragglers(now)
            self._next_straggler_poll = now + self.straggler_poll_s
        hang = hangs.diagnose(suspicion) if suspicion is not None or peer_hang else None
        if hang is not None and hang.path:
            self.handled_hangs.add(Path(hang.path).name)
        if hang is not None and hang.attempt == 0:
            # not a counted hang (a lost node, an evicted one): a worker that exited meanwhile is a failure
            again = workers.monitor()
            if group_state(again.state) is GroupState.FAILED:
                result, state, hang = again, GroupState.FAILED, None
        # a worker on its way out (an exception escaped) is a failure about to be reported: no join first
        failing = state is GroupState.HEALTHY and hangs.exiting()
        waiting = run.nodes_waiting() if state is GroupState.HEALTHY and not failing else 0
        peer_checkpointed = state is GroupState.HEALTHY and reports.all_saved()
        if peer_checkpointed and not self.drain:
            # A checkpoint another node asked for begins a drain as well as a join: read the drain request now, not
            # at the next control poll, or a drain seen a poll late restarts the workers as for a join and the node
            # leaves between rounds without its drain (seen in the suite: `elasticd stop` while training in place).
            self.drain = run.drain_requested()
        fatal = reports.fatal
        decision = self.policy.decide(
            Observation(
                state,
                waiting,
                drain_requested=self.drain,
                leave_requested=self.signals.leave_requested,
                restarts_left=workers.restarts_left(),
                peer_checkpointed=peer_checkpointed,
                fatal_message=fatal.message if fatal else "",
                hang=hang,
                lineage_lost=lineage_lost,
                resize=run.resize_needed(state, result.failures),
                hang_elsewhere=hang is not None
                and bool(hang.culprit_nodes)
                and run.node_id not in hang.culprit_nodes
                and reports.all_in_place(),
                rejoin=bool(result.failures) and all(f.exitcode == EXIT_REJOIN for f in result.failures.values()),
            )
        )
        if decision.action is Action.CONTINUE:
            if decision.reason == "hang_in_place" and hang is not None:
                hangs.leave_to_culprits(hang)
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
        fatal: Fatal | None,
    ) -> Outcome | None:
        workers = self.workers
        self.signals.graceful = decision.planned  # a second signal while we act ends the daemon at once
        if state is GroupState.FAILED:
            workers.log_failures(result)
        left_in_place = decision.action is Action.LEAVE and workers.leave_in_place()
        if decision.planned and state is GroupState.HEALTHY and not left_in_place:
            workers.checkpoint_first(decision.reason)
        if hang is not None:
            self.hangs.tell_group(hang)
            workers.kill()
        if decision.action is Action.RESTART:
            self._show(NodeState.RESTARTING)
            workers.restart(decision, waiting)
            self.state = NodeState.RUNNING  # the rendezvous and the new workers publish their own states
            return None
        if decision.action is Action.FINISH:
            self._show(NodeState.FINISHED)
            workers.finish()
            return Outcome.of(result, NodeState.FINISHED)
        if decision.action in (Action.DRAIN, Action.LEAVE):
            self._show(NodeState.DRAINING)
            leave = decision.action is Action.LEAVE
            return Outcome.of(workers.drain(leave=leave), NodeState.DRAINING, leaves=leave)
        self._show(NodeState.FAILED)
        return Outcome.of(
            workers.give_up(decision, result),
            NodeState.FAILED,
            # a worker's own exit code when it stopped for good (0 would read as success: gave up, then)
            exit_code=fatal.exit_code if fatal and fatal.exit_code else EXIT_GAVE_UP,
            message=decision.message or "workers failed",
            leaves=True,  # the others go on without this node
        )

    def _running_state(self, state: GroupState) -> NodeState:
        if state is not GroupState.HEALTHY:
            return self.state
        phases = self.hangs.phases()
        if Phase.JOINING in phases:
            return NodeState.JOINING
        if Phase.LOADING in phases and self.reports.all_in_place():
            return NodeState.REFORMING  # armed workers load only to re-form or heal in place
        return NodeState.RUNNING

    def _show(self, state: NodeState) -> None:
        if state is not self.state:
            self.state = state
            self.run.publish_state(state)


def group_state(state: WorkerState) -> GroupState:
    """torch's worker state, reduced to what the policy distinguishes."""
    if state is WorkerState.SUCCEEDED:
        return GroupState.SUCCEEDED
    if state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
        return GroupState.FAILED
    return GroupState.HEALTHY
