"""Recovery in place under real daemons: the survivors keep their processes, the group re-forms, nothing is lost.

Each test runs examples/train.py under real ``elasticd start`` processes (``--recovery hot``, the default) on
127.0.0.1 with a real etcd and gloo, produces the fault for real and checks what a user would: the survivors' worker
processes are the same ones before and after, no rendezvous round and no restart happened, training went on at the
new size from the step it had reached (no committed step lost, none repeated) and ended.
"""

from __future__ import annotations

import contextlib
import signal
import time
from datetime import datetime
from pathlib import Path

import psutil
import pytest

from elasticd.etcd.client import EtcdClient
from elasticd.etcd.server import EmbeddedEtcd
from elasticd.keys import RunKeys
from elasticd.lineage import Lineage
from tests.integration.cluster import Cluster, leftover_processes, read_json_lines, train_args, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def _stamp(event: dict) -> float:
    return datetime.fromisoformat(str(event["timestamp"]).replace("Z", "+00:00")).timestamp()


def _steps_by_number(cluster: Cluster) -> dict[int, list[dict]]:
    seen: dict[int, list[dict]] = {}
    for step in cluster.all_steps():
        seen.setdefault(step["step"], []).append(step)
    return seen


@pytest.mark.parametrize("victim_rank", [0, 2], ids=["rank0-node", "other-node"])
def test_node_killed_survivors_reform_in_place_and_lose_nothing(
    etcd: EmbeddedEtcd, tmp_path: Path, victim_rank: int
) -> None:
    names = [f"hk{victim_rank}-{i}" for i in range(3)]
    with Cluster(
        etcd.endpoint, tmp_path, run_id=f"hotkill{victim_rank}", min_nodes=2, max_nodes=3, script_args=train_args(60)
    ) as c:
        for name in names:
            c.start(name)
        c.wait_step(lambda s: s["step"] >= 12 and s["world_size"] == 3, what="step 12 on 3 workers")
        ranks = {n: c.nodes[n].events("rendezvous_done")[-1]["group_rank"] for n in names}
        victim = next(n for n, r in ranks.items() if r == victim_rank)
        survivors = [n for n in names if n != victim]
        pids = {n: c.nodes[n].worker_pids() for n in survivors}
        rounds = {n: len(c.nodes[n].events("rendezvous_done")) for n in survivors}
        before = c.last_step()
        assert before is not None
        c.nodes[victim].kill()
        after = c.wait_step(lambda s: s["world_size"] == 2, timeout_s=60, what="a step on 2 workers")
        for name in survivors:
            assert c.nodes[name].wait(150) == 0, c.diagnostics()
        wait_until(lambda: not leftover_processes(list(c.nodes)), 15, "worker processes to exit")
        for name in survivors:
            node = c.nodes[name]
            assert not node.events("restart"), f"{name} restarted its workers\n{c.diagnostics()}"
            assert len(node.events("rendezvous_done")) == rounds[name], c.diagnostics()
            # the same worker processes trained before and after the loss
            assert {int(e["pid"]) for e in read_json_lines(node.out) if e.get("event") == "done"} <= set(pids[name])
        reconfigured = [e for n in survivors for e in c.nodes[n].events("reconfigured")]
        assert reconfigured and all(e["reason"] == "failure" and e["world_size"] == 2 for e in reconfigured)
        steps = _steps_by_number(c)
        assert all(len(v) == 1 for v in steps.values()), {k: len(v) for k, v in steps.items() if len(v) > 1}
        # No committed step lost: the survivors went on from at least the last step anyone printed before the kill
        # (rank 0 prints after the step; a killed rank 0 may have completed steps it never printed).
        healed = {e["step"] for n in survivors for e in c.nodes[n].events("regrouped")}
        assert len(healed) == 1, healed
        resumed_from = healed.pop()
        printed_before = max(s for s, v in steps.items() if v[0]["world_size"] == 3)
        assert resumed_from >= printed_before, (resumed_from, printed_before)
        unprinted = set(range(printed_before + 1, resumed_from + 1))
        assert sorted(set(steps) | unprinted) == list(range(1, 61)), sorted(steps)
        assert min(s for s, v in steps.items() if v[0]["world_size"] == 2) == resumed_from + 1
        assert after["step"] <= before["step"] + 3
        assert c.newest_step()["world_size"] == 2


