"""What the tests of nodes on hosts of their own share (``test_hosts.py``, ``test_etcd_cluster.py``): the job they
run, its undisturbed ending, and the checks every one of them makes of a disturbed run."""

from __future__ import annotations

import itertools
from datetime import datetime
from pathlib import Path
from typing import Any

import torch

from elasticd.etcd.server import EmbeddedEtcd
from elasticd.lineage import CheckpointRecord
from tests.integration.cluster import Cluster, train_args
from tests.integration.netns import Host

STEPS = 200
# seconds a step sleeps: the run must outlast a cut node's return (its workers import again, 5-20 s on a busy host)
SLEEP_S = 0.1
# the same parameters as an undisturbed run, within this relative difference (only the order of float sums differs)
REL_TOL = 1e-5


def undisturbed_parameters(workdir: Path) -> dict[str, torch.Tensor]:
    """The final parameters of the job, undisturbed, on one node (the global batch is the same at any size)."""
    out = workdir / "final.pt"
    server = EmbeddedEtcd(data_dir=workdir / "etcd", unsafe_no_fsync=True)
    server.start(ready_timeout_s=30)
    try:
        with Cluster(server.endpoint, workdir, run_id="undisturbed",
                     script_args=(*train_args(STEPS, 0.0), "--save-final", str(out))) as c:  # fmt: skip
            assert c.start("ref").wait(240) == 0, c.diagnostics()
    finally:
        server.stop()
    return dict(torch.load(out))


def assert_same_parameters(final: Path, reference: dict[str, torch.Tensor]) -> None:
    trained = torch.load(final)
    assert trained.keys() == reference.keys()
    worst = max(((trained[k] - v).abs().max() / v.abs().max().clamp(min=1e-12)).item() for k, v in reference.items())
    print(f"largest relative parameter difference from the undisturbed run: {worst:.3e}")
    assert worst <= REL_TOL


def start_on_hosts(c: Cluster, hosts: dict[str, Host]) -> dict[str, int]:
    """A node on each host, trained to step 12 at world 3; each node's group rank."""
    for host in hosts.values():
        c.start(host.name, host=host)
    c.wait_step(lambda s: s["step"] >= 12 and s["world_size"] == 3, timeout_s=120, what="step 12 on 3 workers")
    return {n: c.nodes[n].events("rendezvous_done")[-1]["group_rank"] for n in hosts}


def assert_one_lineage(records: list[CheckpointRecord]) -> None:
    """In commit order, steps only grow and a token once replaced never commits again: no fork."""
    ordered = sorted(records, key=lambda r: r.committed_at)
    retired: set[str] = set()
    for before, after in itertools.pairwise(ordered):
        assert after.step > before.step, (before, after)
        if after.token != before.token:
            retired.add(before.token)
        assert after.token not in retired, (after, sorted(retired))


def stamp(event: dict[str, Any]) -> float:
    return datetime.fromisoformat(str(event["timestamp"]).replace("Z", "+00:00")).timestamp()
