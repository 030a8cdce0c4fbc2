"""What etcd refuses, produced for real with an etcd whose permissions withhold a key from the daemons' user:

- a round whose fencing token cannot be written starts no workers (they could never commit), says so with an event
  and a metric, and forms again until it can;
- a planned save (a node leaving on SIGTERM) whose commit is refused is reported as refused, and the steps since the
  last committed checkpoint are counted as lost, never taken for a saved checkpoint.

etcd checks passwords only over TLS, so this runs on the TLS etcd of test_etcd_tls.py.
"""

from __future__ import annotations

import signal
import subprocess
import urllib.request
from pathlib import Path

import pytest

from elasticd.endpoints import parse_endpoints
from elasticd.etcd.client import EtcdClient
from elasticd.etcd.server import find_etcd_binary
from elasticd.keys import RunKeys
from elasticd.lineage import Lineage
from tests.helpers import free_port
from tests.integration.cluster import Cluster, train_args, wait_until
from tests.integration.test_etcd_tls import PASSWORD, Pki, pki, secure_etcd  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

TRAINER_PASSWORD = "trainer-secret"
ETCDCTL = str(Path(find_etcd_binary()).with_name("etcdctl"))
END = "/elasticd0"  # the end of every /elasticd/ key


def _etcdctl(endpoint: str, pki: Pki, *args: str) -> None:  # noqa: F811
    tls = ["--cacert", str(pki.ca), "--cert", str(pki.client_cert), "--key", str(pki.client_key)]
    command = [ETCDCTL, "--endpoints", f"https://{endpoint}", *tls, "--user", f"root:{PASSWORD}", *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr


def _trainer(endpoint: str, pki: Pki, ranges: list[tuple[str, str]]) -> None:  # noqa: F811
    """A user "trainer" whose role may read and write exactly ``ranges`` ([start, end) each)."""
    _etcdctl(endpoint, pki, "role", "add", "trainer")
    for start, end in ranges:
        _etcdctl(endpoint, pki, "role", "grant-permission", "trainer", "readwrite", start, end)
    _etcdctl(endpoint, pki, "user", "add", f"trainer:{TRAINER_PASSWORD}")
    _etcdctl(endpoint, pki, "user", "grant-role", "trainer", "trainer")


def _cluster(
    endpoint: str,
    pki: Pki,  # noqa: F811
    tmp_path: Path,
    run_id: str,
    recovery: str = "hot",
    **kwargs: object,
) -> Cluster:
    password_file = tmp_path / "password"
    password_file.write_text(TRAINER_PASSWORD)
    access = ("--etcd-cacert", str(pki.ca), "--etcd-cert", str(pki.client_cert), "--etcd-key", str(pki.client_key))
    extra = (*access, "--etcd-user", "trainer", "--etcd-password-file", str(password_file), "--recovery", recovery)
    return Cluster(endpoint, tmp_path, run_id=run_id, extra=extra, **kwargs)  # type: ignore[arg-type]  # Cluster's own keywords, passed through


def _records(endpoint: str, pki: Pki, keys: RunKeys) -> list[int]:  # noqa: F811
    client = EtcdClient.connect(
        parse_endpoints(endpoint),
        connect_timeout_s=30,
        ca_cert=str(pki.ca),
        cert=str(pki.client_cert),
        key=str(pki.client_key),
        user="root",
        password=PASSWORD,
    )
    try:
        return [r.step for r in Lineage(client, keys).records()]
    finally:
        client.close()


def _metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")]
    return values[0] if values else 0.0


def test_a_round_whose_token_cannot_be_written_starts_no_workers_until_it_can(
    secure_etcd: str,  # noqa: F811
    pki: Pki,  # noqa: F811
    tmp_path: Path,
) -> None:
    keys = RunKeys("tok")
    # everything of the run but its token key
    _trainer(secure_etcd, pki, [(keys.prefix, keys.lineage_token), (keys.prefix + "lineage/u", END)])
    port = free_port()
    with _cluster(secure_etcd, pki, tmp_path, "tok", script_args=train_args(40, 0.02)) as cluster:
        try:
            node = cluster.start("a", "--metrics-port", str(port))
            node.wait_event("token_write_failed", 120)
            abandoned = node.wait_event("round_abandoned", 60)
            assert "fencing token" in str(abandoned["reason"])
            assert not node.events("workers_started"), "a round without a token must start no workers"
            assert wait_until(lambda: _metric(port, "elasticd_fence_token_failures_total") >= 1, 30, "the metric")

            _etcdctl(secure_etcd, pki, "role", "grant-permission", "trainer", "readwrite", keys.lineage_token)
            node.wait_event("workers_started", 120)
            assert node.wait(240) == 0
        except AssertionError:
            raise AssertionError(cluster.diagnostics()) from None
    assert _records(secure_etcd, pki, keys)[0] == 40, "once the token was written, checkpoints commit"


def test_a_planned_save_whose_commit_is_refused_counts_as_lost_steps_not_as_saved(
    secure_etcd: str,  # noqa: F811
    pki: Pki,  # noqa: F811
    tmp_path: Path,
) -> None:
    keys = RunKeys("refused")
    records = (keys.lineage_checkpoints_prefix, keys.prefix + "lineage/checkpoints0")
    _trainer(secure_etcd, pki, [(keys.prefix, records[0]), records, (records[1], END)])
    port = free_port()
    with _cluster(
        secure_etcd,
        pki,
        tmp_path,
        "refused",
        min_nodes=1,
        max_nodes=2,
        script_args=train_args(400, 0.05),
        recovery="cold",  # a SIGTERM's planned save (in place, a leave takes none)
    ) as cluster:
        try:
            cluster.start("a"), cluster.start("b", "--metrics-port", str(port))
            wait_until(lambda: max(_records(secure_etcd, pki, keys), default=0) >= 20, 180, "step 20 committed")
            # from now on etcd refuses to write a checkpoint record (reading them stays allowed): no commit can happen
            _etcdctl(secure_etcd, pki, "role", "revoke-permission", "trainer", *records)
            _etcdctl(secure_etcd, pki, "role", "grant-permission", "trainer", "read", *records)
            committed = max(_records(secure_etcd, pki, keys))
            cluster.nodes["a"].proc.send_signal(signal.SIGTERM)
            refused = cluster.nodes["b"].wait_event("checkpoint_request_fenced", 120)
            assert refused["step"] > committed
            assert not cluster.nodes["b"].events("checkpoint_saved"), "a refused save was reported as saved"
            assert cluster.nodes["a"].wait(120) == 0
            resumed = cluster.nodes["b"].wait_event("resumed", 120, where=lambda e: e.get("step", 0) > 0)
            assert resumed["step"] == committed, "the run must resume from the last committed checkpoint"
            assert wait_until(lambda: _metric(port, "elasticd_lost_steps_total") > 0, 120, "lost steps counted")
            # b hosts rank 0 now: its next commit is refused as well, and counted
            fenced = 'elasticd_checkpoint_failures_total{reason="fenced"}'
            assert wait_until(lambda: _metric(port, fenced) >= 1, 120, "refused commits counted")
        except AssertionError:
            raise AssertionError(cluster.diagnostics()) from None
