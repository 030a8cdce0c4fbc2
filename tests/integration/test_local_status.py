"""``elasticd status`` and ``stop`` with no options find a run on this machine whose daemon started its own etcd
(random port, password in a 0600 file): the daemon publishes where it is in the user's runtime directory
(``etcd/local_runs.py``), and withdraws it when it ends. Issue 27: during the demo, ``elasticd status`` in another
terminal used to say "etcd at 127.0.0.1:2379 did not answer"."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import kill_tree
from tests.integration.cluster import EXAMPLE, train_args, wait_until
from tests.integration.test_daemon_run import elasticd

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def test_status_and_stop_without_options_find_the_local_run_on_its_embedded_etcd(
    tmp_path: Path, _own_local_runs: Path
) -> None:
    args = ["start", "--metrics-port", "0", "--log-format", "json", "--run-id", "local-demo", "--nproc-per-node", "1"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    with (tmp_path / "daemon.err").open("w") as err:
        daemon = subprocess.Popen(
            [sys.executable, "-m", "elasticd", *args, str(EXAMPLE), *train_args(100000, 0.05)],
            cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True,
        )  # fmt: skip
        try:

            def running() -> dict | None:
                out = elasticd("status", "--json", cwd=tmp_path)
                if out.returncode != 0:
                    return None  # the daemon has not published yet: today's default endpoint, which nobody serves
                status = json.loads(out.stdout)
                return status if (status["step"] or 0) > 0 else None

            status = wait_until(running, 90, "status with no options to show the run stepping", poll_s=1.0)
            assert status["run_id"] == "local-demo" and status["node_count"] == 1, status
            assert [n["pid"] for n in status["nodes"]] == [daemon.pid]
            records = list((_own_local_runs / "elasticd").glob("*.json"))
            assert len(records) == 1 and oct(records[0].stat().st_mode & 0o777) == "0o600"
            assert "password" not in json.loads(records[0].read_text()).get("user", "")
            stop = elasticd("stop", cwd=tmp_path)
            assert stop.returncode == 0, stop.stderr
            assert daemon.wait(timeout=90) == 0, (tmp_path / "daemon.err").read_text()[-3000:]
        finally:
            kill_tree(daemon)
    assert not list((_own_local_runs / "elasticd").glob("*.json")), "the record outlived its daemon"
    after = elasticd("status", "--json", "--etcd-connect-timeout", "1", cwd=tmp_path)
    assert after.returncode != 0 and "127.0.0.1:2379" in after.stderr, after.stderr
