"""Sizes that fit, on real daemons, real etcd and real gloo workers: a node count that does not split the global batch
trains on the largest count that does while the other nodes wait as spares, and the run never dies of arithmetic.

Global batch 16 in micro-batches of 4, one worker per node, ``--min-nodes 2 --max-nodes 4``: 4 and 2 nodes split it,
3 do not. 4 train → kill -9 of one → 2 train and 1 waits as a spare (registry, ``elasticd status --json``, metric) →
a node joins → 4 train → the run is drained (``elasticd stop``), every sample of every epoch it completed trained
exactly once.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from elasticd.etcd.server import EmbeddedEtcd
from tests.helpers import free_port
from tests.integration.cluster import Cluster, leftover_processes, step_after, wait_until
from tests.integration.test_worker_library import effective_ids

pytestmark = [pytest.mark.integration, pytest.mark.timeout(480)]

DATASET, GLOBAL_BATCH, MICRO = 160, 16, 4
# longer than the test, which drains the run once 4 train again: a joiner's start took 20-25 s on a loaded host, and
# an 8-epoch run ended before it (seen in the suite)
EPOCHS = 100
STEPS_PER_EPOCH = DATASET // GLOBAL_BATCH


def status(etcd: str, run_id: str, cwd: Path) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "elasticd", "status", "--etcd", etcd, "--run-id", run_id, "--json"],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return dict(json.loads(done.stdout))


def spare_gauge(port: int) -> float | None:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        for line in response.read().decode().splitlines():
            if line.startswith("elasticd_spare "):
                return float(line.split()[1])
    return None


def test_kill_one_of_four_leaves_two_training_and_a_spare_that_steps_in_at_the_next_join(
    etcd: EmbeddedEtcd, tmp_path: Path
) -> None:
    record = tmp_path / "ids.jsonl"
    args = (
        "--epochs", str(EPOCHS), "--dataset-size", str(DATASET), "--global-batch", str(GLOBAL_BATCH),
        "--micro-batch", str(MICRO), "--sleep", "0.15", "--record-ids", str(record),
    )  # fmt: skip
    ports: dict[str, int] = {}
    with Cluster(etcd.endpoint, tmp_path, run_id="spares", min_nodes=2, max_nodes=4, script_args=args) as c:

        def start(name: str) -> None:
            ports[name] = free_port()
            c.start(name, "--metrics-port", str(ports[name]))  # a later --metrics-port wins over the harness's 0

        for name in ("sp-0", "sp-1", "sp-2", "sp-3"):
            start(name)
        c.wait_step(lambda s: s["world_size"] == 4 and s["step"] >= 4, timeout_s=120, what="4 workers at step 4")
        c.nodes["sp-1"].kill()  # 4 -> 3 nodes, and 3 do not split 16 in micro-batches of 4

        def one_spare() -> dict[str, Any] | None:
            seen = status(etcd.endpoint, "spares", tmp_path)
            return seen if len(seen["spares"]) == 1 and seen["node_count"] == 3 else None

        seen = wait_until(one_spare, 120, "one node of three waiting as a spare", poll_s=1.0)
        spare = seen["spares"][0]
        trainers = sorted({"sp-0", "sp-2", "sp-3"} - {spare})
        record_of = {n["node_id"]: n for n in seen["nodes"]}
        assert record_of[spare]["state"] == "spare" and record_of[spare]["health"] == "spare"
        assert seen["health"] == "ok" and seen["world_size"] == 2, seen
        mark = c.wait_step(lambda s: s["world_size"] == 2, timeout_s=90, what="2 workers")["step"]
        c.wait_step(lambda s: s["world_size"] == 2 and s["step"] >= mark + 3, timeout_s=60, what="2 workers train on")
        assert spare_gauge(ports[spare]) == 1.0
        assert {spare_gauge(ports[name]) for name in trainers} == {0.0}
        assert not c.nodes[spare].worker_pids(), "a spare runs no workers"
        warnings = [e for e in c.nodes[spare].events("batch_does_not_fit") if e["spare"]]
        assert warnings and warnings[-1]["training_nodes"] == 2 and warnings[-1]["nodes"] == 3
        assert "global batches that fit every node count in 2..4: 48, 96, 144" in warnings[-1]["message"]

        joined_at = time.time()
        start("sp-4")  # 3 -> 4 nodes: the spare steps in
        # a step printed since (the first round's steps at 4 are older: the group resumed from an earlier step)
        again = c.wait_step(step_after(joined_at, 4), timeout_s=150, what="4 workers again")
        c.wait_step(lambda s: s["step"] >= again["step"] + 5, timeout_s=60, what="4 workers train on")
        c.stop_run()
        alive = ["sp-0", "sp-2", "sp-3", "sp-4"]
        for name in alive:
            assert c.nodes[name].wait(300) == 0, c.diagnostics()
        wait_until(lambda: not leftover_processes(list(c.nodes)), 15, "no process left")

        steps = c.all_steps()
        assert {s["world_size"] for s in steps} == {2, 4}  # never 3: 3 workers cannot split the batch
        # the global batch holds at 2 and at 4: the samples the ranks recorded for each step, not the step line's own
        # arithmetic (160 samples in batches of 16: no step is padded)
        trained = effective_ids(record)
        last = steps[-1]["step"]  # the drain's (a step in flight then may be recorded by some ranks only)
        assert {step: len(ids) for step, ids in trained.items() if len(ids) != GLOBAL_BATCH and step <= last} == {}
        for name in alive:
            assert not c.nodes[name].events("gave_up"), c.nodes[name].tail()
            assert c.nodes[name].events("draining"), c.nodes[name].tail()
        assert_exactly_once(record, last)


def assert_exactly_once(record: Path, last_step: int) -> None:
    """Steps 1..``last_step`` were trained; every epoch they complete saw each sample once, a last partial one none
    twice. The ranks may have recorded the samples of one step more: the one in flight when the drain parked them."""
    ids = effective_ids(record)
    assert set(ids) - set(range(1, last_step + 1)) <= {last_step + 1}, sorted(ids)[-3:]
    ids = {step: trained for step, trained in ids.items() if step <= last_step}
    assert sorted(ids) == list(range(1, last_step + 1)), "a step is missing"
    for epoch in range(-(-last_step // STEPS_PER_EPOCH)):
        first = epoch * STEPS_PER_EPOCH + 1
        seen = [i for s in range(first, min(first + STEPS_PER_EPOCH, last_step + 1)) for i in ids[s]]
        if first + STEPS_PER_EPOCH - 1 <= last_step:
            assert sorted(seen) == list(range(DATASET)), f"epoch {epoch}: samples skipped or repeated"
        else:
            assert len(seen) == len(set(seen)), f"epoch {epoch} (partial): a sample repeated"


def test_a_first_round_that_does_not_fit_reforms_with_a_spare_without_counting_a_restart(
    etcd: EmbeddedEtcd, tmp_path: Path
) -> None:
    # Nothing is recorded yet: the workers of the first round (3 nodes) find that 3 do not split the batch, report it
    # and exit; the daemons re-form with 2 training and 1 spare, and the spare finishes with the run (exit 0).
    record = tmp_path / "ids.jsonl"
    epochs = 2
    args = (
        "--epochs", str(epochs), "--dataset-size", str(DATASET), "--global-batch", str(GLOBAL_BATCH),
        "--micro-batch", str(MICRO), "--sleep", "0.05", "--record-ids", str(record),
    )  # fmt: skip
    names = ["fr-0", "fr-1", "fr-2"]
    # a long last call, so that the first round holds all three nodes however slowly each one starts
    extra = ("--rdzv-conf", "last_call_timeout=8")
    with Cluster(
        etcd.endpoint, tmp_path, run_id="firstfit", min_nodes=2, max_nodes=4, script_args=args, extra=extra
    ) as c:
        for name in names:
            c.start(name)
        codes = {name: c.nodes[name].wait(300) for name in names}
        assert codes == dict.fromkeys(names, 0), c.diagnostics()
        first = [e for name in names for e in c.nodes[name].events("rendezvous_done") if e["round"] == 0]
        assert [e["nodes"] for e in first] == [3, 3, 3], first
        asked = [e for name in names for e in c.nodes[name].events("resize_requested")]
        # every worker that reached its first batch asked; one slower to start may be stopped first by its daemon,
        # whose round changed when the others exited (seen in CI under load: rank 0 never got that far)
        assert asked and {e["rank"] for e in asked} <= {0, 1, 2}
        assert all(e["fitting_nodes"] == [2, 4] for e in asked), asked
        assert not [e for name in names for e in c.nodes[name].events("worker_failed") if e["exitcode"] != 3]
        restarts = [e for name in names for e in c.nodes[name].events("restart")]
        assert restarts and {(e["reason"], e["restarts_left"]) for e in restarts} == {("membership", 20)}
        spares = [name for name in names if any(e["spare"] for e in c.nodes[name].events("batch_does_not_fit"))]
        assert len(spares) == 1, c.diagnostics()
        assert c.nodes[spares[0]].events("workers_finished")  # the spare saw the run finish and left with it
        assert {s["world_size"] for s in c.all_steps()} == {2}
        ids = effective_ids(record)
        for epoch in range(epochs):
            first_step = epoch * STEPS_PER_EPOCH + 1
            seen = [i for s in range(first_step, first_step + STEPS_PER_EPOCH) for i in ids[s]]
            assert sorted(seen) == list(range(DATASET)), f"epoch {epoch}: samples skipped or repeated"
