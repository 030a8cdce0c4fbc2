"""Warm spares under real daemons: a node that joins a group training in place but does not fit its batch waits,
imported and prepared, and steps in for a lost member without anyone restarting.

examples/train.py under real ``elasticd start`` processes (``--recovery hot``, the default) on 127.0.0.1 with a real
etcd and gloo. Joins, leaves and hangs in place: tests/integration/test_invariance.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from elasticd.etcd.server import EmbeddedEtcd
from tests.integration.cluster import Cluster, leftover_processes, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def test_a_joiner_that_does_not_fit_the_batch_waits_warm_and_steps_in_for_a_lost_node(
    etcd: EmbeddedEtcd, tmp_path: Path
) -> None:
    """Global batch 32 in micro-batches of 4 splits over 2 or 4 workers, not 3: the third node's worker waits warm
    (imported, prepared, not convicted of a hang) while the other two train; when one of them is killed, the
    spare is in the very epoch that re-forms the group, healed from the survivor: nobody restarts."""
    # a run longer than the test (drained once the spare has trained at 2): on a loaded host the spare's imports
    # took 20 s, and a 300-step run ended before it had joined (seen in the suite)
    args = ("--epochs", "200", "--dataset-size", "480", "--global-batch", "32", "--micro-batch", "4", "--sleep", "0.05")
    with Cluster(etcd.endpoint, tmp_path, run_id="hotspare", min_nodes=2, max_nodes=3, script_args=args) as c:
        for name in ("hw-0", "hw-1"):
            c.start(name)
        c.wait_step(lambda s: s["step"] >= 10 and s["world_size"] == 2, what="step 10 on 2 workers")
        spare = c.start("hw-2")
        spare.wait_event("join_requested", timeout_s=60)
        waiting_from = c.last_step()
        assert waiting_from is not None
        # the group trains on at 2 while the spare waits (well past a second and a half of its bid)
        c.wait_step(lambda s: s["step"] >= waiting_from["step"] + 30, timeout_s=60, what="30 more steps")
        assert not [s for s in c.all_steps() if s["world_size"] != 2]
        spare_pids = spare.worker_pids()
        assert spare_pids, spare.tail(40)
        c.nodes["hw-1"].kill()
        after = waiting_from["step"] + 60
        c.wait_step(lambda s: s["step"] >= after, timeout_s=90, what="training after the loss")
        c.stop_run()
        for name in ("hw-0", "hw-2"):
            assert c.nodes[name].wait(150) == 0, c.diagnostics()
        wait_until(lambda: not leftover_processes(list(c.nodes)), 15, "worker processes to exit")
        for name in ("hw-0", "hw-2"):
            node = c.nodes[name]
            assert not node.events("restart"), f"{name} restarted its workers\n{c.diagnostics()}"
            events = [e for e in node.events("reconfigured") if "node_id" in e]
            assert [(e["reason"], e["world_size"]) for e in events] == [("failure", 2)], c.diagnostics()
        # the spare's worker of before the loss trained to the drain: its daemon started workers once, the ones that
        # were waiting warm, and drained the run with them (the example's "done" line is the main process's alone,
        # which the spare's worker need not be: a check on it could pass on an empty set)
        started = [e["pids"] for e in spare.events("workers_started")]
        assert len(started) == 1 and started[0] and set(started[0]) <= set(spare_pids), (started, spare_pids)
        assert [(e["code"], e["drained"]) for e in spare.events("exit")] == [(0, True)], spare.tail(40)
        steps: dict[int, list[dict]] = {}
        for step in c.all_steps():
            steps.setdefault(step["step"], []).append(step)
        assert all(len(v) == 1 for v in steps.values())
        assert sorted(steps) == list(range(1, max(steps) + 1)) and max(steps) >= after
        assert {s[0]["world_size"] for s in steps.values()} == {2}
