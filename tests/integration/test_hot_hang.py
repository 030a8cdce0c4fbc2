"""A hang under recovery in place: only the culprit's node restarts its workers, the others re-form in place.

examples/train.py under three real daemons (``--recovery hot``, the default); one rank sleeps before its all-reduce
(``ELASTICD_FAULT``, elasticd/worker/faults.py), the others wait inside theirs. The nodes agree on the diagnosis as
before; then the culprit's daemon kills its workers and the others' daemons leave theirs alone: their all-reduce
fails when the culprit's sockets close, the group re-forms without it, and the culprit's node comes back with fresh
workers that join in place.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.cluster import Cluster, leftover_processes, read_json_lines, train_args, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def test_a_hung_rank_is_killed_on_its_node_and_the_others_reform_in_place(etcd, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    names = ["hh-0", "hh-1", "hh-2"]
    with Cluster(
        etcd.endpoint,
        tmp_path,
        run_id="hothang",
        min_nodes=2,
        max_nodes=3,
        script_args=train_args(300, 0.05),
        extra=("--hang-timeout", "2"),
        env={"ELASTICD_FAULT": "sleep@step=40,rank=2,restart=0"},
    ) as c:
        for name in names:
            c.start(name)
        diagnosed = c.nodes["hh-0"].wait_event("hang_diagnosed", timeout_s=120)
        culprit = diagnosed["culprit_nodes"]
        assert len(culprit) == 1, c.diagnostics()
        others = [n for n in names if n not in culprit]
        pids = {n: c.nodes[n].worker_pids() for n in others}
        for name in names:
            assert c.nodes[name].wait(180) == 0, c.diagnostics()
        wait_until(lambda: not leftover_processes(list(c.nodes)), 15, "worker processes to exit")
        for name in others:
            node = c.nodes[name]
            assert node.events("hang_left_to_culprits"), c.diagnostics()
            assert not node.events("restart"), f"{name} restarted its workers\n{c.diagnostics()}"
            # the same processes trained before the hang and finished the run
            assert {int(e["pid"]) for e in read_json_lines(node.out) if e.get("event") == "done"} <= set(pids[name])
            daemon_events = [e for e in node.events("reconfigured") if "node_id" in e]  # not the worker's own line
            reasons = [(e["reason"], e["world_size"]) for e in daemon_events]
            assert reasons[:1] == [("hang", 2)] and ("join", 3) in reasons, (reasons, c.diagnostics())
        victim = c.nodes[culprit[0]]
        assert [e["reason"] for e in victim.events("restart")] == ["hang"], victim.tail(60)
        assert len(victim.events("hang_diagnosed")) == 1, victim.tail(60)  # acted on once
        assert victim.events("joining_in_place"), victim.tail(60)
        steps: dict[int, list[dict]] = {}  # type: ignore[type-arg]
        for step in c.all_steps():
            steps.setdefault(step["step"], []).append(step)
        assert all(len(v) == 1 for v in steps.values())
        assert max(steps) == 300 and steps[300][0]["world_size"] == 3
