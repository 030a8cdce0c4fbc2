"""Joining in place under real daemons: a node that starts while the group trains joins it without a restart.

examples/train.py under real ``elasticd start`` processes (``--recovery hot``, the default) on 127.0.0.1 with a real
etcd and gloo. The joining node's workers import and prepare in a world of their own, ask to be admitted, and heal
from a live peer at a step boundary the group agreed on: the running workers keep their processes, no rendezvous
round and no checkpoint comes first, no step is lost or repeated, and the run ends at the new size.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.integration.cluster import Cluster, leftover_processes, read_json_lines, train_args, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def _done_pids(node) -> set[int]:  # type: ignore[no-untyped-def]
    return {int(e["pid"]) for e in read_json_lines(node.out) if e.get("event") == "done"}


def test_a_node_that_starts_while_the_group_trains_joins_in_place_and_nothing_restarts(  # type: ignore[no-untyped-def]
    etcd, tmp_path: Path
) -> None:
    names = ["hj-0", "hj-1"]
    with Cluster(etcd.endpoint, tmp_path, run_id="hotjoin", min_nodes=2, max_nodes=3, script_args=train_args(300)) as c:
        for name in names:
            c.start(name)
        c.wait_step(lambda s: s["step"] >= 10 and s["world_size"] == 2, what="step 10 on 2 workers")
        pids = {n: c.nodes[n].worker_pids() for n in names}
        rounds = {n: len(c.nodes[n].events("rendezvous_done")) for n in names}
        joiner = c.start("hj-2")
        joined = c.wait_step(lambda s: s["world_size"] == 3, timeout_s=90, what="a step on 3 workers")
        assert joiner.events("joining_in_place"), joiner.tail(60)
        for name in [*names, "hj-2"]:
            assert c.nodes[name].wait(150) == 0, c.diagnostics()
        wait_until(lambda: not leftover_processes(list(c.nodes)), 15, "worker processes to exit")
        for name in names:
            node = c.nodes[name]
            assert not node.events("restart"), f"{name} restarted its workers\n{c.diagnostics()}"
            assert not node.events("checkpoint_requested"), c.diagnostics()  # no checkpoint before a join in place
            assert len(node.events("rendezvous_done")) == rounds[name], c.diagnostics()
            assert _done_pids(node) <= set(pids[name])  # the same processes trained before and after
            event = node.wait_event("reconfigured", timeout_s=5)
            assert event["reason"] == "join" and event["world_size"] == 3 and event["lost_steps"] == 0
        assert not joiner.events("restart"), joiner.tail(60)
        event = joiner.wait_event("reconfigured", timeout_s=5)
        assert event["reason"] == "join" and event["world_size"] == 3 and event["heal_bytes"] > 0
        steps: dict[int, list[dict]] = {}  # type: ignore[type-arg]
        for step in c.all_steps():
            steps.setdefault(step["step"], []).append(step)
        # every step once, through the join: none lost, none repeated
        assert sorted(steps) == list(range(1, 301)), sorted(steps)
        assert all(len(v) == 1 for v in steps.values())
        assert steps[300][0]["world_size"] == 3
        # the same global batch: accumulation 6 on 2 workers, 4 on 3
        assert {s[0]["accumulation"] for s in steps.values() if s[0]["world_size"] == 3} == {4}
        assert joined["step"] > 10


def test_a_joiner_that_does_not_fit_the_batch_waits_warm_and_steps_in_for_a_lost_node(  # type: ignore[no-untyped-def]
    etcd, tmp_path: Path
) -> None:
    """Global batch 32 in micro-batches of 4 splits over 2 or 4 workers, not 3: the third node's worker waits warm
    (imported, prepared, not convicted of a hang) while the other two train; when one of them is killed, the
    spare is in the very epoch that re-forms the group, healed from the survivor: nobody restarts."""
    args = ("--epochs", "20", "--dataset-size", "480", "--global-batch", "32", "--micro-batch", "4", "--sleep", "0.05")
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
        c.wait_step(lambda s: s["step"] >= waiting_from["step"] + 60, timeout_s=90, what="training after the loss")
        for name in ("hw-0", "hw-2"):
            assert c.nodes[name].wait(150) == 0, c.diagnostics()
        wait_until(lambda: not leftover_processes(list(c.nodes)), 15, "worker processes to exit")
        for name in ("hw-0", "hw-2"):
            node = c.nodes[name]
            assert not node.events("restart"), f"{name} restarted its workers\n{c.diagnostics()}"
            events = [e for e in node.events("reconfigured") if "node_id" in e]
            assert [(e["reason"], e["world_size"]) for e in events] == [("failure", 2)], c.diagnostics()
        assert _done_pids(spare) <= set(spare_pids)  # the spare's worker of before the loss finished the run
        steps: dict[int, list[dict]] = {}  # type: ignore[type-arg]
        for step in c.all_steps():
            steps.setdefault(step["step"], []).append(step)
        assert all(len(v) == 1 for v in steps.values())
        assert max(steps) == 300 and {s[0]["world_size"] for s in steps.values()} == {2}


def test_a_node_stopped_by_sigterm_leaves_in_place_and_the_others_train_on(  # type: ignore[no-untyped-def]
    etcd, tmp_path: Path
) -> None:
    names = ["hl-0", "hl-1", "hl-2"]
    with Cluster(
        etcd.endpoint, tmp_path, run_id="hotleave", min_nodes=2, max_nodes=3, script_args=train_args(300)
    ) as c:
        for name in names:
            c.start(name)
        c.wait_step(lambda s: s["step"] >= 10 and s["world_size"] == 3, what="step 10 on 3 workers")
        ranks = {n: c.nodes[n].events("rendezvous_done")[-1]["group_rank"] for n in names}
        leaver = next(n for n, r in ranks.items() if r == 0)  # the node of rank 0, which commits checkpoints
        stayers = [n for n in names if n != leaver]
        pids = {n: c.nodes[n].worker_pids() for n in stayers}
        c.nodes[leaver].proc.send_signal(signal.SIGTERM)
        assert c.nodes[leaver].wait(60) == 0, c.diagnostics()
        c.wait_step(lambda s: s["world_size"] == 2, timeout_s=30, what="a step on 2 workers")
        for name in stayers:
            assert c.nodes[name].wait(150) == 0, c.diagnostics()
        wait_until(lambda: not leftover_processes(list(c.nodes)), 15, "worker processes to exit")
        assert c.nodes[leaver].events("leaving_in_place") and c.nodes[leaver].events("left_in_place")
        for name in names:
            assert not c.nodes[name].events("checkpoint_requested"), c.diagnostics()  # a leave in place saves nothing
        for name in stayers:
            node = c.nodes[name]
            assert not node.events("restart"), f"{name} restarted its workers\n{c.diagnostics()}"
            assert _done_pids(node) <= set(pids[name])
            event = node.wait_event("reconfigured", timeout_s=5)
            assert event["reason"] == "leave" and event["world_size"] == 2 and event["lost_steps"] == 0
        steps: dict[int, list[dict]] = {}  # type: ignore[type-arg]
        for step in c.all_steps():
            steps.setdefault(step["step"], []).append(step)
        # the leaver (rank 0) left inside run.step() of the boundary step, after completing it; the new rank 0
        # printed that step, already at the new size
        left_at = c.nodes[leaver].events("left_in_place")[0]["step"]
        assert sorted(steps) == list(range(1, 301)) and all(len(v) == 1 for v in steps.values())
        assert min(s for s, v in steps.items() if v[0]["world_size"] == 2) == left_at
