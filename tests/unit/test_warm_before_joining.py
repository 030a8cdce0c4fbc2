"""A node that comes while others train imports before it enters the rendezvous; at a job's start nobody waits
(agent/daemon.py's ``_warm_before_joining``; the joins it changes: tests/integration/test_daemon_faults.py)."""

from __future__ import annotations

from typing import Any

import pytest

from elasticd.agent.daemon import _warm_before_joining
from elasticd.etcd.client import EtcdError


class _Warm:
    def __init__(self, usable: bool = True) -> None:
        self.started = self.waited = 0
        self.usable = usable

    def start(self) -> None:
        self.started += 1

    def wait_ready(self) -> bool:
        self.waited += 1
        return self.usable


class _Log:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def info(self, event: str, **fields: Any) -> None:
        self.events.append((event, fields))


def _peers(*states: str) -> list[dict[str, Any]]:
    return [{"node_id": "me", "state": "starting"}] + [
        {"node_id": f"n{i}", "state": state} for i, state in enumerate(states)
    ]


def test_a_node_joining_running_peers_starts_its_warm_server_and_waits_for_it() -> None:
    warm, log = _Warm(), _Log()
    _warm_before_joining(warm, lambda: _peers("running", "running", "starting"), "me", log)  # type: ignore[arg-type]
    assert (warm.started, warm.waited) == (1, 1)
    ((event, fields),) = log.events
    assert event == "warm_before_joining" and fields["running_nodes"] == 2 and fields["usable"] is True


@pytest.mark.parametrize(
    ("peers", "why"),
    [
        (lambda: _peers("starting", "starting"), "a job's start: every node keeps the usual order"),
        (lambda: [{"node_id": "me", "state": "running"}], "only this node's own record"),
        (lambda: _peers("finished", "draining"), "nobody trains"),
    ],
)
def test_nobody_waits_when(peers: Any, why: str) -> None:
    warm, log = _Warm(), _Log()
    _warm_before_joining(warm, peers, "me", log)  # type: ignore[arg-type]
    assert (warm.started, warm.waited, log.events) == (0, 0, []), why


def test_an_etcd_that_does_not_answer_or_no_warm_starts_leave_the_order_as_it_was() -> None:
    def away() -> list[dict[str, Any]]:
        raise EtcdError("get_prefix", "127.0.0.1:2379", "UNAVAILABLE", "etcd away")

    warm, log = _Warm(), _Log()
    _warm_before_joining(warm, away, "me", log)  # type: ignore[arg-type]
    _warm_before_joining(None, lambda: _peers("running"), "me", log)
    assert (warm.started, log.events) == (0, [])
