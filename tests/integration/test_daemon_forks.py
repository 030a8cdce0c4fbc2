"""The suite's daemon fork server (tests/integration/daemon_forks.py): a fork gets the node's arguments, environment,
working directory and output files and reports its exit code as Popen would; what it imports first reads nothing of
the environment a test sets for a node."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.daemon_forks import PRELOAD, DaemonForks

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

# Read at import by torch's and our modules, a fork server has them from the test process: the variables a test sets
# for one node (tests/integration/cluster.py, Cluster(env=...)) must not be. What Cluster.start adds to every node
# (PYTHONUNBUFFERED, OMP_NUM_THREADS) the server gets too; PYTHONUNBUFFERED is read at import (seen here).
PER_NODE_PREFIXES = ("ELASTICD_", "ACCELERATE_", "TORCHELASTIC_", "LOCAL_RANK", "RANK", "WORLD_SIZE")

RECORD_READS = """
import json, os, sys
read = set()
get, contains = os._Environ.__getitem__, os._Environ.__contains__
def getitem(self, key):
    read.add(key)
    return get(self, key)
def has(self, key):
    read.add(key)
    return contains(self, key)
os._Environ.__getitem__, os._Environ.__contains__ = getitem, has
for name in sys.argv[1:]:
    __import__(name)
print(json.dumps(sorted(read)))
"""


def test_nothing_the_server_imports_reads_a_variable_a_node_sets() -> None:
    done = subprocess.run(
        [sys.executable, "-c", RECORD_READS, *PRELOAD], capture_output=True, text=True, timeout=120, check=True
    )
    read = json.loads(done.stdout.splitlines()[-1])
    assert read, "no read recorded: the recorder does not work"  # torch reads a few of its own (TORCH_...)
    assert [key for key in read if key.startswith(PER_NODE_PREFIXES)] == []


@pytest.fixture(scope="module")
def forks() -> Iterator[DaemonForks]:
    forks = DaemonForks()
    yield forks
    forks.close()


def test_a_fork_runs_the_cli_with_the_nodes_arguments_output_and_exit_code(forks: DaemonForks, tmp_path: Path) -> None:
    out, err = tmp_path / "out", tmp_path / "err"
    done = forks.start(["--version"], {}, tmp_path, out, err)
    assert done.wait(60) == 0
    assert "elasticd" in out.read_text()
    refused = forks.start(["start", "--no-such-flag"], {}, tmp_path, out, err)
    assert refused.wait(60) == 2
    assert "no-such-flag" in err.read_text()


def test_a_fork_has_the_nodes_environment_and_working_directory(forks: DaemonForks, tmp_path: Path) -> None:
    out, err = tmp_path / "out", tmp_path / "err"
    (tmp_path / "train.py").write_text("")
    # an option's ELASTICD_ variable, seen only if the fork has the node's environment; the relative script only from
    # the node's directory: the error names the variable's value, not a missing script
    bad = forks.start(
        ["start", "--etcd", "127.0.0.1:1", "train.py"], {"ELASTICD_MIN_NODES": "many"}, tmp_path, out, err
    )
    assert bad.wait(60) == 2
    assert "many" in err.read_text()


def test_a_signal_ends_a_fork_and_its_code_is_minus_the_signal_as_popen_says(
    forks: DaemonForks, tmp_path: Path
) -> None:
    out, err = tmp_path / "out", tmp_path / "err"
    (tmp_path / "train.py").write_text("")
    # `elasticd start` waits for etcd that is not there: long enough to be signalled
    waiting = forks.start(["start", "--etcd", "127.0.0.1:9", str(tmp_path / "train.py")], {}, tmp_path, out, err)
    with pytest.raises(subprocess.TimeoutExpired):
        waiting.wait(0.5)
    assert waiting.poll() is None
    waiting.send_signal(signal.SIGKILL)
    assert waiting.wait(30) == -signal.SIGKILL
    assert waiting.returncode == -signal.SIGKILL