def test_vanished_node_is_declared_dead_by_its_lease_and_never_trains_or_commits_for_the_group_again(
    etcd: EmbeddedEtcd, etcd_client: EtcdClient, tmp_path: Path
) -> None:
    """SIGSTOP of a whole node (its daemon and worker): nothing resets a connection, the survivors' all-reduce just
    waits. The node's one-second liveness lease expires, the survivors' watch fails the step, the membership
    decision counts the node as dead and the group re-forms in place. After SIGCONT the stale worker finds itself
    out of the epoch (its fence was replaced in the decision's transaction): it commits nothing and goes away."""
    names = ["hs-0", "hs-1", "hs-2"]
    keys = RunKeys("hotstop")
    # long enough for the woken node to come back as a joiner (its workers import again: 5-10 s here)
    with Cluster(etcd.endpoint, tmp_path, run_id="hotstop", min_nodes=2, max_nodes=3, script_args=train_args(300)) as c:
        for name in names:
            c.start(name)
        c.wait_step(lambda s: s["step"] >= 12 and s["world_size"] == 3, what="step 12 on 3 workers")
        ranks = {n: c.nodes[n].events("rendezvous_done")[-1]["group_rank"] for n in names}
        victim_name = next(n for n, r in ranks.items() if r == 0)  # the node whose rank 0 commits checkpoints
        victim = c.nodes[victim_name]
        survivors = [n for n in names if n != victim_name]
        round_token = Lineage(etcd_client, keys).token()
        stopped = [psutil.Process(victim.proc.pid), *psutil.Process(victim.proc.pid).children(recursive=True)]
        for p in stopped:
            p.send_signal(signal.SIGSTOP)
        stopped_at = time.time()
        try:
            after = c.wait_step(lambda s: s["world_size"] == 2 and s["t"] > stopped_at, timeout_s=60, what="world 2")
            print(f"vanished node: first step at world 2 {after['t'] - stopped_at:.2f}s after SIGSTOP")
            for name in survivors:
                event = c.nodes[name].wait_event("reconfigured", timeout_s=30)
                assert event["world_size"] == 2 and not c.nodes[name].events("restart"), c.diagnostics()
            # the survivors' group holds the fence now; train on a little (and commit) while the victim is stopped
            c.wait_step(lambda s: s["world_size"] == 2 and s["step"] >= after["step"] + 12, timeout_s=60)
        finally:
            for p in stopped:
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.send_signal(signal.SIGCONT)
        resumed_at = time.time()
        for name in names:
            assert c.nodes[name].wait(200) == 0, c.diagnostics()
        # the stale worker never committed for the group: every record since the stop carries a newer token
        records = Lineage(etcd_client, keys).records()
        late = [r for r in records if r.committed_at > stopped_at]
        assert late and all(r.token != round_token for r in late), [(r.step, r.token) for r in late]
        # and it left the group it was no longer in rather than training with it: the stale worker saw it was out
        # (excluded, or its fence gone), or its woken daemon saw first that the node was evicted from the round
        # and stopped it (hang_stale, then a restart), whichever came first after SIGCONT
        stale = [e for e in victim.events("hot_fallback") if e.get("reason") == "excluded"]
        lost = [e for e in victim.events("lineage_lost")]
        evicted = [e for e in victim.events("hang_stale") if "evicted" in e.get("reason", "")]
        assert stale or lost or (evicted and victim.events("restart")), victim.tail(80)
        stale += evicted
        print(f"stale node out {min(_stamp(e) for e in stale + lost) - resumed_at:.2f}s after SIGCONT")
        # and came back as a joiner, admitted in place (healed from a live peer), not through a new round
        assert victim.events("joining_in_place"), victim.tail(80)
        joined = [e for e in victim.events("reconfigured") if "node_id" in e and e["reason"] == "join"]
        assert joined and joined[-1]["world_size"] == 3, victim.tail(80)
        for name in survivors:
            assert not c.nodes[name].events("restart"), c.diagnostics()
