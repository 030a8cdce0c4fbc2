"""A round whose fencing token cannot be written starts no workers (they could never commit), says so with an
event and a metric, and forms again until it can: produced for real with an etcd whose permissions refuse that one
key to the daemon's user, then granted."""

from __future__ import annotations

import subprocess
import urllib.request
from pathlib import Path

import pytest

from elasticd.etcd.client import EtcdClient
from elasticd.etcd.endpoints import parse_endpoints
from elasticd.etcd.server import find_etcd_binary, free_port
from elasticd.keys import RunKeys
from elasticd.lineage import Lineage
from tests.integration.cluster import Cluster, train_args, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

RUN = "tok"
ROOT_PASSWORD, PASSWORD = "root-secret", "trainer-secret"
ETCDCTL = str(Path(find_etcd_binary()).with_name("etcdctl"))


def _etcdctl(endpoint: str, *args: str, user: str | None = None) -> None:
    auth = ["--user", user] if user else []
    done = subprocess.run([ETCDCTL, "--endpoints", endpoint, *auth, *args], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr


def _metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")]
    return values[0] if values else 0.0


def test_a_round_whose_token_cannot_be_written_starts_no_workers_until_it_can(etcd, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    keys = RunKeys(RUN)
    ep = etcd.endpoint
    token_key = keys.lineage_token
    _etcdctl(ep, "user", "add", f"root:{ROOT_PASSWORD}")
    _etcdctl(ep, "role", "add", "trainer")
    # everything of the run but its token key: [prefix, token) and (token, end of the prefix)
    _etcdctl(ep, "role", "grant-permission", "trainer", "readwrite", keys.prefix, token_key)
    _etcdctl(ep, "role", "grant-permission", "trainer", "readwrite", keys.prefix + "lineage/u", "/elasticd0")
    _etcdctl(ep, "user", "add", f"trainer:{PASSWORD}")
    _etcdctl(ep, "user", "grant-role", "trainer", "trainer")
    _etcdctl(ep, "auth", "enable")
    password_file = tmp_path / "password"
    password_file.write_text(PASSWORD)
    port = free_port()
    root = f"root:{ROOT_PASSWORD}"
    with Cluster(
        ep,
        tmp_path,
        run_id=RUN,
        script_args=train_args(40, 0.02),
        extra=("--etcd-user", "trainer", "--etcd-password-file", str(password_file)),
    ) as cluster:
        try:
            node = cluster.start("a", "--metrics-port", str(port))
            node.wait_event("token_write_failed", 120)
            abandoned = node.wait_event("round_abandoned", 60)
            assert "fencing token" in str(abandoned["reason"])
            assert not node.events("workers_started"), "a round without a token must start no workers"
            assert wait_until(lambda: _metric(port, "elasticd_fence_token_failures_total") >= 1, 30, "the metric")

            _etcdctl(ep, "role", "grant-permission", "trainer", "readwrite", token_key, user=root)
            node.wait_event("workers_started", 120)
            assert node.wait(240) == 0, cluster.diagnostics()
        except AssertionError:
            raise AssertionError(cluster.diagnostics()) from None
    client = EtcdClient.connect(parse_endpoints(ep), connect_timeout_s=30, user="root", password=ROOT_PASSWORD)
    try:
        records = Lineage(client, keys).records()
    finally:
        client.close()
    assert records and records[0].step == 40, "once the token was written, checkpoints commit"
