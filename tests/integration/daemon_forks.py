"""Daemons forked from one process that already imported torch, instead of a new interpreter per ``elasticd start``.

Each integration test starts its nodes as daemons, and each new interpreter imports torch and torch's elastic agent
before anything else: ~3 s of CPU. In a suite run (process accounting, every process of a fresh clone's
``.ci/run``) 190 daemons used 918 s of CPU, most of it those imports, and on 2 cores the suite's CPU is its wall
time. :class:`DaemonForks` keeps one server per test process (``python -m tests.integration.daemon_forks``) that
imported them once; each daemon is a fork of it that becomes ``python -m elasticd start ARGS`` (runpy) with
the node's environment, working directory, output files and a session of its own, as
``subprocess.Popen(..., start_new_session=True)`` gives. From ``elasticd.cli`` on, the daemon runs what a user's
runs, and starts its reaper, warm server and workers as always. :class:`ForkedDaemon` is what the tests use of a
``Popen``: ``pid``, ``poll``, ``wait``, ``returncode``, ``send_signal``, ``kill``.

What differs from a new interpreter: the modules in :data:`PRELOAD` (and what they import: torch's rendezvous
plugins, so elasticd's etcd client and grpc, imported but never connected before the fork) were imported before
the node's environment was in place, and ``/proc/PID/cmdline`` and ``/proc/PID/environ`` are the server's. No
module imported there reads the environment at import (tests/integration/test_daemon_forks.py). Tests that need a new
interpreter start one: the CLI's own tests, the second daemon of test_node_id, test_startup_imports, the nodes on
hosts of their own (``ip netns exec``), the benchmarks. ``ELASTICD_TEST_FORKED_DAEMONS=0`` starts every daemon of
the suite as a new interpreter.

The idea is the product's own warm start (``elasticd/agent/warm_start.py``), itself Python's multiprocessing
forkserver: import once, fork many.
"""

from __future__ import annotations

import atexit
import importlib
import io
import json
import os
import queue
import runpy
import select
import signal
import subprocess
import sys
import threading
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any, NoReturn

MODULE = "tests.integration.daemon_forks"
ROOT = Path(__file__).resolve().parents[2]
ENABLED_VARIABLE = "ELASTICD_TEST_FORKED_DAEMONS"
# What a daemon imports before its first line of its own (~3 s of CPU): torch and torch's elastic agent.
PRELOAD = (
    "torch",
    "torch.distributed.elastic.agent.server.api",
    "torch.distributed.elastic.multiprocessing",
    "torch.distributed.elastic.rendezvous.dynamic_rendezvous",
)
# What Cluster.start adds to every node's environment: the server imports with it too.
NODE_ENVIRONMENT = {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
# Seconds: the server's imports on a loaded 2-core host, and one fork's answer.
READY_TIMEOUT_S = 120.0
START_TIMEOUT_S = 30.0


def enabled(environ: dict[str, str] | os._Environ[str] = os.environ) -> bool:
    return environ.get(ENABLED_VARIABLE, "1") != "0"


# -- the server: one per test process ---------------------------------------------------------------------------------


def serve() -> None:
    """Import :data:`PRELOAD`, then fork a daemon for each request line on stdin; answer on stdout with the pid of
    each start and the exit code of each daemon that exits (``{"started": pid}``, ``{"exited": pid, "code": c}``)."""
    for name in PRELOAD:
        importlib.import_module(name)
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)  # SIGCHLD wakes the select below
    signal.signal(signal.SIGCHLD, lambda *_: None)
    replies.write(json.dumps({"ready": True}) + "\n")
    pending = b""
    while True:
        readable, _, _ = select.select([0, wake_r], [], [])
        if wake_r in readable:
            while True:
                try:
                    if not os.read(wake_r, 4096):
                        break
                except BlockingIOError:
                    break
        if 0 in readable:
            chunk = os.read(0, 65536)
            if not chunk:
                return  # the test process is gone (or done): its daemons are its own to stop
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                pid = os.fork()
                if pid == 0:
                    _become_daemon(json.loads(line), close=(wake_r, wake_w, replies.fileno()))
                replies.write(json.dumps({"started": pid}) + "\n")
        _reap(replies)


