"""A torch whose private names the agent relies on moved: ``elasticd start`` refuses in one line, exit 2, before it
starts any worker (``elasticd/privates/``). The move is made for real in the daemon's process: the agent's private
``_exit_barrier`` is deleted from torch's class before the CLI runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from elasticd.etcd.server import EmbeddedEtcd
from tests.integration.cluster import EXAMPLE

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

# torch "upgraded" under the daemon: one private method of its agent gone, then elasticd's own entry point.
MOVED = """
import sys
from torch.distributed.elastic.agent.server.api import SimpleElasticAgent
del SimpleElasticAgent._exit_barrier
from elasticd.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_moved_agent_private_refuses_to_start_in_one_line_with_exit_2(etcd: EmbeddedEtcd, tmp_path: Path) -> None:
    args = ["start", "--etcd", etcd.endpoint, "--run-id", "moved", "--checkpoint-dir", str(tmp_path / "checkpoints")]
    args += ["--metrics-port", "0", "--log-format", "json", "--local-addr", "127.0.0.1", str(EXAMPLE)]
    done = subprocess.run(
        [sys.executable, "-c", MOVED, *args],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        timeout=100,
    )
    assert done.returncode == 2, done.stderr
    events = [json.loads(line) for line in done.stderr.splitlines() if line.startswith("{")]
    (line,) = [line for line in done.stderr.splitlines() if line.strip() and not line.startswith("{")]
    assert line.startswith("elasticd: error: elasticd relies on private torch/accelerate names that moved"), line
    assert "SimpleElasticAgent._exit_barrier: missing" in line and "checked with torch 2.13.x" in line, line
    moved = [e for e in events if e["event"] == "private_surfaces_moved"]
    assert moved and moved[0]["fallbacks"] == ["refuse_to_start"], events
    assert not any(e["event"] in ("workers_started", "daemon_started") for e in events), events
