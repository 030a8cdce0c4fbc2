"""One node id, one daemon: a second live daemon with the same ``--node-id`` is refused at once (exit 2, one line
naming the id), a restart after a daemon died takes the id over at once, and a holder on another machine is judged
by its lease (refreshed every second while it lives)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from elasticd.agent.registry import DEFAULT_TTL_S, Holder, HolderState, NodeRegistry
from elasticd.errors import NodeIdInUseError
from elasticd.etcd.client import EtcdClient
from elasticd.etcd.server import EmbeddedEtcd
from elasticd.keys import RunKeys
from tests.helpers import etcd_value
from tests.integration.cluster import EXAMPLE, Cluster, train_args

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

# A process that claims a node id the way the daemon does, says so, and waits to be killed.
CLAIMER = """
import sys, time
from elasticd.agent.registry import NodeRegistry
from elasticd.etcd.client import EtcdClient
from elasticd.endpoints import parse_endpoints
from elasticd.keys import RunKeys
client = EtcdClient.connect(parse_endpoints(sys.argv[1]), connect_timeout_s=30)
registry = NodeRegistry(client, RunKeys(sys.argv[2]), sys.argv[3])
registry.claim()
registry.start_keepalive()
print("claimed", flush=True)
time.sleep(600)
"""


def test_second_daemon_with_the_same_node_id_exits_2_naming_it_at_once(etcd: EmbeddedEtcd, tmp_path: Path) -> None:
    with Cluster(etcd.endpoint, tmp_path, run_id="dup", min_nodes=1, max_nodes=2, script_args=train_args(600)) as c:
        first = c.start("dup-a")
        first.wait_event("workers_started", timeout_s=90)
        started = time.monotonic()
        second = subprocess.run(
            [sys.executable, "-m", "elasticd", "start", *c.base_args, "--node-id", "dup-a", str(EXAMPLE)],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            env=dict(os.environ, OMP_NUM_THREADS="1"),
            timeout=60,
        )
        took = time.monotonic() - started
        print(f"second daemon refused {took:.2f}s after it started")
        lines = [line for line in second.stderr.splitlines() if line.strip() and not line.startswith("{")]
        assert second.returncode == 2, second.stderr
        assert lines == [lines[0]] and "node id 'dup-a' is held by a live daemon" in lines[0], second.stderr
        assert f"pid {first.proc.pid}" in lines[0]
        assert took < 5.0  # ~1-2 s on a loaded 2-core box: well below the 12 s a lease expiry would take
        assert first.proc.poll() is None  # the first one is untouched


def test_restart_after_the_holder_died_takes_the_node_id_over_at_once(
    etcd: EmbeddedEtcd, etcd_client: EtcdClient
) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", CLAIMER, etcd.endpoint, "restart", "node-r"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "claimed"
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=10)
        started = time.monotonic()
        registry = NodeRegistry(etcd_client, RunKeys("restart"), "node-r")
        registry.claim()
        took = time.monotonic() - started
        try:
            print(f"dead holder's record replaced in {took:.2f}s")
            assert took < DEFAULT_TTL_S / 2  # not a wait for the lease to expire
            owner = json.loads(etcd_value(etcd_client, RunKeys("restart").node("node-r")))
            assert owner["pid"] == os.getpid()
        finally:
            registry.release()
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()


def _foreign_record(etcd_client: EtcdClient, key: str, *, ttl_s: int, refresh: bool) -> tuple[int, threading.Event]:
    """A record written as from another machine (its boot id is not ours), on a lease that is or is not refreshed."""
    lease = etcd_client.grant_lease(ttl_s)
    record = {"node_id": "far", "host": "elsewhere", "pid": 1, "boot_id": "another-machine", "pid_ns": 1}
    assert etcd_client.create(key, json.dumps(record), lease_id=lease)
    stop = threading.Event()

    def keep_alive() -> None:
        while not stop.wait(1.0):
            etcd_client.refresh_lease(lease)

    if refresh:
        threading.Thread(target=keep_alive, daemon=True).start()
    return lease, stop


def test_a_live_holder_on_another_machine_is_refused_once_its_lease_is_seen_refreshed(etcd_client: EtcdClient) -> None:
    keys = RunKeys("far")
    lease, stop = _foreign_record(etcd_client, keys.node("far"), ttl_s=DEFAULT_TTL_S, refresh=True)
    try:
        started = time.monotonic()
        with pytest.raises(NodeIdInUseError, match="'far' is held by a live daemon"):
            NodeRegistry(etcd_client, keys, "far").claim()
        took = time.monotonic() - started
        print(f"foreign live holder refused in {took:.2f}s")
        assert took < DEFAULT_TTL_S / 2
    finally:
        stop.set()
        etcd_client.revoke_lease(lease)


def test_a_holder_on_another_machine_that_stopped_refreshing_is_waited_out(etcd_client: EtcdClient) -> None:
    keys = RunKeys("far2")
    _foreign_record(etcd_client, keys.node("far"), ttl_s=3, refresh=False)
    holder = Holder(etcd_client, keys.node("far"))
    looks = set()
    for _ in range(5):
        time.sleep(0.3)
        looks.add(holder.look())
    assert looks == {HolderState.UNKNOWN}
    registry = NodeRegistry(etcd_client, keys, "far")
    registry.claim()  # the record expires with its lease: the claim gets it, it is never refused
    registry.release()
    assert holder.look() == HolderState.FREE
