"""Storage faults on real processes (issue 10, Why 4, 6 and 12): a checkpoint disk that fills up, one that is or
turns read-only, and hang diagnostics written to a full disk.

Each test mounts a small tmpfs as the checkpoint directory (tests/integration/mounts.py; root only, skipped
elsewhere), runs examples/train.py under real ``elasticd start`` processes against a real etcd, and reads what the
operator would: the daemon's events (JSON on its stderr; the workers' own log lines share that file but carry no
``node_id``), the checkpoint directory, the exit codes, the metrics endpoint.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import psutil
import pytest

from elasticd.etcd.server import EmbeddedEtcd
from tests.helpers import free_port
from tests.integration import mounts
from tests.integration.cluster import EXAMPLE, Cluster, Node, train_args, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def committed(run_dir: Path) -> list[int]:
    """Steps of the committed checkpoints (``step-N`` with a manifest)."""
    if not run_dir.is_dir():
        return []
    return sorted(
        int(p.name[len("step-") :])
        for p in run_dir.iterdir()
        if p.name.startswith("step-") and p.name[len("step-") :].isdigit() and (p / "elasticd.json").is_file()
    )


def partials(run_dir: Path, step: int | None = None) -> list[Path]:
    """Partial (being written, or left behind) directories, of ``step`` or of any step."""
    pattern = f"step-{step:012d}*.partial" if step is not None else "step-*.partial"
    return sorted(run_dir.glob(pattern)) if run_dir.is_dir() else []


def daemon_events(node: Node, name: str) -> list[dict[str, Any]]:
    """The daemon's own events (bound to its node id), not the workers' lines in the same file."""
    return [e for e in node.events(name) if "node_id" in e]


def worker_events(node: Node, name: str) -> list[dict[str, Any]]:
    return [e for e in node.events(name) if "node_id" not in e and "rank" in e]


def failures_total(port: int) -> float:
    """``elasticd_checkpoint_failures_total`` summed over its labels, from the daemon's metrics endpoint."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("elasticd_checkpoint_failures_total")
    )


def test_full_disk_fails_saves_cleanly_training_goes_on_and_a_restart_resumes_from_the_last_commit(
    etcd: EmbeddedEtcd,
    tmp_path: Path,
) -> None:
    port = free_port()
    # 200 inodes: the checkpoints need ~30; the rest are taken in the second phase, when even mkdir fails.
    with (
        mounts.tmpfs(tmp_path / "checkpoints", 1024, nr_inodes=200) as disk,
        Cluster(etcd.endpoint, tmp_path, run_id="full", nproc_per_node=2, script_args=train_args(120, 0.05)) as c,
    ):
        run_dir = disk / "full"
        node = c.start("df-a", "--metrics-port", str(port))
        wait_until(lambda: 10 in committed(run_dir), 90, "the first commit")

        # 1. Every block taken: the next saves make their partial dir but cannot write its files.
        mounts.fill(disk)

        def enospc(e: dict[str, Any]) -> bool:
            return e.get("errno") == "ENOSPC" and e["step"] > 10

        first = node.wait_event("checkpoint_failed", 60, where=lambda e: "node_id" in e and enospc(e))
        assert first["path"] and str(run_dir) in first["path"], first
        assert [e for e in worker_events(node, "checkpoint_failed") if enospc(e)], "no worker log line names ENOSPC"
        assert not partials(run_dir, first["step"]), "a failed save left its partial directory behind"
        assert failures_total(port) >= 1

        # 2. Every inode taken too: now the partial dir itself cannot be made (as on a full ext4 disk). This was
        # the crash loop: rank 0's mkdir raised out of the save, and every restart died at the same step.
        mounts.exhaust_inodes(disk)
        mkdir_failed = node.wait_event(
            "checkpoint_failed",
            60,
            # mkdir's own OSError (the writes fail inside torch or safetensors, whose errors are no OSError)
            where=lambda e: (
                "node_id" in e and enospc(e) and e["step"] > first["step"] and e["error"].startswith("OSError")
            ),
        )
        assert mkdir_failed["path"].endswith(".partial"), mkdir_failed
        c.wait_step(lambda s: s["step"] > mkdir_failed["step"] + 2, 60, "training past the failed saves")
        assert not daemon_events(node, "restart"), c.diagnostics()
        failed_steps = {e["step"] for e in daemon_events(node, "checkpoint_failed")}
        assert all(not partials(run_dir, step) for step in failed_steps), partials(run_dir)

        # 3. Space back: saves commit again.
        mounts.free(disk)
        last_failed = max(failed_steps)
        wait_until(lambda: [s for s in committed(run_dir) if s > last_failed], 60, "a commit after the failures")

        # 4. A worker dies: the restart resumes from the last good commit and the run finishes.
        resumes = len(worker_events(node, "resumed"))
        os.kill(node.wait_event("workers_started")["pids"][0], signal.SIGKILL)
        node.wait_event("restart", 60)
        newest = max(committed(run_dir))
        wait_until(lambda: len(worker_events(node, "resumed")) >= resumes + 2, 90, "both ranks resumed")
        assert {e["step"] for e in worker_events(node, "resumed")[resumes:]} == {newest}, c.diagnostics()
        assert node.wait(150) == 0, c.diagnostics()
        assert c.newest_step()["step"] == 120
        assert len(daemon_events(node, "restart")) == 1  # the kill's, and no other
        assert not partials(run_dir)


