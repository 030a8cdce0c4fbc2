"""The lease rendezvous (rendezvous/lease_handler.py) on a real etcd: handlers of one process stand in for nodes, each
with a liveness lease of its own (agent/node_lease.py), as a daemon holds one.

The last call is far longer than these tests may take wherever a round must not wait for it, so one that did fails
them by the test timeout.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from torch.distributed.elastic.rendezvous import RendezvousClosedError, RendezvousParameters

from elasticd.agent.node_lease import NodeLease
from elasticd.endpoints import parse_endpoints
from elasticd.etcd.client import EtcdClient
from elasticd.etcd.server import EmbeddedEtcd
from elasticd.keys import RunKeys
from elasticd.rendezvous.lease_handler import LeaseRendezvousHandler, create_lease_handler

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

LONG_LAST_CALL_S = 90
JOIN_TIMEOUT_S = 40


class Node:
    def __init__(self, handler: LeaseRendezvousHandler, lease: NodeLease) -> None:
        self.handler, self.lease = handler, lease

    def kill(self) -> None:
        """As kill -9: the lease is no longer refreshed (its keys vanish about a second later), nothing is said."""
        self.lease._stop.set()
        self.handler.stop()


@pytest.fixture
def make(etcd: EmbeddedEtcd, request: pytest.FixtureRequest) -> Iterator[Callable[..., Node]]:
    run_id = request.node.name[:40]
    made: list[Node] = []

    def node(min_nodes: int, max_nodes: int, last_call_s: float = LONG_LAST_CALL_S) -> Node:
        # as a daemon: the lease on a connection of its own (closed with it), the handler on another
        endpoints = parse_endpoints(etcd.endpoint)
        client = EtcdClient.connect(endpoints, connect_timeout_s=10)
        lease = NodeLease(EtcdClient.connect(endpoints, connect_timeout_s=10), RunKeys(run_id), f"node{len(made)}")
        lease.start()
        params = RendezvousParameters(
            "etcd-v3",
            etcd.endpoint,
            run_id,
            min_nodes,
            max_nodes,
            local_addr="127.0.0.1",
            last_call_timeout=last_call_s,
            join_timeout=JOIN_TIMEOUT_S,
        )
        made.append(Node(create_lease_handler(params, lease, client), lease))
        return made[-1]

    yield node
    for n in made:
        n.handler.stop()
        n.lease.close()


def _all(fns: list[Callable[[], Any]]) -> list[Any]:
    with ThreadPoolExecutor(len(fns)) as pool:
        return list(pool.map(lambda fn: fn(), fns))


def _form(nodes: list[Node]) -> list[tuple[int, int, int | None]]:
    infos = _all([n.handler.next_rendezvous for n in nodes])
    return [(info.rank, info.world_size, n.handler.round) for info, n in zip(infos, nodes, strict=True)]


def test_nodes_form_one_round_with_distinct_ranks_and_one_store_address(make: Callable[..., Node]) -> None:
    nodes = [make(3, 3) for _ in range(3)]
    infos = _all([n.handler.next_rendezvous for n in nodes])
    assert sorted(i.rank for i in infos) == [0, 1, 2]
    assert {i.world_size for i in infos} == {3}
    assert {n.handler.round for n in nodes} == {0}
    assert len({(i.bootstrap_store_info.master_addr, i.bootstrap_store_info.master_port) for i in infos}) == 1
    assert all(n.handler.num_nodes_waiting() == 0 for n in nodes)


def test_a_job_below_max_nodes_forms_after_the_last_call(make: Callable[..., Node]) -> None:
    nodes = [make(2, 4, last_call_s=1.0) for _ in range(2)]
    begun = time.monotonic()
    assert sorted(_form(nodes)) == [(0, 2, 0), (1, 2, 0)]
    assert time.monotonic() - begun >= 1.0  # the first round of a job waits the last call for nodes still starting
    assert {n.handler.formed_by for n in nodes} - {""} == {"last_call"}


def test_survivors_re_form_without_the_last_call_once_a_dead_node_lease_is_gone(make: Callable[..., Node]) -> None:
    nodes = [make(2, 3, last_call_s=LONG_LAST_CALL_S) for _ in range(3)]
    _form(nodes)
    nodes[2].kill()
    survivors = nodes[:2]
    assert sorted(_form(survivors)) == [(0, 2, 1), (1, 2, 1)]
    assert sum(n.handler.closed_early for n in survivors) == 1


def test_a_late_node_waits_and_the_members_re_form_with_it(make: Callable[..., Node]) -> None:
    first = [make(2, 4, last_call_s=0.5) for _ in range(2)]  # max 4: three in is not max_nodes
    _form(first)
    for n in first:  # from now on no round may close by the last call: a busy host must not let it win the race
        n.handler._last_call_s = LONG_LAST_CALL_S
    late = make(2, 4)  # its round is a re-forming one: it closes once everyone is in, not after a last call
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(late.handler.next_rendezvous)
        deadline = time.monotonic() + 10
        while not all(n.handler.num_nodes_waiting() >= 1 for n in first) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(n.handler.num_nodes_waiting() >= 1 for n in first)
        members = _all([n.handler.next_rendezvous for n in first])
        info = waiting.result(timeout=30)
    assert sorted([info.rank] + [m.rank for m in members]) == [0, 1, 2]
    assert {info.world_size} | {m.world_size for m in members} == {3}
    assert late.handler.round == 1
    assert sum(n.handler.closed_early for n in [*first, late]) == 1


def test_a_node_beyond_max_nodes_is_a_spare_and_does_not_stop_the_round(make: Callable[..., Node]) -> None:
    nodes = [make(2, 2) for _ in range(2)]
    _form(nodes)
    spare = make(2, 2)
    with ThreadPoolExecutor(1) as pool:
        pool.submit(spare.handler.next_rendezvous)
        time.sleep(1.5)
        assert [n.handler.num_nodes_waiting() for n in nodes] == [0, 0]
        nodes[1].kill()  # a member dies: the survivor re-forms with the spare
        info = nodes[0].handler.next_rendezvous()
    assert info.world_size == 2


def test_shutdown_closes_the_rendezvous_for_every_node(make: Callable[..., Node]) -> None:
    nodes = [make(2, 2) for _ in range(2)]
    _form(nodes)
    assert nodes[0].handler.shutdown()
    assert nodes[1].handler.is_closed()
    with pytest.raises(RendezvousClosedError):
        nodes[1].handler.next_rendezvous()


def test_a_round_forms_although_a_node_s_lease_lapsed_as_it_joined(make: Callable[..., Node]) -> None:
    # etcd forgot the lease (it expired while the node was descheduled, etcd restarted): the join's put names a lease
    # etcd no longer knows. The node lease's next tick grants a new one and puts the joined key on it.
    nodes = [make(2, 2) for _ in range(2)]
    lease = nodes[0].lease
    assert lease._lease is not None
    lease._current().revoke_lease(lease._lease)
    assert sorted(_form(nodes)) == [(0, 2, 0), (1, 2, 0)]
