"""A stopped node is found by its silence, not by its lease, with etcd at its default timing (1 s election timeout).

Three nodes of one worker train in place; the whole of one node (daemon and worker) gets SIGSTOP. Its lease cannot
expire sooner than etcd's shortest TTL at these timings (2 s), so the node before it in the ring greets its daemon,
hears nothing and writes the epoch's failure notice; the survivors' step fails on that notice, the deciders greet
the daemon themselves and re-form without it (``worker/hot/silence.py``). Without the silence watch the step fails
on the lease's expiry instead (the reason says "lease gone").
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from elasticd.etcd.server import EmbeddedEtcd
from tests.helpers import ETCD_READY_TIMEOUT_S
from tests.integration.cluster import Cluster, train_args

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


@pytest.fixture
def etcd_at_defaults(tmp_path: Path) -> Iterator[EmbeddedEtcd]:
    server = EmbeddedEtcd(data_dir=tmp_path / "etcd", unsafe_no_fsync=True, fast_elections=False)
    server.start(ready_timeout_s=ETCD_READY_TIMEOUT_S)
    try:
        yield server
    finally:
        server.stop()


def test_a_stopped_node_is_known_by_its_silent_daemon_before_its_lease_expires(
    etcd_at_defaults: EmbeddedEtcd, tmp_path: Path
) -> None:
    names = ["sn-0", "sn-1", "sn-2"]
    with Cluster(
        etcd_at_defaults.endpoint, tmp_path, run_id="stopped", min_nodes=2, max_nodes=3, script_args=train_args(300)
    ) as c:
        for name in names:
            c.start(name)
        c.wait_step(lambda s: s["step"] >= 12 and s["world_size"] == 3, timeout_s=120, what="step 12 on 3 workers")
        ranks = {n: c.nodes[n].events("rendezvous_done")[-1]["group_rank"] for n in names}
        victim = c.nodes[next(n for n, r in ranks.items() if r == 2)]  # not rank 0, whose step lines we read
        survivors = [n for n in names if n != victim.name]
        victim.freeze()
        stopped_at = time.time()
        try:
            after = c.wait_step(lambda s: s["world_size"] == 2 and s["t"] > stopped_at, timeout_s=60, what="world 2")
            print(f"stopped node: first step at world 2 {after['t'] - stopped_at:.2f}s after SIGSTOP")
            for name in survivors:
                failed = [e for e in c.nodes[name].events("step_failed") if "daemon is silent" in e["reason"]]
                assert failed, (name, c.nodes[name].events("step_failed"), c.diagnostics())
                assert f"node {victim.name}'s daemon is silent" in failed[0]["reason"], failed
                event = c.nodes[name].wait_event("reconfigured", timeout_s=30)
                assert event["world_size"] == 2 and not c.nodes[name].events("restart"), c.diagnostics()
        finally:
            victim.kill()