@pytest.mark.parametrize("fault", ["read-only", "full"])
def test_unwritable_checkpoint_dir_at_start_is_one_line_and_exit_2(
    etcd: EmbeddedEtcd, tmp_path: Path, fault: str
) -> None:
    with mounts.tmpfs(tmp_path / "disk", 256) as disk:
        if fault == "read-only":
            mounts.remount(disk, "ro")
        else:
            mounts.fill(disk)
        checkpoint_dir = disk / "ck" if fault == "read-only" else disk
        cmd = [sys.executable, "-m", "elasticd", "start", "--etcd", etcd.endpoint, "--run-id", "rundir"]
        cmd += ["--checkpoint-dir", str(checkpoint_dir), "--metrics-port", "0", str(EXAMPLE), *train_args(10, 0)]
        result = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=60)
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert result.returncode == 2, result.stderr[-3000:]
        assert len(lines) == 1, result.stderr[-3000:]
        assert lines[0].startswith("elasticd: error: checkpoint directory ")
        assert str(checkpoint_dir / "rundir") in lines[0]
        assert ("EROFS" if fault == "read-only" else "ENOSPC") in lines[0], lines[0]


@pytest.mark.parametrize(
    ("fault", "saves"),
    # read-only: the partial dir cannot be made (rank 0 fails before any write); full, with blocking saves: the
    # files cannot be written, and the ranks agree on the failure through the collectives that were barriers
    [("read-only", "async"), ("full", "blocking")],
)
def test_checkpoint_dir_failing_mid_run_gives_events_not_restarts(
    etcd: EmbeddedEtcd, tmp_path: Path, fault: str, saves: str
) -> None:
    code = "EROFS" if fault == "read-only" else "ENOSPC"
    with (
        mounts.tmpfs(tmp_path / "checkpoints", 2048) as disk,
        Cluster(
            etcd.endpoint,
            tmp_path,
            run_id="midrun",
            nproc_per_node=2,
            script_args=train_args(100, 0.05),
            env={"ELASTICD_ASYNC_CHECKPOINTS": "1" if saves == "async" else "0"},
        ) as c,
    ):
        run_dir = disk / "midrun"
        node = c.start("mr-a")
        wait_until(lambda: 10 in committed(run_dir), 90, "the first commit")
        if fault == "read-only":
            mounts.remount(disk, "ro")
        else:
            mounts.fill(disk)
        try:

            def failed_steps() -> list[int]:
                return sorted({e["step"] for e in daemon_events(node, "checkpoint_failed") if e["errno"] == code})

            failed = wait_until(lambda: len(failed_steps()) >= 2 and failed_steps(), 90, f"two saves failing: {code}")
            c.wait_step(lambda s: s["step"] > failed[1] + 2, 60, "training past the failed saves")
            assert not daemon_events(node, "restart"), c.diagnostics()
            assert not daemon_events(node, "worker_failed"), c.diagnostics()
        finally:
            if fault == "read-only":
                mounts.remount(disk, "rw")
            else:
                mounts.free(disk)
        wait_until(lambda: [s for s in committed(run_dir) if s > failed[-1]], 60, "a commit once writable again")
        assert node.wait(150) == 0, c.diagnostics()
        assert c.newest_step()["step"] == 100
        assert not daemon_events(node, "restart") and not daemon_events(node, "worker_failed")
        assert not partials(run_dir)


def test_hang_with_a_full_checkpoint_disk_is_an_event_and_both_daemons_recover(
    etcd: EmbeddedEtcd, tmp_path: Path
) -> None:
    with (
        mounts.tmpfs(tmp_path / "checkpoints", 1024) as disk,
        Cluster(
            etcd.endpoint,
            tmp_path,
            run_id="hangfull",
            min_nodes=2,
            max_nodes=2,
            script_args=train_args(100, 0.05),
            extra=("--hang-timeout", "2"),
        ) as c,
    ):
        a, b = c.start("hf-a"), c.start("hf-b")
        wait_until(lambda: 10 in committed(disk / "hangfull"), 120, "the first commit")
        mounts.fill(disk)
        victim = b.wait_event("workers_started")["pids"][0]
        os.kill(victim, signal.SIGSTOP)  # b's worker freezes; a's waits for it in the all-reduce
        try:
            b.wait_event("hang_diagnosed", 90)  # a may diagnose it too, or see b's notice fail its step first
            write_failed = daemon_events(a, "diagnostics_write_failed") + daemon_events(b, "diagnostics_write_failed")
            assert write_failed, c.diagnostics()
            assert all("No space left on device" in e["error"] for e in write_failed), write_failed
            # the culprit's node restarts for the hang; the other re-forms in place without it, which leaves fewer
            # than --min-nodes: it falls back to the cold path (a restart for the failure of its worker)
            assert b.wait_event("restart", 60, where=lambda e: e["reason"] == "hang")
            assert a.wait_event("restart", 60, where=lambda e: e["reason"] in ("hang", "failure"))
            for node in (a, b):
                assert node.wait(150) == 0, c.diagnostics()  # the disk stayed full: saves failed, training went on
        finally:
            if psutil.pid_exists(victim):
                os.kill(victim, signal.SIGKILL)
        assert c.newest_step()["step"] == 100
        failed = daemon_events(a, "checkpoint_failed") + daemon_events(b, "checkpoint_failed")
        assert [e for e in failed if e["errno"] == "ENOSPC"], c.diagnostics()
