"""A running job re-forms without sitting out the last call, and its waits end on etcd changes: our handler on a real
etcd, handlers of one process standing in for nodes (as in test_round_liveness.py).

The last call is set far longer than any of these tests may take, so a round that waited it would fail them by the
test timeout; the first round of a job must still wait it for a node that starts a moment late.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from torch.distributed.elastic.rendezvous import RendezvousInfo, RendezvousParameters
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousExitOp

from elasticd import envvars
from elasticd.endpoints import parse_endpoints
from elasticd.etcd.client import EtcdClient
from elasticd.etcd.server import EmbeddedEtcd
from elasticd.rendezvous import handler as rdzv
from elasticd.rendezvous.quorum import CLOSE_GRACE_S

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

LONG_LAST_CALL_S = 90  # longer than the joins may take: a round that waits it fails the test
# A node left out of every round gives up after this (torch raises RendezvousTimeoutError): the test fails instead
# of hanging on a thread that never returns.
JOIN_TIMEOUT_S = 40
# keep-alive intervals (1 s) before torch drops a silent node: longer than JOIN_TIMEOUT_S
HEARTBEAT_OUTLIVES_JOIN = 60


def _all(fns: list[Callable[[], Any]]) -> list[Any]:
    with ThreadPoolExecutor(len(fns)) as pool:
        return list(pool.map(lambda fn: fn(), fns))


@pytest.fixture
def make(etcd: EmbeddedEtcd, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> Iterator[Any]:
    """make(max_nodes, last_call_s) -> a handler (a node) of this test's run."""
    monkeypatch.setenv(envvars.TORCH_DISABLE_SHARED_STORE, "1")  # next_rendezvous sets it; restored after
    run_id = request.node.name[:40]
    made: list[rdzv.ElasticdRendezvousHandler] = []

    def handler(max_nodes: int, last_call_s: float, **conf: Any) -> rdzv.ElasticdRendezvousHandler:
        params = RendezvousParameters(
            "etcd-v3",
            etcd.endpoint,
            run_id,
            2,
            max_nodes,
            local_addr="127.0.0.1",
            last_call_timeout=last_call_s,
            join_timeout=JOIN_TIMEOUT_S,
            **conf,
        )
        made.append(rdzv.create_handler(params))
        return made[-1]

    yield handler
    for h in made:
        h._stop_heartbeats()


def _formed(infos: list[RendezvousInfo], size: int) -> None:
    assert sorted(i.rank for i in infos) == list(range(size)) and {i.world_size for i in infos} == {size}


def test_survivors_of_a_node_loss_reform_as_soon_as_its_keep_alive_expired(make: Any) -> None:
    nodes = [make(3, LONG_LAST_CALL_S) for _ in range(3)]
    _formed(_all([h.next_rendezvous for h in nodes]), 3)  # max_nodes reached: torch closes at once
    nodes[2]._stop_heartbeats()  # node 2 dies: no heartbeat, no write from now on
    survivors = nodes[:2]
    _formed(_all([h.next_rendezvous for h in survivors]), 2)  # would sit out 90 s without the early close
    assert sum(h.closed_early for h in survivors) >= 1
    assert all(h.round == nodes[0].round for h in survivors)
    # their waits ended on etcd changes (the other survivor's writes), not on whole-second polls alone
    assert sum(h.state_wakeup.woken["change"] for h in survivors) > 0


def _join_running_group(make: Any, slow_between_rounds_s: float = 0.0) -> list[rdzv.ElasticdRendezvousHandler]:
    """3 nodes train (max_nodes 5, so no round fills up and torch never closes one itself); a 4th joins and the
    group re-forms. The first round waits its short last call; the re-formation would wait the joiner's long one.
    ``slow_between_rounds_s``: one running node pauses that long between leaving the old round and joining the new
    one (a descheduled thread on a loaded host)."""
    running = [make(5, 2.0) for _ in range(3)]
    _formed(_all([h.next_rendezvous for h in running]), 3)
    assert sum(h.closed_early for h in running) == 0  # the first round of a job is not closed early
    if slow_between_rounds_s:
        executor = running[2]._op_executor

        class _PausesAfterLeaving:
            def run(self, state_handler: Any, deadline: float, update_deadline: Any = None) -> None:
                executor.run(state_handler, deadline, update_deadline)
                if isinstance(state_handler, _RendezvousExitOp):
                    time.sleep(slow_between_rounds_s)

        running[2]._op_executor = _PausesAfterLeaving()
    joiner = make(5, LONG_LAST_CALL_S)
    with ThreadPoolExecutor(1) as pool:
        joined = pool.submit(joiner.next_rendezvous)  # waits in the list for the next round
        deadline = time.monotonic() + 60
        while running[0].num_nodes_waiting() == 0:  # what the agents' monitor loop sees
            assert time.monotonic() < deadline, "the joiner never showed up as waiting"
            time.sleep(0.1)
        infos = _all([h.next_rendezvous for h in running])
        _formed([*infos, joined.result(timeout=60)], 4)
    return [*running, joiner]


def test_a_join_reforms_the_running_group_without_the_last_call(make: Any) -> None:
    nodes = _join_running_group(make)
    assert sum(h.closed_early for h in nodes) >= 1


def test_a_node_slow_between_two_rounds_is_not_left_out_of_the_new_one(make: Any) -> None:
    # For the pause it has no heartbeat in the state; a close in that moment would leave it waiting for a round
    # that never comes (here: the join timeout; in a daemon: one more re-formation). The grace covers it.
    nodes = _join_running_group(make, slow_between_rounds_s=CLOSE_GRACE_S / 2)
    assert sum(h.closed_early for h in nodes) >= 1


def test_the_first_round_of_a_job_waits_the_last_call_for_a_node_that_starts_late(make: Any) -> None:
    early = [make(3, 4.0) for _ in range(2)]
    late = make(3, 4.0)

    def join_late() -> RendezvousInfo:
        time.sleep(1.0)  # starts a second after the others: the 4 s last call is for it
        return late.next_rendezvous()

    infos = _all([early[0].next_rendezvous, early[1].next_rendezvous, join_late])
    _formed(infos, 3)
    assert sum(h.closed_early for h in [*early, late]) == 0


def test_survivors_do_not_wait_for_a_killed_nodes_heartbeat_to_expire_once_its_lease_is_gone(
    etcd: EmbeddedEtcd, make: Any
) -> None:
    # every node's rendezvous name on a lease of its own, as each daemon holds it on its node's liveness lease
    client = EtcdClient.connect(parse_endpoints(etcd.endpoint))
    leases: list[int] = []

    def node() -> rdzv.ElasticdRendezvousHandler:
        handler = make(3, LONG_LAST_CALL_S, keep_alive_max_attempt=HEARTBEAT_OUTLIVES_JOIN)
        leases.append(client.grant_lease(5))
        lease = leases[-1]
        handler.use_liveness_lease(lambda key, value: client.put(key, value, lease_id=lease))
        return handler

    try:
        nodes = [node() for _ in range(3)]
        _formed(_all([h.next_rendezvous for h in nodes]), 3)
        nodes[2]._stop_heartbeats()  # node 2 dies: no heartbeat from now on, and its lease ends with its daemon
        client.revoke_lease(leases[2])
        survivors = nodes[:2]
        # its heartbeat would hold round 1 for 60 s, past the survivors' join timeout (40 s): they would give up
        _formed(_all([h.next_rendezvous for h in survivors]), 2)
        removed = set().union(*(h._lapsed.removed for h in survivors if h._lapsed is not None))
        assert removed == {repr(nodes[2]._this_node)}
    finally:
        client.close()
