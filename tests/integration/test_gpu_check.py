"""bench/gpu_check.sh on the CPU (``--device cpu --backend gloo``): the GPU check's scenarios run here, before a GPU
is lent, and they drive the product: every job is ``elasticd start`` nodes running an example script through the
worker library, as the nodes' own logs show (not the check's word for it)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.integration.cluster import ROOT, read_json_lines

pytestmark = [pytest.mark.integration, pytest.mark.timeout(480)]

SCRIPT = ROOT / "bench" / "gpu_check.sh"
RUN_TIMEOUT_S = 420  # the script's own backstop is 6 minutes; ~1 minute here on an idle 2-core machine
SCENARIOS = {
    "backend_cycles_gloo",
    "bf16_nan_train",
    "bf16_text_classification",
    "device_error",
    "elastic_join",
    "elastic_node_loss",
    "checkpoint_16mb",
    "nccl_multi",
}
# events only the worker library logs (elasticd.attach and the hot path it arms), never the daemon
WORKER_LIBRARY_EVENTS = {"hot_recovery_armed", "hot_recovery_off", "resumed"}


def run_check(logs: Path, results: Path) -> tuple[int, str]:
    command = ["bash", str(SCRIPT), "--device", "cpu", "--backend", "gloo", "--logs", str(logs), "--json", str(results)]
    env = {**os.environ, "ELASTICD_VENV": sys.prefix}
    check = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = check.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(check.pid, signal.SIGTERM)  # the driver kills every node it started on TERM
        with contextlib.suppress(subprocess.TimeoutExpired):
            check.communicate(timeout=30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(check.pid, signal.SIGKILL)
        check.communicate()
        raise
    return check.returncode, out


def node_logs(job_dir: Path) -> list[list[dict[str, Any]]]:
    return [list(read_json_lines(err)) for err in sorted(job_dir.glob("n*.err"))]


def test_the_gpu_check_runs_on_the_cpu_through_elasticd_start_and_the_worker_library(tmp_path: Path) -> None:
    logs, results = tmp_path / "logs", tmp_path / "gpu_check.json"
    code, out = run_check(logs, results)
    assert code == 0, out[-6000:]
    report = json.loads(results.read_text())
    records = {r["scenario"]: r for r in report["records"]}
    assert set(records) == SCENARIOS, out[-3000:]
    assert all(r["problem"] is None for r in records.values()), out[-3000:]
    for name in SCENARIOS:
        assert f"  {name}: ok" in out  # one line per scenario, with its verdict

    # every job of every scenario but the backend's own cycles: `elasticd start` nodes (their daemon's events)
    # running an example script; in each scenario, workers that went through the worker library (its events; a
    # blocking checkpoint job's workers log none at info: its save times are the library's beats, in the metrics)
    jobs = sorted(p for p in logs.glob("*/*") if p.is_dir() and list(p.glob("n*.err")))
    assert {p.parent.name for p in jobs} == {"bf16_nan", "checkpoint", "device_error", "elastic"}
    scripts = set()
    library: dict[str, set[str]] = {}
    for job in jobs:
        events = [e for node in node_logs(job) for e in node]
        started = [e for e in events if e.get("event") == "daemon_started"]
        assert started, f"{job}: no elasticd daemon ran this job"
        scripts |= {Path(e["script"]).name for e in started}
        library.setdefault(job.parent.name, set()).update(WORKER_LIBRARY_EVENTS & {e.get("event") for e in events})
    assert all(library.values()), f"a scenario whose workers logged no worker-library event: {library}"
    assert scripts == {"train.py", "text_classification.py"}

    # the figures are the product's: the guard's verdict on the injected NaN, the in-place loss report, the
    # survivors re-formed in place around the failed worker
    assert records["bf16_nan_train"]["guard"][0]["step"] == 4
    assert records["elastic_node_loss"]["survivor_workers_restarted"] is False
    assert records["device_error"]["survivors"] == "in_place"
    assert records["checkpoint_16mb"]["async"]["blocking_s"] and records["checkpoint_16mb"]["sync"]["blocking_s"]
