"""The daemon's exit: the loop's :class:`Outcome`, read as a value, becomes the exit code and the rendezvous' fate.

Stepped over a fake agent (``run()`` answers the outcome) and a fake handler: no process, no etcd.
"""

from __future__ import annotations

from typing import Any, cast

import pytest
from torch.distributed.elastic.agent.server.api import WorkerState

from elasticd.agent.controller import NodeState, Outcome
from elasticd.agent.daemon import _run_agent
from elasticd.agent.supervisor import ElasticdAgent
from elasticd.errors import EXIT_OK
from elasticd.rendezvous.handler import ElasticdRendezvousHandler


class Log:
    def __init__(self) -> None:
        self.seen: list[tuple[str, dict[str, Any]]] = []

    def info(self, event: str, **fields: Any) -> None:
        self.seen.append((event, fields))

    warning = error = info


class Agent:
    def __init__(self, outcome: Outcome) -> None:
        self.outcome = outcome
        self.log = Log()

    def run(self) -> Outcome:
        return self.outcome


class Handler:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def leave(self) -> None:
        self.calls.append("leave")

    def shutdown(self) -> None:
        self.calls.append("shutdown")


@pytest.mark.parametrize(
    ("outcome", "code", "rendezvous", "exit_fields"),
    [
        (Outcome(WorkerState.SUCCEEDED), EXIT_OK, "shutdown", {"drained": False, "left": False}),
        (Outcome(WorkerState.SUCCEEDED, node_state=NodeState.DRAINING), EXIT_OK, "shutdown", {"drained": True}),
        (Outcome(WorkerState.SUCCEEDED, node_state=NodeState.DRAINING, leaves=True), EXIT_OK, "leave", {"left": True}),
        (
            Outcome(WorkerState.FAILED, node_state=NodeState.FAILED, exit_code=3, message="nan", leaves=True),
            3,
            "leave",
            {"message": "nan"},
        ),
    ],
    ids=["finished", "drained", "left", "gave-up"],
)
def test_the_outcome_sets_the_exit_code_and_whether_the_run_closes(
    outcome: Outcome, code: int, rendezvous: str, exit_fields: dict[str, Any]
) -> None:
    agent, handler = Agent(outcome), Handler()
    assert _run_agent(cast(ElasticdAgent, agent), cast(ElasticdRendezvousHandler, handler)) == code
    assert handler.calls == [rendezvous]
    event, fields = agent.log.seen[-1]
    assert event == "exit" and fields["code"] == code
    assert exit_fields.items() <= fields.items()
