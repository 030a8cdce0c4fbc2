"""When a starting node joins the run's group in place instead of entering the rendezvous (real etcd, a real
liveness port): only a group whose round holds the fencing token, one of whose workers answers, with room for the
node, no node waiting in the rendezvous and no round-level spare."""

from __future__ import annotations

import json

import pytest

from elasticd.agent.joining import group_to_join
from elasticd.etcd.client import EtcdClient
from elasticd.group_record import GroupToJoin, group_alive, group_nodes
from elasticd.keys import RunKeys
from elasticd.liveness_probe import ProbeListener

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

KEYS = RunKeys("joining")
GROUP = "3.0123456789abcdef"


def _group(client: EtcdClient, listener: ProbeListener, *, token: str = "3.e2.feedface") -> None:
    client.put(KEYS.membership_group, json.dumps({"group": GROUP, "round": 3, "nodes": ["a", "b"]}))
    client.put(KEYS.lineage_token, token)
    client.put(KEYS.membership_member(f"{GROUP}.0"), json.dumps({"node": "a", "addr": f"127.0.0.1:{listener.port}"}))


def _find(client: EtcdClient, *, max_nodes: int = 3, waiting: int = 0) -> GroupToJoin | None:
    return group_to_join(client, KEYS, "c", max_nodes=max_nodes, nodes_waiting=waiting)


def test_a_live_group_with_room_is_joined_and_anything_else_goes_through_the_rendezvous(
    etcd_client: EtcdClient,
) -> None:
    assert _find(etcd_client) is None  # no group trains in place
    listener = ProbeListener("127.0.0.1")
    try:
        _group(etcd_client, listener)
        assert _find(etcd_client) == GroupToJoin(GROUP, 3, ("a", "b"))
        assert group_nodes(etcd_client, KEYS) == ["a", "b"]
        assert _find(etcd_client, waiting=1) is None  # a node waits: a new round comes anyway
        assert _find(etcd_client, max_nodes=2) is None  # no room
        spare = {"node_id": "b", "round": 3, "state": "spare"}
        etcd_client.put(f"{KEYS.nodes_prefix}b", json.dumps(spare))
        assert _find(etcd_client) is None  # only a new round lets a round-level spare train
        etcd_client.delete(f"{KEYS.nodes_prefix}b")
        etcd_client.put(KEYS.lineage_token, "4.0000000000000000")
        assert _find(etcd_client) is None  # the run restarted cold since: round 4 holds the token
        etcd_client.put(KEYS.lineage_token, "3.e2.feedface")
        assert group_alive(etcd_client, KEYS, GROUP, 3)
    finally:
        listener.close()
    assert not group_alive(etcd_client, KEYS, GROUP, 3)  # its workers are gone: the port refuses
    assert _find(etcd_client) is None
