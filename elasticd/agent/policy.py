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
    DRAIN = "drain"  # stop the group on request and exit 0
    STOP = "stop"  # give up: exit 1

    @property
    def terminal(self) -> bool:
        return self in (Action.FINISH, Action.DRAIN, Action.STOP)


@dataclass(frozen=True, slots=True)
class Observation:
    state: GroupState
    nodes_waiting: int = 0  # nodes queued for the next round (a join)
    drain_requested: bool = False
    restarts_left: int = 0


@dataclass(frozen=True, slots=True)
class Decision:
    action: Action
    reason: str = ""  # for RESTART: a label of elasticd_worker_restarts_total
    counts_as_restart: bool = False  # consumes one of --max-restarts
    message: str = ""


class SupervisorPolicy:
    """Failures restart the group while restarts last; joins restart it for free; a drain wins over both."""

    def decide(self, obs: Observation) -> Decision:
        if obs.state is GroupState.SUCCEEDED:
            return Decision(Action.FINISH)
        if obs.drain_requested:
            return Decision(Action.DRAIN, reason="drain")
        if obs.state is GroupState.FAILED:
            if obs.restarts_left > 0:
                return Decision(Action.RESTART, reason="failure", counts_as_restart=True)
            return Decision(
                Action.STOP,
                reason="failure",
                message="a worker failed and no restarts are left (raise --max-restarts to allow more)",
            )
        if obs.nodes_waiting > 0:
            # Torch's rule too: membership changes never consume --max-restarts.
            return Decision(Action.RESTART, reason="membership")
        return Decision(Action.CONTINUE)