def _reap(replies: IO[str]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        replies.write(json.dumps({"exited": pid, "code": os.waitstatus_to_exitcode(status)}) + "\n")


def _become_daemon(request: dict[str, Any], close: Sequence[int]) -> NoReturn:
    """In the fork: what ``Popen(args, cwd=, env=, stdout=, stderr=, start_new_session=True)`` of
    ``python -u -m elasticd ARGS`` gives, then ``elasticd.cli.main(ARGS)`` and an interpreter's exit."""
    code = 1
    try:
        os.setsid()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in close:
            os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            target = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            os.dup2(target, fd)
            os.close(target)
        sys.stdout = _unbuffered(1)
        sys.stderr = _unbuffered(2)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.path[0] = os.getcwd()  # as `python -m` puts it
        sys.argv = ["-m", *request["args"]]  # runpy puts __main__.py's path first, as `python -m` does
        # `python -m elasticd` itself: __main__ becomes elasticd.__main__, not this module, so what reads
        # sys.modules["__main__"] sees the daemon's (multiprocessing's forkserver, the warm start, re-imports it
        # by name in each process it starts, and no module named tests is on a daemon's path)
        runpy.run_module("elasticd", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except BaseException:
        traceback.print_exc()
    finally:
        # an interpreter's exit: wait for the threads that are not daemons, run the exit handlers, flush
        try:
            threading._shutdown()  # type: ignore[attr-defined]
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _exit_code(value: object) -> int:
    if value is None:
        return 0
    if isinstance(value, int):
        return value
    print(value, file=sys.stderr)  # as sys.exit("message") does
    return 1


def _unbuffered(fd: int) -> io.TextIOWrapper:
    raw = io.FileIO(fd, "w", closefd=False)
    return io.TextIOWrapper(raw, encoding="utf-8", errors="backslashreplace", write_through=True)


# -- the test process's side ------------------------------------------------------------------------------------------


class ForkedDaemon:
    """A daemon forked by the server, as the tests use a ``subprocess.Popen``."""

    def __init__(self, pid: int, forks: DaemonForks, args: list[str]) -> None:
        self.pid = pid
        self.args = args
        self._forks = forks

    @property
    def returncode(self) -> int | None:
        return self._forks.exit_code(self.pid)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        code = self._forks.wait_exit(self.pid, timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return code

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:  # as Popen: nothing for a process known to have exited
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class DaemonForks:
    """The server of this test process and what it said: started lazily, once; it ends with the process."""

    _instance: DaemonForks | None = None
    _instance_lock = threading.Lock()

    @classmethod
    def shared(cls) -> DaemonForks:
        with cls._instance_lock:
            if cls._instance is None or cls._instance.broken:
                cls._instance = cls()
            return cls._instance

    def __init__(self) -> None:
        self._server = subprocess.Popen(
            [sys.executable, "-m", MODULE],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=ROOT,
            env=dict(os.environ, **NODE_ENVIRONMENT),
        )
        self._exits: dict[int, int] = {}
        self._changed = threading.Condition()
        self._started: queue.Queue[int] = queue.Queue()
        self._ready = threading.Event()
        self._start_lock = threading.Lock()
        self.broken = False
        threading.Thread(target=self._read, name="daemon-forks", daemon=True).start()
        atexit.register(self.close)

    def start(self, args: list[str], env: dict[str, str], cwd: Path, stdout: Path, stderr: Path) -> ForkedDaemon:
        request = {"args": args, "env": env, "cwd": str(cwd), "stdout": str(stdout), "stderr": str(stderr)}
        with self._start_lock:
            if not self._ready.wait(READY_TIMEOUT_S) or self.broken:
                raise RuntimeError(f"the daemon fork server did not start (exit {self._server.poll()})")
            assert self._server.stdin is not None
            self._server.stdin.write(json.dumps(request).encode() + b"\n")
            self._server.stdin.flush()
            pid = self._started.get(timeout=START_TIMEOUT_S)
        return ForkedDaemon(pid, self, ["elasticd", *args])

    def exit_code(self, pid: int) -> int | None:
        with self._changed:
            self._check()
            return self._exits.get(pid)

    def wait_exit(self, pid: int, timeout: float | None) -> int | None:
        with self._changed:
            self._changed.wait_for(lambda: pid in self._exits or self.broken, timeout)
            self._check()
            return self._exits.get(pid)

    def _check(self) -> None:
        if self.broken:
            raise RuntimeError(f"the daemon fork server exited ({self._server.poll()}): its daemons' exits are unknown")

    def _read(self) -> None:
        assert self._server.stdout is not None
        for line in self._server.stdout:
            message = json.loads(line)
            if "ready" in message:
                self._ready.set()
            elif "started" in message:
                with self._changed:
                    self._exits.pop(message["started"], None)  # a pid used again: the older daemon's code is gone
                self._started.put(message["started"])
            elif "exited" in message:
                with self._changed:
                    self._exits[message["exited"]] = message["code"]
                    self._changed.notify_all()
        with self._changed:
            self.broken = True
            self._changed.notify_all()
        self._ready.set()

    def close(self) -> None:
        if self._server.stdin is not None and not self._server.stdin.closed:
            self._server.stdin.close()  # the server returns on end of input
        try:
            self._server.wait(5)
        except subprocess.TimeoutExpired:
            self._server.kill()


if __name__ == "__main__":
    serve()
