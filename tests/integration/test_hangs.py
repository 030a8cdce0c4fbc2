"""Hangs and stragglers on real processes: a rank that sleeps before its all-reduce, a SIGSTOPped worker, a hang
that recurs at the same step, a slow rank, two daemons agreeing on one diagnosis.

Each test runs examples/train.py under real ``elasticd start`` processes (gloo, real etcd) with a fault injected
through ``ELASTICD_FAULT`` (elasticd/worker/faults.py) or a real signal, then reads the daemon's events and the
diagnostics it wrote.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil
import pytest

from elasticd.etcd.client import EtcdClient
from elasticd.etcd.server import EmbeddedEtcd
from elasticd.keys import RunKeys
from tests.integration.cluster import Cluster, Node, leftover_processes, read_json_lines, train_args, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def _finished(cluster: Cluster, names: list[str], last_step: int) -> None:
    for name in names:
        code = cluster.nodes[name].wait(150)
        assert code == 0, f"{name} exited {code}\n{cluster.diagnostics()}"
    assert cluster.newest_step()["step"] == last_step, cluster.diagnostics()
    wait_until(lambda: not leftover_processes(list(cluster.nodes)), 15, "worker processes to exit")


def _summary(event: dict[str, Any]) -> dict[str, Any]:
    path = Path(event["path"])
    summary = json.loads((path / "summary.json").read_text())
    assert summary["path"] == str(path)
    return summary


def _unix(event: dict[str, Any]) -> float:
    return datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()


def _rank(summary: dict[str, Any], rank: int) -> dict[str, Any]:
    return next(r for r in summary["ranks"] if r["rank"] == rank)


def test_rank_sleeping_before_its_all_reduce_is_detected_named_and_training_resumes(
    etcd: EmbeddedEtcd, tmp_path: Path
) -> None:
    timeout_s = 2.0
    fault = "sleep@step=25,rank=1,restart=0"
    with Cluster(
        etcd.endpoint,
        tmp_path,
        run_id="hang-sleep",
        nproc_per_node=2,
        script_args=train_args(50, 0.05),
        extra=("--hang-timeout", str(timeout_s)),
        env={"ELASTICD_FAULT": fault},
    ) as c:
        node = c.start("hs-a")
        diagnosed = node.wait_event("hang_diagnosed", timeout_s=90)
        detected = node.events("hang_detected")[0]
        # the hang starts when rank 1 stops: right after step 24 completed
        step_24 = next(s for s in c.all_steps() if s["step"] == 24)
        assert _unix(detected) - step_24["t"] <= timeout_s + 3, (detected, step_24)
        assert detected["step"] == 25
        assert diagnosed["culprit_ranks"] == [1], c.diagnostics()

        summary = _summary(diagnosed)
        culprit, waiting = _rank(summary, 1), _rank(summary, 0)
        assert culprit["in_collective"] is False and "before_step" in culprit["where"]
        # the other rank is blocked inside the collective: its stack is in backward (DDP's all-reduce), its flight
        # recorder shows a pending all_reduce, one collective further than the culprit
        assert waiting["in_collective"] is True
        assert "all_reduce" in waiting["pending_collective"]
        assert waiting["collectives"] > culprit["collectives"]
        stacks = (Path(diagnosed["path"]) / waiting["stacks"]).read_text()
        assert "backward" in stacks
        assert (Path(diagnosed["path"]) / culprit["flight_recorder"]).exists()
        assert summary["culprits"][0]["pid"] == culprit["pid"] and summary["culprits"][0]["node"] == "hs-a"

        restart = node.wait_event("restart")
        assert restart["reason"] == "hang"
        _finished(c, ["hs-a"], 50)
        resumed = [e for e in node.events("resumed")]
        assert any(e["step"] == 20 for e in resumed), c.diagnostics()


def _worker_pids(node: Node) -> list[int]:
    started = node.wait_event("workers_started")
    return list(started["pids"])


def test_sigstopped_worker_is_detected_as_a_hang_and_named(etcd: EmbeddedEtcd, tmp_path: Path) -> None:
    with Cluster(
        etcd.endpoint,
        tmp_path,
        run_id="hang-stop",
        nproc_per_node=2,
        script_args=train_args(50, 0.05),
        extra=("--hang-timeout", "2"),
    ) as c:
        node = c.start("st-a")
        c.wait_step(lambda s: s["step"] >= 15, what="step 15")
        victim = _worker_pids(node)[-1]
        os.kill(victim, signal.SIGSTOP)
        try:
            diagnosed = node.wait_event("hang_diagnosed", timeout_s=60)
            summary = _summary(diagnosed)
            assert [c["pid"] for c in summary["culprits"]] == [victim], summary["culprits"]
            assert summary["culprits"][0]["state"] == "stopped"
            assert "stopped" in summary["reason"]
            _finished(c, ["st-a"], 50)
            assert not psutil.pid_exists(victim) or psutil.Process(victim).status() == psutil.STATUS_ZOMBIE
        finally:
            if psutil.pid_exists(victim):
                os.kill(victim, signal.SIGKILL)


def test_hang_at_the_same_step_every_time_stops_with_exit_1_and_the_diagnostics_path(
    etcd: EmbeddedEtcd, tmp_path: Path
) -> None:
    with Cluster(
        etcd.endpoint,
        tmp_path,
        run_id="hang-again",
        nproc_per_node=2,
        script_args=train_args(50, 0.05),
        extra=("--hang-timeout", "1", "--hang-attempts", "2"),
        env={"ELASTICD_FAULT": "sleep@step=15,rank=1"},  # every attempt: a deterministic hang
    ) as c:
        node = c.start("ha-a")
        code = node.wait(150)
        assert code == 1, c.diagnostics()
        diagnoses = node.events("hang_diagnosed")
        assert [d["attempt"] for d in diagnoses] == [1, 2]
        assert {d["step"] for d in diagnoses} == {15}
        gave_up = node.events("gave_up")[-1]
        assert gave_up["reason"] == "hang"
        last = diagnoses[-1]["path"]
        assert f"Diagnostics: {last}" in gave_up["message"]
        assert "2 times in a row" in gave_up["message"]
        assert _summary(diagnoses[-1])["attempt"] == 2
        assert [e["reason"] for e in node.events("restart")] == ["hang"]
        wait_until(lambda: not leftover_processes(["ha-a"]), 15, "worker processes to exit")


def _stragglers(tmp_path: Path, etcd: Any, run_id: str, fault: str) -> list[dict[str, Any]]:
    with Cluster(
        etcd.endpoint,
        tmp_path / run_id,
        run_id=run_id,
        nproc_per_node=2,
        script_args=train_args(60, 0.02),
        extra=("--straggler-window", "2"),
        env={"ELASTICD_FAULT": fault},
    ) as c:
        node = c.start(f"{run_id}-a")
        _finished(c, [node.name], 60)
        assert not node.events("hang_detected"), c.diagnostics()
        return node.events("straggler_detected")


def test_slow_rank_is_reported_as_a_straggler_and_a_uniformly_slow_group_is_not(
    etcd: EmbeddedEtcd, tmp_path: Path
) -> None:
    (tmp_path / "one").mkdir()
    (tmp_path / "all").mkdir()
    one = _stragglers(tmp_path, etcd, "one", "slow@rank=1,seconds=0.15")
    assert one and {e["rank"] for e in one} == {1}, one
    assert one[0]["ratio"] >= 1.5
    everyone = _stragglers(tmp_path, etcd, "all", "slow@seconds=0.15")
    assert everyone == []


def test_two_daemons_agree_on_one_diagnosis_through_etcd(etcd: EmbeddedEtcd, tmp_path: Path) -> None:
    with Cluster(
        etcd.endpoint,
        tmp_path,
        run_id="hang-agree",
        min_nodes=2,
        max_nodes=2,
        script_args=train_args(50, 0.05),
        extra=("--hang-timeout", "2"),
        env={"ELASTICD_FAULT": "sleep@step=25,rank=1,restart=0"},
    ) as c:
        a, b = c.start("ag-a"), c.start("ag-b")
        # the culprit's node tells the group as soon as it acts; the other's worker may fail on that notice (and, two
        # nodes being the minimum, fall back) before its daemon logs the agreed diagnosis: it then restarts for a
        # failure. Every diagnosis logged is the same one, and at least one node logs it.
        first = wait_until(
            lambda: next((n.events("hang_diagnosed")[-1] for n in (a, b) if n.events("hang_diagnosed")), None),
            90,
            "a node to diagnose the hang",
        )
        time.sleep(3)  # the other node's verdict, if it comes
        verdicts = [d for n in (a, b) for d in n.events("hang_diagnosed")]
        assert all(d["path"] == first["path"] and d["culprit_ranks"] == [1] for d in verdicts), verdicts
        for node in (a, b):
            if not node.events("hang_diagnosed"):
                assert [e["reason"] for e in node.events("restart")][:1] == ["failure"], node.tail()
        da = first
        summary = _summary(da)
        assert summary["nodes_reported"] == ["ag-a", "ag-b"] and summary["nodes_missing"] == []
        culprit_node = summary["culprits"][0]["node"]
        ranks = {n.name: n.events("rendezvous_done")[0]["group_rank"] for n in (a, b)}
        assert ranks[culprit_node] == 1  # one worker per node: global rank 1 lives on group rank 1
        for name in ("ag-a", "ag-b"):
            assert (Path(da["path"]) / f"node-{name}" / "evidence.json").exists()
        _finished(c, ["ag-a", "ag-b"], 50)


def test_auto_timeout_no_false_hang_when_step_times_vary_3x_and_the_run_checkpoints(
    etcd: EmbeddedEtcd, tmp_path: Path
) -> None:
    with Cluster(
        etcd.endpoint,
        tmp_path,
        run_id="hang-auto",
        nproc_per_node=2,
        script_args=train_args(80, 0.05),
        extra=("--hang-timeout", "auto", "--checkpoint-every-steps", "5"),
        env={"ELASTICD_FAULT": "jitter@seconds=0.1"},  # 50-150 ms steps
    ) as c:
        node = c.start("au-a")
        _finished(c, ["au-a"], 80)
        assert not node.events("hang_detected"), c.diagnostics()
        assert not node.events("restart")
        times = [e for e in read_json_lines(node.out) if e.get("event") == "step"]
        assert len(times) >= 80


SCRIPT = Path(__file__).parent / "scripts" / "evaluating_train.py"


@pytest.mark.parametrize("busy", [True, False], ids=["inside-run-busy", "unmarked"])
def test_long_evaluation_between_steps_is_no_hang_inside_run_busy(
    etcd: EmbeddedEtcd, tmp_path: Path, busy: bool
) -> None:
    args = ("--steps", "30", "--eval-at", "15", "--eval-seconds", "4", *(["--busy"] if busy else []))
    with Cluster(
        etcd.endpoint,
        tmp_path,
        run_id=f"busy-{busy}",
        nproc_per_node=2,
        script=SCRIPT,
        script_args=args,
        extra=("--hang-timeout", "auto", "--hang-attempts", "1"),
    ) as c:
        node = c.start("bz-a")
        code = node.wait(120)
        if busy:
            assert code == 0 and not node.events("hang_detected"), c.diagnostics()
            assert c.newest_step()["step"] == 30
        else:
            # the same pause without run.busy() looks exactly like a hang to a watchdog that learned 50 ms steps
            assert node.events("hang_detected") and node.events("hang_diagnosed"), c.diagnostics()
            assert code == 1


def _diagnostics(cluster: Cluster) -> list[Path]:
    root = cluster.checkpoint_dir / cluster.run_id / "diagnostics"
    return sorted(p for p in root.glob("*-hang")) if root.exists() else []


def _restart_reasons(node: Node) -> list[str]:
    return [e["reason"] for e in node.events("restart")]


def test_node_killed_under_auto_timeout_is_a_failure_for_the_survivors_not_a_hang(
    etcd: EmbeddedEtcd, tmp_path: Path
) -> None:
    # Issue 10, Why 13: kill -9 of a whole node. The survivors' all-reduce fails and their workers exit, which takes
    # a second or two of teardown: longer than an auto timeout learned from 50 ms steps. That silence is a failure
    # on its way (restart reason `failure`), not a hang: no diagnosis, no diagnostics directory.
    with Cluster(
        etcd.endpoint,
        tmp_path,
        run_id="loss-auto",
        min_nodes=2,
        max_nodes=3,
        # killed at step 30+: the survivors resume from the newest checkpoint (step 20 or 30) and train 70+ at world 2
        script_args=train_args(100, 0.05),
        extra=("--hang-timeout", "auto"),
    ) as c:
        a, b, victim = c.start("la-a"), c.start("la-b"), c.start("la-c")
        c.wait_step(lambda s: s["world_size"] == 3 and s["step"] >= 30, timeout_s=150, what="30 steps at world 3")
        victim.kill()
        killed_at = time.time()
        c.wait_step(lambda s: s["world_size"] == 2 and s["t"] > killed_at, timeout_s=120, what="a step at world 2")
        for node in (a, b):
            reasons = _restart_reasons(node)
            # hot (the default): the survivors re-form in place, no restart at all; cold: a restart for `failure`
            in_place = [e for e in node.events("reconfigured") if e["reason"] == "failure"]
            assert in_place or (reasons and reasons[-1] == "failure"), (node.name, reasons, c.diagnostics())
            assert "hang" not in reasons, (node.name, reasons)
            assert not node.events("hang_diagnosed"), c.diagnostics()
            assert [e["lost_node"] for e in node.events("node_lost")] == ["la-c"]
        assert _diagnostics(c) == [], c.diagnostics()
        _finished(c, ["la-a", "la-b"], 100)


# Long enough for the stopped node to rejoin after SIGCONT before the run ends: it is continued right after the
# first steps at world 2 (step ~31), and the others keep training at ~0.07 s a step until its rejoin restarts them
# (2-3 s after SIGCONT, ~40 steps): 200 steps leave a margin of over 100.
STOP_STEPS = 200
# The least time the whole node stays stopped: several times the rendezvous' 3 s eviction, and past the hang
# agreement's report wait (elasticd/agent/agreement.py, 5 s).
MIN_STOP_S = 10.0


@pytest.mark.timeout(360)
def test_whole_node_stopped_is_the_culprit_and_its_late_report_counts_for_nothing(
    etcd: EmbeddedEtcd, etcd_client: EtcdClient, tmp_path: Path
) -> None:
    # Issue 10, Why 12: a whole node (daemon and worker) SIGSTOPped for longer than the rendezvous keeps it, then
    # SIGCONT. The others' workers wait in the all-reduce for it: a hang, whose culprit is the frozen node (its
    # heartbeat is stale and it sends no evidence), not the nodes that waited. The frozen node wakes up to a run
    # that went on without it: its late report must not count as a second hang at the same step. It stays stopped
    # until the others have diagnosed the hang and trained at world 2 in a round without it (the rendezvous evicted
    # it: 3 s without a heartbeat), and at least MIN_STOP_S.
    with Cluster(
        etcd.endpoint,
        tmp_path,
        run_id="stop-node",
        min_nodes=2,
        max_nodes=3,
        script_args=train_args(STOP_STEPS, 0.05),
        # the cold path's diagnosis of a frozen node; in place (the default) its one-second liveness lease usually
        # expires first and no hang is diagnosed at all (tests/integration/test_hot_recovery.py)
        extra=("--hang-timeout", "auto", "--recovery", "cold"),
    ) as c:
        a, b, victim = c.start("sn-a"), c.start("sn-b"), c.start("sn-c")
        c.wait_step(lambda s: s["world_size"] == 3 and s["step"] >= 30, timeout_s=150, what="30 steps at world 3")
        frozen = victim.freeze()
        stopped_at = time.time()
        try:
            c.wait_step(lambda s: s["world_size"] == 2 and s["t"] > stopped_at, timeout_s=90, what="world 2")
            # the first node to act on the agreed diagnosis kills its worker (cold); the other's worker may then fail
            # on the closed connection before its own daemon logs the diagnosis, and it restarts for that failure:
            # the same outcome, so either waiting node's diagnosis is the one checked
            diagnosed = wait_until(
                lambda: next((n.events("hang_diagnosed")[-1] for n in (a, b) if n.events("hang_diagnosed")), None),
                30,
                "a waiting node to diagnose the hang",
            )
            time.sleep(max(0.0, stopped_at + MIN_STOP_S - time.time()))
        finally:
            for p in frozen:
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.send_signal(signal.SIGCONT)
        summary = _summary(diagnosed)
        assert summary["culprit_nodes"] == ["sn-c"], summary
        assert summary["nodes_missing"] == ["sn-c"] and summary["cause"] == "node_lost", summary
        assert "stopped or dead" in summary["reason"] or "evicted" in summary["reason"], summary["reason"]
        assert summary["attempt"] == 0 and not summary["counted"]
        verdicts = [d["culprit_nodes"] for node in (a, b) for d in node.events("hang_diagnosed")]
        assert verdicts and all(v == ["sn-c"] for v in verdicts) and len(verdicts) <= 2, c.diagnostics()
        for node in (a, b):  # a node that did not diagnose restarted for its worker's failure, never for a hang
            if not node.events("hang_diagnosed"):
                assert [e["reason"] for e in node.events("restart")][:1] == ["failure"], node.tail()

        _finished(c, ["sn-a", "sn-b", "sn-c"], STOP_STEPS)
        # the woken node reported nothing that counts: no diagnosis of its own, one diagnostics directory in all,
        # and no repeat recorded (a lost node never counts toward --hang-attempts)
        assert not victim.events("hang_diagnosed"), victim.tail()
        assert _diagnostics(c) == [Path(diagnosed["path"])]
        assert etcd_client.get(RunKeys("stop-node").hang_last) is None
        assert all(n.events("rendezvous_done")[-1]["world_size"] == 3 for n in (a, b, victim)), c.diagnostics()
