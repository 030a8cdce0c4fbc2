"""Nodes on hosts of their own (``netns.py``): each in its own network namespace, with its own addresses on a data
and a control network, etcd on another host, and this machine's host name resolving to 127.0.0.1 everywhere.

Before elasticd named the collectives' interface from ``--local-addr`` (``elasticd/addresses.py``), gloo bound the
host name's loopback address and such nodes never formed a group ("Gloo connectFullMesh failed ... Connection
refused, remote=[127.0.0.1]:PORT", worker restarts until the budget ran out).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from elasticd.endpoints import parse_endpoints
from elasticd.etcd.client import EtcdClient
from elasticd.etcd.server import EmbeddedEtcd
from elasticd.keys import RunKeys
from elasticd.lineage import Lineage
from tests.integration.cluster import EXAMPLE, Cluster, train_args
from tests.integration.netns import Network, unavailable

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(300),
    pytest.mark.skipif(unavailable() is not None, reason=str(unavailable())),
]


@pytest.fixture
def network() -> Iterator[Network]:
    with Network() as net:
        yield net


@pytest.fixture
def remote_etcd(network: Network, tmp_path: Path) -> Iterator[EmbeddedEtcd]:
    """etcd on the control network's gateway: another host for every node."""
    server = EmbeddedEtcd(data_dir=tmp_path / "etcd", host=network.gateway, unsafe_no_fsync=True)
    server.start(ready_timeout_s=30)
    try:
        yield server
    finally:
        server.stop()


def test_nodes_on_their_own_hosts_train_together_with_local_addr_alone(
    network: Network, remote_etcd: EmbeddedEtcd, tmp_path: Path
) -> None:
    hosts = [network.add(f"h{i}") for i in range(3)]
    with Cluster(remote_etcd.endpoint, tmp_path, run_id="hosts", min_nodes=3, max_nodes=3,
                 script_args=train_args(30)) as c:  # fmt: skip
        for host in hosts:
            c.start(host.name, host=host)
        for node in c.nodes.values():
            assert node.wait(240) == 0, c.diagnostics()
        chosen = {n.name: n.events("collective_interface") for n in c.nodes.values()}
        for host in hosts:
            (event,) = chosen[host.name]
            assert event["interface"] == "data" and event["GLOO_SOCKET_IFNAME"] == "data", event
            assert event["local_addr"] == host.data_addr
            assert not c.nodes[host.name].events("restart"), c.diagnostics()  # formed the first time
        assert c.newest_step()["step"] == 30 and c.newest_step()["world_size"] == 3
    client = EtcdClient.connect(parse_endpoints(remote_etcd.endpoint), connect_timeout_s=10)
    try:
        assert max(r.step for r in Lineage(client, RunKeys("hosts")).records()) == 30
    finally:
        client.close()


def test_without_local_addr_a_host_name_that_stands_for_loopback_is_one_line_and_exit_2(
    network: Network, remote_etcd: EmbeddedEtcd, tmp_path: Path
) -> None:
    host = network.add("alone")
    command = [sys.executable, "-m", "elasticd", "start", "--etcd", remote_etcd.endpoint, "--max-nodes", "2",
               "--checkpoint-dir", str(tmp_path / "checkpoints"), str(EXAMPLE)]  # fmt: skip
    done = subprocess.run(host.command(command), capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("elasticd: error: --local-addr") and "loopback" in line, line
