"""Warm starts (elasticd/agent/warm_start.py, elasticd/worker/warm.py): a worker forked from the daemon's warm server
is, to its script, the same process as ``python -u SCRIPT ARGS``; torch's agent sees its pid, exit code and signals.

Real forks from a real multiprocessing forkserver preloaded with torch and accelerate (the one this pytest process
starts once), compared with a real ``python -u``; then a real daemon whose worker is a fork of its server.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest

from elasticd import envvars
from elasticd.agent.warm_start import WarmStarts, enabled, launched_script
from elasticd.errors import EXIT_ORPHANED
from elasticd.etcd.server import EmbeddedEtcd
from elasticd.worker.launch import worker_args
from elasticd.worker.warm import PRELOAD, preload_for
from tests.integration.cluster import Cluster, train_args, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

# What a script can see of how it was started. The warm server imported torch with the daemon's environment, the
# fork must still see the rank's: OMP_NUM_THREADS (read by torch's pool), PYTHONFAULTHANDLER (read at start-up).
PROBE = """
import atexit, ctypes, faulthandler, json, os, sys, time
import torch
from helper_next_to_the_script import VALUE
atexit.register(lambda: open(sys.argv[2], "w").write("atexit ran"))
sys.stdout.write("unbuffered:")  # no newline, no flush: read while the process still sleeps
time.sleep(0.5)
libc = ctypes.CDLL(None)
libc.getenv.restype = ctypes.c_char_p
print(json.dumps({
    "argv": sys.argv, "name": __name__, "file": __file__, "path0": sys.path[0], "cwd": os.getcwd(),
    "rank": os.environ.get("RANK"), "getenv_rank": libc.getenv(b"RANK").decode(), "helper": VALUE,
    "threads": torch.get_num_threads(), "faulthandler": faulthandler.is_enabled(),
    "own_session": os.getsid(0) == os.getpid(), "own_group": os.getpgid(0) == os.getpid(),
    "process_name": __import__("multiprocessing").current_process().name, "no_bytecode": sys.dont_write_bytecode,
}))
sys.exit(int(sys.argv[1]))
"""


class _Log:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def info(self, event: str, **fields: Any) -> None:
        self.events.append((event, fields))

    warning = info


@pytest.fixture(scope="module")
def warm(tmp_path_factory: pytest.TempPathFactory) -> WarmStarts:
    log = _Log()
    starts = WarmStarts(Path(__file__), log)
    starts.start()
    assert starts.wait_ready(), log.events
    return starts


def _script(tmp_path: Path, body: str = PROBE) -> Path:
    (tmp_path / "helper_next_to_the_script.py").write_text("VALUE = 'found next to the script'\n")
    script = tmp_path / "probe.py"
    script.write_text(body)
    return script


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (envvars.OMP_NUM_THREADS, envvars.PYTHONFAULTHANDLER)}
    env.update({"RANK": "3", envvars.OMP_NUM_THREADS: "1", envvars.PYTHONFAULTHANDLER: "1"}, **extra)
    return env


def _read_json(text: str) -> dict[str, Any]:
    return json.loads(text.split("unbuffered:", 1)[1])


def test_a_warm_worker_sees_what_python_u_gives_its_script(warm: WarmStarts, tmp_path: Path) -> None:
    script = _script(tmp_path)
    cold_marker, warm_marker = tmp_path / "cold-atexit", tmp_path / "warm-atexit"
    cold = subprocess.run(
        [sys.executable, "-u", str(script), "3", str(cold_marker)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
        start_new_session=True,
    )
    assert cold.returncode == 3, cold.stderr

    out, err = tmp_path / "warm.out", tmp_path / "warm.err"
    handler = warm.handler([str(script), "3", str(warm_marker)], _env(), str(out), str(err), local_rank_id=0)
    wait_until(lambda: out.read_text() == "unbuffered:", 20, "the unflushed write, before the process ends")
    assert handler.proc.wait(30) == 3, err.read_text()
    assert handler.proc.poll() == 3 and handler.proc.returncode == 3

    seen_cold, seen_warm = _read_json(cold.stdout), _read_json(out.read_text())
    assert seen_cold["argv"][2] != seen_warm["argv"][2]
    seen_cold["argv"][2] = seen_warm["argv"][2] = "marker"
    assert seen_warm == seen_cold, (seen_warm, seen_cold)
    assert seen_warm["rank"] == seen_warm["getenv_rank"] == "3" and seen_warm["threads"] == 1
    assert seen_warm["faulthandler"] and seen_warm["own_session"] and seen_warm["name"] == "__main__"
    assert warm_marker.read_text() == cold_marker.read_text() == "atexit ran"


def test_a_warm_workers_exception_signal_and_group_end_as_a_processs_would(warm: WarmStarts, tmp_path: Path) -> None:
    failing = _script(tmp_path, "raise RuntimeError('the script failed')\n")
    err = tmp_path / "fail.err"
    handler = warm.handler([str(failing)], _env(), None, str(err), local_rank_id=0)
    assert handler.proc.wait(30) == 1
    assert "RuntimeError: the script failed" in err.read_text() and "Traceback" in err.read_text()

    # a worker and the child it spawned: close() signals the process group, as torch's SubprocessHandler does
    sleeper = tmp_path / "sleeper.py"
    sleeper.write_text(
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    out = tmp_path / "sleeper.out"
    handler = warm.handler([str(sleeper)], _env(), str(out), None, local_rank_id=1)
    wait_until(lambda: out.read_text().strip(), 20, "the child's pid")
    child = int(out.read_text())
    assert handler.proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        handler.proc.wait(0.1)
    handler.close(signal.SIGTERM)
    assert handler.proc.wait(10) == -signal.SIGTERM
    wait_until(lambda: not psutil.pid_exists(child) or psutil.Process(child).status() == "zombie", 10, "the child")

    handler = warm.handler([str(sleeper)], _env(), str(tmp_path / "killed.out"), None, local_rank_id=2)
    os.kill(handler.proc.pid, signal.SIGKILL)  # kill -9 of the pid torch watches
    assert handler.proc.wait(10) == -signal.SIGKILL


def test_a_fork_whose_daemon_is_not_its_grandparent_does_not_start(warm: WarmStarts, tmp_path: Path) -> None:
    # the daemon (here: this process) died before the death signal was asked for: nobody would send it
    script = _script(tmp_path, "open(__file__ + '.ran', 'w').write('ran')\n")
    err = tmp_path / "orphan.err"
    stranger = str(os.getppid())
    handler = warm.handler([str(script)], _env(**{envvars.DAEMON_PID: stranger}), None, str(err), local_rank_id=0)
    assert handler.proc.wait(30) == EXIT_ORPHANED
    assert "is gone; not starting" in err.read_text() and not Path(f"{script}.ran").exists()


def test_only_the_launchers_command_line_is_started_warm_and_the_switch_turns_it_off() -> None:
    assert launched_script(sys.executable, worker_args("train.py", ["--lr", "1"])) == ["train.py", "--lr", "1"]
    assert launched_script(sys.executable, ("-u", "train.py")) is None
    assert launched_script("/usr/bin/other", worker_args("train.py", [])) is None
    assert launched_script(sys.executable, worker_args("train.py", [])[:3]) is None
    assert enabled({}) == sys.platform.startswith("linux")
    assert not enabled({envvars.WARM_START: "0"})


def test_the_preloads_follow_the_scripts_own_imports(tmp_path: Path) -> None:
    script = tmp_path / "s.py"
    script.write_text(
        "import os\nfrom transformers import Trainer\nimport numpy as np\ndef f():\n    import datasets\n"
    )
    assert preload_for(script) == [*PRELOAD, "transformers", "numpy"]  # a function's import is not run at start
    script.write_text("this is not python(")
    assert preload_for(script) == list(PRELOAD)
    assert preload_for(tmp_path / "missing.py") == list(PRELOAD)


@pytest.mark.parametrize("warm_start", ["1", "0"], ids=["warm", "cold"])
def test_a_daemons_restarted_worker_is_forked_from_its_warm_server(
    etcd: EmbeddedEtcd, tmp_path: Path, warm_start: str
) -> None:
    with Cluster(
        etcd.endpoint,
        tmp_path,
        run_id=f"warm{warm_start}",
        min_nodes=1,
        max_nodes=1,
        script_args=train_args(40),
        env={envvars.WARM_START: warm_start, envvars.FAULT: "kill@step=12,rank=0,restart=0"},
    ) as c:
        node = c.start("w0")
        first = node.wait_event("workers_started")["pids"][0]
        wait_until(lambda: len(node.events("workers_started")) == 2, 90, "the restart after the crash")
        second = node.events("workers_started")[-1]["pids"][0]
        parent = psutil.Process(second).ppid() if psutil.pid_exists(second) else None
        assert node.wait(120) == 0, c.diagnostics()
    assert first != second
    ready = node.events("warm_start_ready")
    if warm_start == "1":
        assert ready and parent is not None and parent != node.proc.pid, (parent, node.proc.pid, c.diagnostics())
    else:
        assert not ready and parent in (node.proc.pid, None), (parent, node.proc.pid)
    assert c.newest_step()["step"] == 40
