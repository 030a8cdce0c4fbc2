"""The worker library's promises, on real elasticd nodes, real gloo workers and real checkpoints on disk.

- a kill -9 in the middle of a checkpoint write, a truncated newest checkpoint, a ``.partial`` left behind;
- 3 → 2 (kill -9) → 4 (two joins) → 3 (SIGTERM): every sample of every epoch exactly once, a constant global
  batch, the same LR at every step, and joins and the drain losing no completed step;
- NaN injected once (skipped everywhere) and for good (rollback, then a stop with exit code 1).
"""

from __future__ import annotations

import json
import signal
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from elasticd.etcd.server import EmbeddedEtcd
from tests.integration.cluster import Cluster, leftover_processes, read_json_lines, train_args, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

DATASET, GLOBAL_BATCH = 480, 48


def expected_lr(step: int) -> float:
    """examples/train.py's schedule: AdamW lr 0.05 / (1 + 0.01 s), stepped once per optimizer step."""
    return 0.05 / (1.0 + 0.01 * step)


def effective_ids(record: Path) -> dict[int, list[int]]:
    """Sample ids trained per step, keeping only each step's last attempt: the (round, membership epoch) that got
    past it (a step that failed in place is tried again at the next epoch of the same round)."""
    by_step: dict[int, dict[tuple[int, int], list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for line in read_json_lines(record):
        by_step[line["step"]][(line["round"], line.get("epoch", 0))].append(line)
    result = {}
    for step, rounds in by_step.items():
        last = rounds[max(rounds)]
        result[step] = [i for line in last for i in line["ids"]]
    return result


def assert_exactly_once(record: Path, epochs: int) -> None:
    ids = effective_ids(record)
    steps_per_epoch = -(-DATASET // GLOBAL_BATCH)
    assert sorted(ids) == list(range(1, epochs * steps_per_epoch + 1)), "a step is missing"
    for epoch in range(epochs):
        seen = [i for s in range(epoch * steps_per_epoch + 1, (epoch + 1) * steps_per_epoch + 1) for i in ids[s]]
        assert sorted(seen) == list(range(DATASET)), f"epoch {epoch}: samples skipped or repeated"


def test_kill_during_checkpoint_write_resumes_from_the_previous_commit(etcd: EmbeddedEtcd, tmp_path: Path) -> None:
    # Rank 0 is killed (SIGKILL, by itself) after writing the files of step 20 but before committing them.
    with Cluster(
        etcd.endpoint,
        tmp_path,
        run_id="ckptkill",
        nproc_per_node=2,
        script_args=train_args(30, 0.0),
        env={"ELASTICD_FAULT": "kill@checkpoint=20,rank=0,round=0"},
    ) as c:
        node = c.start("ck-a")
        assert node.wait(150) == 0, node.tail()
        failed = node.events("worker_failed")
        assert failed and failed[0]["signal"] == "SIGKILL"
        resumed = [e["step"] for e in node.events("resumed")]
        assert resumed[-1] == 10, node.tail()  # the torn step-20 save was never loaded
        committed = sorted(p.name for p in (c.checkpoint_dir / "ckptkill").iterdir())
        assert committed == ["step-000000000010", "step-000000000020", "step-000000000030"]


def test_truncated_newest_checkpoint_falls_back_to_the_previous_with_a_warning(tmp_path: Path) -> None:
    from tests.integration.test_daemon_run import EXAMPLE, elasticd

    args = ["start", "--metrics-port", "0", "--log-format", "json", "--run-id", "trunc"]
    first = elasticd(*args, "--checkpoint-every-steps", "10", str(EXAMPLE), *train_args(20, 0.0), cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    run_dir = tmp_path / "checkpoints" / "trunc"
    newest = run_dir / "step-000000000020"
    optimizer = newest / "optimizer.bin"
    optimizer.write_bytes(optimizer.read_bytes()[: optimizer.stat().st_size // 2])  # a torn write
    (run_dir / "step-000000000030.partial").mkdir()
    (run_dir / "step-000000000030.partial" / "model.safetensors").write_bytes(b"garbage")
    second = elasticd(*args, "--checkpoint-every-steps", "10", str(EXAMPLE), *train_args(30, 0.0), cwd=tmp_path)
    assert second.returncode == 0, second.stderr[-3000:]
    events = [json.loads(line) for line in second.stderr.splitlines() if line.startswith("{")]
    unusable = [e for e in events if e.get("event") == "checkpoint_unusable"]
    assert unusable and "optimizer.bin" in unusable[0]["reason"]
    resumed = [e for e in events if e.get("event") == "resumed"]
    assert resumed and resumed[0]["step"] == 10  # the previous commit, not the torn one, not the partial
    assert not (run_dir / "step-000000000030.partial").exists() or (run_dir / "step-000000000030").exists()


def test_three_two_four_three_sees_every_sample_once_with_constant_batch_and_lr(
    etcd: EmbeddedEtcd, tmp_path: Path
) -> None:
    record = tmp_path / "ids.jsonl"
    # long enough that the run is still going when el-4 leaves: the 3 -> 2 change costs only a step in place, and
    # the two joiners' start (~10 s here) would otherwise take most of a shorter run
    epochs = 20
    with Cluster(
        etcd.endpoint,
        tmp_path,
        run_id="elastic",
        min_nodes=2,
        max_nodes=4,
        script_args=(*train_args(epochs * 10, 0.1), "--record-ids", str(record)),
        # the cold path (restarts from checkpoints) through every kind of change; in place: test_invariance.py
        extra=("--recovery", "cold"),
    ) as c:
        for name in ("el-0", "el-1", "el-2"):
            c.start(name)
        c.wait_step(lambda s: s["world_size"] == 3 and s["step"] >= 8, what="3 workers at step 8")
        c.nodes["el-2"].kill()  # 3 -> 2
        c.wait_step(lambda s: s["world_size"] == 2, timeout_s=60, what="2 workers")
        c.start("el-3"), c.start("el-4")  # 2 -> 4
        c.wait_step(lambda s: s["world_size"] == 4, timeout_s=90, what="4 workers")
        mark = c.newest_step()["step"]
        c.wait_step(lambda s: s["step"] >= mark + 3, what="a few steps at 4")
        c.nodes["el-4"].proc.send_signal(signal.SIGTERM)  # 4 -> 3
        assert c.nodes["el-4"].wait(60) == 0, c.diagnostics()
        survivors = ["el-0", "el-1", "el-3"]
        for name in survivors:
            assert c.nodes[name].wait(240) == 0, c.diagnostics()
        wait_until(lambda: not leftover_processes(list(c.nodes)), 15, "no process left")

        assert_exactly_once(record, epochs)
        steps = c.all_steps()
        sizes = {s["world_size"] for s in steps}
        assert {2, 3, 4} <= sizes
        trained = effective_ids(record)
        for s in steps:
            # the global batch holds at every size: the samples the ranks recorded for the step, not the step line's
            # own arithmetic (the last step of an epoch is padded: fewer valid samples)
            full = s["step"] % -(-DATASET // GLOBAL_BATCH) != 0 or DATASET % GLOBAL_BATCH == 0
            assert len(trained[s["step"]]) == (GLOBAL_BATCH if full else DATASET % GLOBAL_BATCH), s
            assert s["lr"] == pytest.approx(expected_lr(s["step"]), rel=1e-9)
        # planned changes (the joins, the SIGTERM) lost no completed step: in place (the default) nothing restarted,
        # cold they resumed from the step they saved
        for name in survivors:
            node = c.nodes[name]
            if node.events("reconfigured") and not node.events("restart"):
                continue
            saved = [e["step"] for e in node.events("checkpoint_saved")]
            resumed = {e["step"] for e in node.events("resumed")}
            assert saved and set(saved) <= resumed, (name, saved, resumed)


def test_nan_once_is_skipped_on_every_rank_and_the_run_completes(etcd: EmbeddedEtcd, tmp_path: Path) -> None:
    with Cluster(
        etcd.endpoint,
        tmp_path,
        run_id="nanonce",
        min_nodes=2,
        max_nodes=2,
        script_args=train_args(30, 0.0),
        env={"ELASTICD_FAULT": "nan@step=12,rank=1"},
    ) as c:
        c.start("no-a"), c.start("no-b")
        for name in ("no-a", "no-b"):
            assert c.nodes[name].wait(150) == 0, c.diagnostics()
        skipped = [e for n in c.nodes.values() for e in n.events("nonfinite_step")]
        assert sorted(e["rank"] for e in skipped) == [0, 1]  # both ranks skipped the same step
        assert {e["step"] for e in skipped} == {12} and {e["action"] for e in skipped} == {"skip"}
        steps = {s["step"]: s for s in c.all_steps()}
        assert steps[30]["loss"] == steps[30]["loss"]  # finite at the end (NaN != NaN)
        assert steps[12]["lr"] == steps[11]["lr"]  # the skipped step did not advance the schedule
        assert not [e for n in c.nodes.values() for e in n.events("restart")]


def test_persistent_nan_rolls_back_then_stops_with_exit_code_1(etcd: EmbeddedEtcd, tmp_path: Path) -> None:
    with Cluster(
        etcd.endpoint,
        tmp_path,
        run_id="nanforever",
        min_nodes=2,
        max_nodes=2,
        script_args=train_args(60, 0.0),
        env={"ELASTICD_FAULT": "nan@step=15-"},
    ) as c:
        c.start("nf-a"), c.start("nf-b")
        codes = [c.nodes[n].wait(150) for n in ("nf-a", "nf-b")]
        assert codes == [1, 1], c.diagnostics()
        a = c.nodes["nf-a"]
        assert a.events("rolled_back"), a.tail()
        gave_up = a.events("gave_up")[-1]
        assert "non-finite" in gave_up["message"] and "--on-nan rollback" in gave_up["message"]
        assert not a.events("restart")  # a fatal stop is not retried
        assert time.time() - a.started_at < 150


def test_global_batch_that_cannot_split_stops_the_run_with_exit_2_and_the_sizes_that_fit(tmp_path: Path) -> None:
    from tests.integration.test_daemon_run import EXAMPLE, elasticd

    result = elasticd(
        "start", "--nproc-per-node", "2", "--min-nodes", "1", "--max-nodes", "1", "--metrics-port", "0",
        "--log-format", "json", "--run-id", "badbatch",
        str(EXAMPLE), "--global-batch", "48", "--micro-batch", "5",
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    events = [json.loads(line) for line in result.stderr.splitlines() if line.startswith("{")]
    gave_up = [e for e in events if e.get("event") == "gave_up"]
    assert gave_up and "global batch 48" in gave_up[0]["message"] and "micro_batch_size" in gave_up[0]["message"]
    assert not [e for e in events if e.get("event") == "restart"]  # a configuration error is not retried
