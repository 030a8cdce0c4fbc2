"""The README's demo (``scripts/demo`` = ``python -m elasticd.demo``), run as a user runs it: real daemons on an
embedded etcd, a real kill -9, a real join. Off a terminal it prints JSON lines; every figure it reports must match
the job's own step lines, and a second run of the same run id says the run has finished and how to start another."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.integration.cluster import leftover_processes, read_json_lines

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

NODES = ["node-1", "node-2", "node-3", "node-4"]


def _demo(tmp_path: Path, run_id: str) -> tuple[subprocess.CompletedProcess[str], list[dict[str, Any]]]:
    done = subprocess.run(
        [sys.executable, "-m", "elasticd.demo", "--run-id", run_id],
        cwd=tmp_path, env=dict(os.environ, PYTHONUNBUFFERED="1"), capture_output=True, text=True, timeout=360,
    )  # fmt: skip
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return done, lines


def test_the_demo_loses_a_node_gains_one_and_reports_what_the_job_did(tmp_path: Path, _own_local_runs: Path) -> None:
    done, lines = _demo(tmp_path, "d")
    logs = tmp_path / "demo-logs" / "d"
    assert done.returncode == 0, (
        done.stderr
        + done.stdout
        + "".join((logs / f"{n}.err").read_text()[-3000:] for n in NODES if (logs / f"{n}.err").exists())
    )
    kinds = [line["event"] for line in lines]
    for kind in ("started", "training", "node_killed", "recovered", "node_started", "joined", "summary"):
        assert kind in kinds, kinds
    assert kinds.index("node_killed") < kinds.index("recovered") < kinds.index("node_started") < kinds.index("joined")
    summary = lines[-1]
    assert summary["event"] == "summary" and summary["last_step"] == summary["total_steps"] == 400
    lost, joined = summary["changes"]
    assert (lost["change"], lost["world_size"], lost["in_place"]) == ("node_lost", [3, 2], True)
    assert (joined["change"], joined["world_size"]) == ("node_joined", [2, 3])
    # a join under load may fall back to a restart (its admission can time out); what the demo says must be what the
    # running nodes' daemons logged, whichever it was
    first_joined = min(
        r["t"] for n in NODES for r in read_json_lines(logs / f"{n}.out")
        if r.get("event") == "step" and r["t"] > joined["at"] and r["world_size"] == 3
    )  # fmt: skip
    events = [
        (e["event"], datetime.fromisoformat(e["timestamp"]).timestamp())
        for n in ("node-1", "node-3") for e in read_json_lines(logs / f"{n}.err") if "timestamp" in e
    ]  # fmt: skip
    reconfigured = any(name == "reconfigured" and t > joined["at"] for name, t in events)
    restarted = any(name == "restart" and joined["at"] < t <= first_joined for name, t in events)
    assert joined["in_place"] == (reconfigured and not restarted), events
    assert summary["exit_codes"] == {"node-1": 0, "node-2": "killed", "node-3": 0, "node-4": 0}

    # the figures are the job's own: recomputed here from the nodes' step lines
    steps = sorted(
        (r for n in NODES for r in read_json_lines(logs / f"{n}.out") if r.get("event") == "step"), key=lambda r: r["t"]
    )
    for change in (lost, joined):
        first = next(s for s in steps if s["t"] > change["at"] and s["world_size"] == change["world_size"][1])
        assert change["resumed_at"] == first["step"]
        assert change["first_step_s"] == pytest.approx(first["t"] - change["at"], abs=2e-3)
        reached = max(s["step"] for s in steps if s["t"] < first["t"])
        assert change["redone"] == max(0, reached - (first["step"] - 1))
        assert change["stopped_s"] >= 0
    assert lost["first_step_s"] > 0 and lost["stopped_s"] > 0  # a kill costs something: never a constant zero

    # every checkpoint it names was committed: its directory is on disk or was pruned by --keep-checkpoints 3
    committed = summary["checkpoints_committed"]
    assert committed and committed == sorted(committed) and committed[-1] == 400
    on_disk = sorted(int(p.name.split("-")[1]) for p in (tmp_path / "checkpoints" / "d").glob("step-*") if p.is_dir())
    assert on_disk == committed[-len(on_disk) :]
    assert not leftover_processes(NODES)

    again, lines = _demo(tmp_path, "d")
    assert again.returncode == 0, again.stderr
    assert lines[-1]["event"] == "summary" and "finished" in lines[-1]["finished_already"]
    assert "scripts/demo --run-id d-2" in again.stderr
    assert not leftover_processes(NODES)


def test_bad_demo_options_are_one_line_and_exit_2(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "elasticd.demo", "--nodes", "9"], cwd=tmp_path, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert done.returncode == 2 and "--nodes: 2 to 6" in done.stderr and "Traceback" not in done.stderr


def test_a_demo_stopped_midway_takes_its_nodes_and_etcd_with_it(tmp_path: Path, _own_local_runs: Path) -> None:
    demo = subprocess.Popen(
        [sys.executable, "-m", "elasticd.demo", "--run-id", "cut"],
        cwd=tmp_path, env=dict(os.environ, PYTHONUNBUFFERED="1"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )  # fmt: skip
    try:
        assert demo.stdout is not None
        for line in demo.stdout:  # the demo's JSON lines, until the job trains
            if json.loads(line)["event"] == "training":
                break
        etcd = [p for p in psutil.Process(demo.pid).children() if p.name() == "etcd"]
        assert len(etcd) == 1 and leftover_processes(NODES)
        assert list(_own_local_runs.glob("elasticd/*"))  # `elasticd status` in another terminal finds the demo
        demo.send_signal(signal.SIGTERM)
        assert demo.wait(timeout=60) == 130
        assert "interrupted" in (demo.stderr.read() if demo.stderr else "")
        assert not leftover_processes(NODES) and not etcd[0].is_running()
        assert not list(_own_local_runs.glob("elasticd/*"))  # its record for `elasticd status` is withdrawn
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
            demo.wait(timeout=10)
