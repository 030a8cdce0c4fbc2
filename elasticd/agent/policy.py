"""The supervisor's decisions, as a pure function of what it observed.

The supervisor loop (``supervisor.py``) gathers an :class:`Observation` every monitor interval and acts on the
:class:`Decision` that :meth:`SupervisorPolicy.decide` returns. Keeping the rules here, free of processes and etcd,
lets unit tests walk every branch (after Ray Train v2's ``FailurePolicy.make_decision``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class GroupState(StrEnum):
    """The local worker group as the monitor saw it (torch's ``WorkerState``, reduced)."""

    HEALTHY = "healthy"
    FAILED = "failed"  # a worker exited non-zero or died on a signal
    SUCCEEDED = "succeeded"  # every local worker exited 0


class Action(StrEnum):
    CONTINUE = "continue"
    RESTART = "restart"  # stop the group, re-rendezvous, start again
    FINISH = "finish"  # training done: wait for the other nodes, exit 0
    DRAIN = "drain"  # the whole run stops on request (elasticd stop): stop the group, close the run, exit 0
    LEAVE = "leave"  # this node leaves (SIGTERM): stop the group, leave the rendezvous, exit 0; the others go on
    STOP = "stop"  # give up: exit 1

    @property
    def terminal(self) -> bool:
        return self in (Action.FINISH, Action.DRAIN, Action.LEAVE, Action.STOP)


@dataclass(frozen=True, slots=True)
class HangReport:
    """A hang every node of the round agreed on (``agreement.py``)."""

    step: int  # the step that did not complete
    attempt: int  # hangs in a row at this step, this one included
    path: str  # its diagnostics directory
    culprits: tuple[int, ...] = ()
    culprit_nodes: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Observation:
    state: GroupState
    nodes_waiting: int = 0  # nodes queued for the next round (a join)
    drain_requested: bool = False
    leave_requested: bool = False
    restarts_left: int = 0
    # every local worker saved a checkpoint that some node asked for: a planned change is under way elsewhere
    peer_checkpointed: bool = False
    fatal_message: str = ""  # a worker reported it must stop for good (e.g. non-finite steps beyond --on-nan)
    hang: HangReport | None = None  # the workers made no progress within the hang timeout
    # the fencing token the workers hold is no longer the run's (etcd lost its data, or a newer group took over):
    # they could never commit again
    lineage_lost: bool = False
    # the round must re-form for its sizes (agent/spares.py): the workers exited because the node count does not split
    # the global batch, or a spare saw a member leave
    resize: bool = False
    # the workers waited to join a group in place that no longer trains that way: through the rendezvous instead
    rejoin: bool = False
    # the hang's culprits are on other nodes and this node's workers re-form in place once those are killed
    hang_elsewhere: bool = False


@dataclass(frozen=True, slots=True)
class Decision:
    action: Action
    reason: str = ""  # for RESTART: a label of elasticd_worker_restarts_total
    counts_as_restart: bool = False  # consumes one of --max-restarts
    message: str = ""
    planned: bool = False  # take a checkpoint first (joins and drains lose no completed step)


class SupervisorPolicy:
    """Failures and hangs restart the group while restarts last; joins restart it for free, after a checkpoint; a
    drain wins over all; a worker's fatal report stops the node; the same step hanging ``hang_attempts`` times in a
    row stops it too (a deterministic hang recurs after every restart)."""

    def __init__(self, hang_attempts: int = 3) -> None:
        self.hang_attempts = hang_attempts

    def decide(self, obs: Observation) -> Decision:
        if obs.state is GroupState.SUCCEEDED:
            return Decision(Action.FINISH)
        if obs.drain_requested:
            return Decision(Action.DRAIN, reason="drain", planned=True)
        if obs.leave_requested:
            return Decision(Action.LEAVE, reason="drain", planned=True)
        if obs.fatal_message:
            return Decision(Action.STOP, reason="fatal", message=obs.fatal_message)
        if obs.rejoin and obs.state is GroupState.FAILED:
            return Decision(Action.RESTART, reason="membership")
        if obs.resize:
            # arithmetic, not a fault: like a join, it never consumes --max-restarts
            return Decision(Action.RESTART, reason="membership", planned=obs.state is GroupState.HEALTHY)
        if obs.state is GroupState.FAILED:
            if obs.restarts_left > 0:
                return Decision(Action.RESTART, reason="failure", counts_as_restart=True)
            return Decision(
                Action.STOP,
                reason="failure",
                message="a worker failed and no restarts are left (raise --max-restarts to allow more)",
            )
        if obs.lineage_lost:
            # A new round re-establishes the run's keys and gives the workers a current token; like a membership
            # change it costs no restart, and no checkpoint first: it could not be committed.
            return Decision(Action.RESTART, reason="membership")
        if obs.hang is not None and obs.hang_elsewhere and obs.hang.attempt < self.hang_attempts:
            # the culprits' nodes kill them; this node's workers see their peers gone and re-form in place
            return Decision(Action.CONTINUE, reason="hang_in_place")
        if obs.hang is not None:
            hang = obs.hang
            if hang.attempt >= self.hang_attempts:
                return Decision(
                    Action.STOP,
                    reason="hang",
                    message=f"training hung at step {hang.step} {hang.attempt} times in a row; not restarting again"
                    f" (--hang-attempts {self.hang_attempts}). Diagnostics: {hang.path}",
                )
            if obs.restarts_left > 0:
                return Decision(Action.RESTART, reason="hang", counts_as_restart=True)
            return Decision(
                Action.STOP,
                reason="hang",
                message=f"training hung at step {hang.step} and no restarts are left. Diagnostics: {hang.path}",
            )
        if obs.nodes_waiting > 0 or obs.peer_checkpointed:
            # Torch's rule too: membership changes never consume --max-restarts.
            return Decision(Action.RESTART, reason="membership", planned=True)
        return Decision(Action.CONTINUE)
