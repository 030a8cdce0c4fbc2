"""``elasticd start`` end to end: embedded etcd, status, drain, an unreachable etcd, an etcd restart mid-run."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elasticd.etcd.server import EmbeddedEtcd
from tests.helpers import etcd_value
from tests.integration.cluster import EXAMPLE, Cluster, leftover_processes, train_args, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def elasticd(*args: str, cwd: Path, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.run(
        [sys.executable, "-m", "elasticd", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def test_single_node_run_on_embedded_etcd_finishes_and_commits_checkpoints(tmp_path: Path) -> None:
    result = elasticd(
        "start",
        "--nproc-per-node",
        "2",
        "--metrics-port",
        "0",
        "--log-format",
        "json",
        "--run-id",
        "solo",
        "--checkpoint-every-steps",
        "10",
        str(EXAMPLE),
        *train_args(20, 0.0),
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    steps = [json.loads(line) for line in result.stdout.splitlines() if line.startswith('{"event": "step"')]
    assert steps[-1]["step"] == 20 and steps[-1]["world_size"] == 2
    events = [json.loads(line)["event"] for line in result.stderr.splitlines() if line.startswith("{")]
    assert {"embedded_etcd_started", "daemon_started", "rendezvous_done", "workers_started", "exit"} <= set(events)
    committed = sorted(p.name for p in (tmp_path / "checkpoints" / "solo").iterdir())
    assert committed == ["step-000000000010", "step-000000000020"]
    manifest = json.loads((tmp_path / "checkpoints" / "solo" / "step-000000000020" / "elasticd.json").read_text())
    assert manifest["step"] == 20 and manifest["world_size"] == 2 and manifest["global_batch_size"] == 48


def test_same_run_id_can_run_again_after_it_finished_and_says_there_is_nothing_left(
    etcd: EmbeddedEtcd, tmp_path: Path
) -> None:
    # the second start resumes at the last step and trains nothing: it says so, with how to train again (issue 27)
    for attempt in range(2):
        with Cluster(etcd.endpoint, tmp_path, run_id="again", script_args=train_args(10)) as c:
            node = c.start(f"again-{attempt}")
            assert node.wait(90) == 0, node.tail()
            finished = node.events("run_already_finished")
            if attempt == 0:
                assert finished == [], finished
            else:
                assert [e["step"] for e in finished] == [10], node.tail()
                assert "another --run-id" in finished[0]["message"]


def test_unreachable_etcd_fails_fast_naming_the_endpoint(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: connections are refused
        started = time.monotonic()
        result = elasticd(
            "start",
            "--etcd",
            f"127.0.0.1:{port}",
            "--etcd-connect-timeout",
            "2",
            "--metrics-port",
            "0",
            str(EXAMPLE),
            cwd=tmp_path,
        )
    assert result.returncode == 2
    assert time.monotonic() - started < 20
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"127.0.0.1:{port}" in lines[0] and "Traceback" not in result.stderr


def test_status_shows_nodes_round_world_size_and_step_then_stop_drains(etcd: EmbeddedEtcd, tmp_path: Path) -> None:
    with Cluster(
        etcd.endpoint,
        tmp_path,
        run_id="stat",
        min_nodes=2,
        max_nodes=2,
        script_args=train_args(1000, 0.05),
    ) as c:
        c.start("st-a"), c.start("st-b")
        c.wait_step(lambda s: s["step"] >= 10, what="step 10")

        def running() -> dict | None:
            out = elasticd("status", "--etcd", etcd.endpoint, "--run-id", "stat", "--json", cwd=tmp_path)
            assert out.returncode == 0, out.stderr
            status = json.loads(out.stdout)
            ok = status["node_count"] == 2 and status["health"] == "ok" and (status["step"] or 0) > 0
            return status if ok else None

        status = wait_until(running, 30, "status to show 2 healthy nodes with a step", poll_s=0.5)
        assert status["world_size"] == 2 and isinstance(status["round"], int)
        assert {n["node_id"] for n in status["nodes"]} == {"st-a", "st-b"}
        assert all(n["pid"] == c.nodes[n["node_id"]].proc.pid for n in status["nodes"])
        table = elasticd("status", "--etcd", etcd.endpoint, "--run-id", "stat", cwd=tmp_path)
        assert table.returncode == 0 and "st-a" in table.stdout and "health ok" in table.stdout

        stop = elasticd("stop", "--etcd", etcd.endpoint, "--run-id", "stat", cwd=tmp_path)
        assert stop.returncode == 0, stop.stderr
        for name in ("st-a", "st-b"):
            assert c.nodes[name].wait(60) == 0, c.diagnostics()
            assert c.nodes[name].events("draining")
        # one checkpoint, the same step on both nodes, committed before anyone stopped
        saved = {c.nodes[name].events("checkpoint_saved")[-1]["step"] for name in ("st-a", "st-b")}
        assert len(saved) == 1, saved
        assert (c.checkpoint_dir / "stat" / f"step-{saved.pop():012d}" / "elasticd.json").exists()
        wait_until(lambda: not leftover_processes(["st-a", "st-b"]), 15, "workers to exit")
        after = elasticd("status", "--etcd", etcd.endpoint, "--run-id", "stat", "--json", cwd=tmp_path)
        assert json.loads(after.stdout)["node_count"] == 0  # the records went with the daemons' leases


def test_training_continues_through_an_etcd_restart(etcd: EmbeddedEtcd, tmp_path: Path) -> None:
    with Cluster(
        etcd.endpoint,
        tmp_path,
        run_id="etcdrestart",
        min_nodes=2,
        max_nodes=2,
        script_args=train_args(120),
    ) as c:
        c.start("er-a"), c.start("er-b")
        c.wait_step(lambda s: s["step"] >= 10, what="step 10")
        etcd.restart()
        mark = c.newest_step()["step"]
        c.wait_step(lambda s: s["step"] >= mark + 20, what="20 more steps after the restart")

        def registry_back() -> bool:
            out = elasticd("status", "--etcd", etcd.endpoint, "--run-id", "etcdrestart", "--json", cwd=tmp_path)
            return out.returncode == 0 and json.loads(out.stdout)["node_count"] == 2

        wait_until(registry_back, 30, "both node records after the etcd restart", poll_s=0.5)
        for name in ("er-a", "er-b"):
            assert c.nodes[name].wait(120) == 0, c.diagnostics()
        assert c.newest_step()["step"] == 120
        assert not [e for n in c.nodes.values() for e in n.events("restart")]


def test_sigterm_leaves_after_a_checkpoint_and_the_others_go_on_losing_no_step(
    etcd: EmbeddedEtcd, tmp_path: Path
) -> None:
    with Cluster(
        etcd.endpoint,
        tmp_path,
        run_id="sigterm",
        min_nodes=2,
        max_nodes=3,
        script_args=train_args(1000),
        # the cold leave (checkpoint first); in place: tests/integration/test_invariance.py
        extra=("--recovery", "cold"),
    ) as c:
        for name in ("tm-a", "tm-b", "tm-c"):
            c.start(name)
        c.wait_step(lambda s: s["world_size"] == 3 and s["step"] >= 5, what="3 workers")
        victim = c.nodes["tm-c"]
        victim.proc.send_signal(signal.SIGTERM)
        assert victim.wait(60) == 0, c.diagnostics()
        assert victim.events("draining")[-1]["scope"] == "node"
        saved = victim.events("checkpoint_saved")[-1]["step"]
        assert "Traceback" not in victim.err.read_text()
        wait_until(lambda: not leftover_processes(["tm-c"]), 15, "tm-c's workers to exit")
        # the two others restart from exactly the checkpoint taken for the leave: no completed step is lost
        for name in ("tm-a", "tm-b"):
            c.nodes[name].wait_event("resumed", where=lambda e: e["step"] == saved)
            assert c.nodes[name].events("restart")[-1]["reason"] == "membership"
        # the step that took the checkpoint parks inside run.step() before the script prints it
        before = [s["step"] for s in c.all_steps() if s["world_size"] == 3]
        assert max(before) in (saved - 1, saved)
        c.wait_step(lambda s: s["world_size"] == 2 and s["step"] > saved, timeout_s=60, what="2 workers go on")


def test_elasticd_etcd_serves_the_v3_api_until_sigterm(tmp_path: Path) -> None:
    from elasticd.endpoints import parse_endpoints
    from elasticd.etcd.access import resolve_access
    from elasticd.etcd.client import EtcdClient
    from elasticd.etcd.server import free_port

    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "elasticd", "etcd", "--port", str(port), "--data-dir", str(tmp_path / "d")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        banner, flags = proc.stdout.readline(), proc.stdout.readline().split()
        assert f"127.0.0.1:{port}" in banner and "only this user can log in" in banner
        assert flags[:4] == ["--etcd", f"127.0.0.1:{port}", "--etcd-user", "root"], flags
        access = resolve_access(user=flags[3], password_file=flags[5])
        client = EtcdClient.connect(
            parse_endpoints(f"127.0.0.1:{port}"), connect_timeout_s=10, **access.connect_kwargs()
        )
        client.put("/probe", b"1")
        assert etcd_value(client, "/probe") == b"1"
        client.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_elasticd_etcd_on_a_busy_port_is_a_usage_error(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = elasticd("etcd", "--port", str(port), cwd=tmp_path, timeout_s=30)
    assert result.returncode == 2
    assert result.stderr.strip() == f"elasticd: error: --port: port {port} on 127.0.0.1 is already in use"


def test_plain_accelerate_script_without_the_library_runs_under_elasticd(tmp_path: Path) -> None:
    plain = EXAMPLE.parent / "plain_train.py"
    result = elasticd(
        "start", "--nproc-per-node", "2", "--metrics-port", "0", "--log-format", "json", "--run-id", "plain",
        str(plain), "--epochs", "1", "--dataset-size", "192", "--checkpoint-every", "2",
        "--checkpoint-dir", str(tmp_path / "plain-ckpt"),
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    steps = [json.loads(line) for line in result.stdout.splitlines() if line.startswith('{"event": "step"')]
    assert steps[-1]["step"] == 4  # 192 samples, global batch 48: accelerate's own loop on 2 gloo ranks
    assert (tmp_path / "plain-ckpt" / "model.safetensors").exists()  # accelerate's save_state, as the script does
