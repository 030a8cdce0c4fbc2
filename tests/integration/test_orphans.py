"""Nothing of a run outlives its daemon: the worker launcher's parent-death signal, the reaper, and a real node whose
daemon alone is killed with SIGKILL (its workers and their children are gone within 2 s; the others go on).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from elasticd import envvars
from elasticd.agent.reaper import Reaper
from elasticd.errors import EXIT_ORPHANED
from elasticd.etcd.server import EmbeddedEtcd
from elasticd.worker.launch import worker_args
from tests.integration.cluster import Cluster, leftover_processes, read_json_lines, train_args, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

SCRIPTS = Path(__file__).parent / "scripts"
PROBE = SCRIPTS / "argv_probe.py"
# A stand-in daemon: marks its environment as the daemon does, starts argv[1:] with this Python, prints the
# child's pid and waits to be killed.
FAKE_DAEMON = """
import os, subprocess, sys, time
os.environ[sys.argv[1]] = str(os.getpid())
if sys.argv[2] == "reaper":
    from elasticd.agent.reaper import Reaper
    Reaper.start(os.getpid())
    argv = sys.argv[3:]
else:
    argv = sys.argv[2:]
child = subprocess.Popen([sys.executable, *argv])
print(child.pid, flush=True)
time.sleep(600)
"""
# A process that starts a child of its own and sleeps; neither asks for a death signal.
SLEEPER_WITH_CHILD = (
    "import subprocess, sys, time; "
    "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
    "print(c.pid, flush=True); time.sleep(600)"
)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _gone_within(pids: list[int], timeout_s: float, since: float) -> float:
    """Seconds from ``since`` until none of ``pids`` is alive; fails after ``timeout_s``."""
    wait_until(lambda: not any(_alive(p) for p in pids), timeout_s, f"processes {pids} to die", poll_s=0.01)
    return time.monotonic() - since


def _start_fake_daemon(*argv: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", FAKE_DAEMON, envvars.DAEMON_PID, *argv],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, **(env or {})),
        start_new_session=True,
    )


def _kill(proc: subprocess.Popen[str], *pids: int) -> None:
    for pid in (proc.pid, *pids):
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
    proc.wait(timeout=10)


def test_launched_script_sees_the_argv_name_and_unbuffered_output_of_python_u(tmp_path: Path) -> None:
    args = ["--flag", "a b", "-u", "--", "x"]
    direct, launched = tmp_path / "direct.json", tmp_path / "launched.json"
    subprocess.run([sys.executable, "-u", str(PROBE), *args], env=dict(os.environ, PROBE_OUT=str(direct)), check=True)
    env = dict(os.environ, PROBE_OUT=str(launched), **{envvars.DAEMON_PID: str(os.getpid())})
    subprocess.run([sys.executable, *worker_args(str(PROBE), args)], env=env, check=True, timeout=60)
    seen, expected = json.loads(launched.read_text()), json.loads(direct.read_text())
    assert seen.pop("pid") != expected.pop("pid")
    assert seen == expected
    assert seen["argv"] == [str(PROBE), *args] and seen["name"] == "__main__" and seen["write_through"] is True


def test_launched_worker_dies_within_2s_of_its_daemon_even_without_the_library(tmp_path: Path) -> None:
    out = tmp_path / "probe.json"
    daemon = _start_fake_daemon(*worker_args(str(PROBE), []), env={"PROBE_OUT": str(out), "PROBE_SLEEP": "600"})
    try:
        assert daemon.stdout is not None
        worker = int(daemon.stdout.readline())
        wait_until(out.exists, 60, "the script to start")
        assert json.loads(out.read_text())["pid"] == worker  # exec'd in place: the pid torch watches is the script's
        killed_at = time.monotonic()
        os.kill(daemon.pid, signal.SIGKILL)
        took = _gone_within([worker], 10, killed_at)
        print(f"worker gone {took:.3f}s after its daemon's SIGKILL")
        assert took < 2.0
    finally:
        _kill(daemon, worker)


def test_launcher_whose_daemon_is_already_gone_does_not_start_the_script(tmp_path: Path) -> None:
    out = tmp_path / "probe.json"
    # pid 1 is never our parent: the launcher behaves as if the daemon had died before it asked for the signal
    env = dict(os.environ, PROBE_OUT=str(out), **{envvars.DAEMON_PID: "1"})
    done = subprocess.run(
        [sys.executable, *worker_args(str(PROBE), [])], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == EXIT_ORPHANED and "daemon (pid 1) is gone" in done.stderr
    assert not out.exists()


def test_reaper_kills_every_marked_process_within_2s_of_the_daemons_sigkill() -> None:
    # the sleeper and its child never asked for a death signal: only the reaper can end them
    daemon = _start_fake_daemon("reaper", "-c", SLEEPER_WITH_CHILD)
    sleeper = grandchild = 0
    try:
        assert daemon.stdout is not None
        sleeper = int(daemon.stdout.readline())
        grandchild = int(wait_until(lambda: psutil.Process(sleeper).children(), 60, "the grandchild")[0].pid)
        killed_at = time.monotonic()
        os.kill(daemon.pid, signal.SIGKILL)
        took = _gone_within([sleeper, grandchild], 10, killed_at)
        print(f"marked processes gone {took:.3f}s after the daemon's SIGKILL")
        assert took < 2.0
    finally:
        _kill(daemon, sleeper, grandchild)


def test_reaper_closed_at_a_normal_exit_kills_what_is_left_and_nothing_unmarked() -> None:
    marked = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"], env=dict(os.environ, **{envvars.DAEMON_PID: "999999"})
    )
    unmarked = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        reaper = Reaper.start(999999)  # its parent is not 999999: it sweeps at once, as after a daemon's early death
        reaper.close()
        assert marked.wait(timeout=10) == -signal.SIGKILL
        assert unmarked.poll() is None
    finally:
        for p in (marked, unmarked):
            p.kill()
            p.wait()


def test_daemon_killed_alone_its_workers_and_their_children_die_and_the_others_go_on(
    etcd: EmbeddedEtcd, tmp_path: Path
) -> None:
    names = ["orph-a", "orph-b", "orph-c"]
    with Cluster(
        etcd.endpoint,
        tmp_path,
        run_id="orphans",
        min_nodes=2,
        max_nodes=3,
        script=SCRIPTS / "spawning_train.py",
        script_args=train_args(80),
    ) as c:
        for name in names:
            c.start(name)
        c.wait_step(lambda s: s["step"] >= 15 and s["world_size"] == 3, what="step 15 on 3 workers")
        victim = c.nodes["orph-c"]
        workers = list(victim.wait_event("workers_started")["pids"])
        children = [
            e["pid"] for e in read_json_lines(victim.out) if e.get("event") == "child" and e["worker"] in workers
        ]
        assert workers and children and all(_alive(p) for p in workers + children), c.diagnostics()

        killed_at = time.monotonic()
        victim.proc.send_signal(signal.SIGKILL)  # the daemon alone
        victim.proc.wait(timeout=10)
        took = _gone_within(workers + children, 10, killed_at)
        print(f"workers and their children gone {took:.3f}s after the daemon's SIGKILL")
        assert took < 2.0, c.diagnostics()
        # and nothing else of the node: its reaper, the last, exits once it has swept and logged (it was seen still
        # running in CI the moment the workers were gone)
        wait_until(lambda: not leftover_processes(["orph-c"]), 10, "every process of orph-c to exit")

        survivors = names[:2]
        for name in survivors:
            c.nodes[name].wait_event("node_lost", timeout_s=60, where=lambda e: e["lost_node"] == "orph-c")
        c.wait_step(lambda s: s["world_size"] == 2, timeout_s=60, what="a step on 2 workers")
        for name in survivors:
            code = c.nodes[name].wait(150)
            assert code == 0, f"{name} exited {code}\n{c.diagnostics()}"
        assert c.newest_step()["step"] == 80 and c.newest_step()["world_size"] == 2
        wait_until(lambda: not leftover_processes(names), 15, "every process of the run to exit")
