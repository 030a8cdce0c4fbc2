"""When a starting node joins the run's group in place instead of entering the rendezvous (real etcd, a real
liveness port): only a group whose round holds the fencing token, one of whose workers answers, with room for the
node, no node waiting in the rendezvous and no round-level spare."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from elasticd.agent.joining import group_to_join
from elasticd.etcd.client import EtcdClient
from elasticd.group_record import GroupToJoin, Reach, group_alive, group_nodes, group_reach
from elasticd.keys import RunKeys
from elasticd.liveness_probe import ProbeListener
from tests.integration.test_hot_liveness import stop

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
    listener = ProbeListener("127.0.0.1", f"{GROUP}.0")
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


_MEMBER = """
import sys, time
from elasticd.liveness_probe import ProbeListener
from tests.integration.test_hot_liveness import stop
listener = ProbeListener("127.0.0.1", sys.argv[1])
print(listener.port, flush=True)
time.sleep(120)
"""


def test_a_member_s_port_taken_by_another_process_is_not_the_member(etcd_client: EtcdClient) -> None:
    """A worker's port freed and bound again by another worker's listener (a joiner's): its greeting names another
    member, so the group is gone, not alive (two nodes once each waited to join such a group until a timeout)."""
    other = ProbeListener("127.0.0.1", "join-c-0123abcd.0")
    try:
        _group(etcd_client, other)  # the record of member GROUP.0 names the port the joiner's listener holds now
        assert group_reach(etcd_client, KEYS, GROUP, 3) is Reach.GONE
        assert _find(etcd_client) is None
    finally:
        other.close()


def test_a_group_whose_member_is_stopped_is_silent_and_joined_for_its_workers_to_judge(etcd_client: EtcdClient) -> None:
    """A stopped member (SIGSTOP: the kernel still accepts) never greets: the group is SILENT, joined in place all the
    same (a member starved of CPU for a moment looks alike); its joiner gives up if the silence lasts
    (tests/unit/test_join_watch.py)."""
    proc = subprocess.Popen([sys.executable, "-c", _MEMBER, f"{GROUP}.0"], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        etcd_client.put(KEYS.membership_group, json.dumps({"group": GROUP, "round": 3, "nodes": ["a", "b"]}))
        etcd_client.put(KEYS.lineage_token, "3.e2.feedface")
        etcd_client.put(KEYS.membership_member(f"{GROUP}.0"), json.dumps({"node": "a", "addr": f"127.0.0.1:{port}"}))
        assert group_reach(etcd_client, KEYS, GROUP, 3) is Reach.ALIVE
        stop(proc.pid)
        assert group_reach(etcd_client, KEYS, GROUP, 3) is Reach.SILENT
        assert _find(etcd_client) == GroupToJoin(GROUP, 3, ("a", "b"))
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    assert group_reach(etcd_client, KEYS, GROUP, 3) is Reach.GONE
