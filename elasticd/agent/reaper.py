"""The reaper: once a daemon is gone, nothing it started lives on.

The worker launcher (``elasticd/worker/launch.py``) makes each worker die with the daemon, but a worker's own
children (DataLoader workers, anything a script spawns) and the embedded etcd are not the daemon's children and
would be left behind. Everything the daemon starts inherits ``ELASTICD_DAEMON_PID``. The reaper is a small child
process of the daemon, in a session of its own (a Ctrl-C or a signal to the daemon's process group does not reach
it); it gets SIGTERM from the kernel when the daemon dies (``PR_SET_PDEATHSIG``), or from the daemon when it exits
normally, and then SIGKILLs every process of this user whose environment carries the daemon's pid, until none is
left. Linux only (``/proc``, pidfds); elsewhere the daemon starts no reaper.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import Literal

from elasticd import envvars
from elasticd.parentdeath import parent_is, set_parent_death_signal

MODULE = "elasticd.agent.reaper"
# A sweep repeats until no marked process is left (one may fork while we kill its parent), for at most this long.
SWEEP_TIMEOUT_S = 5.0
_SWEEP_POLL_S = 0.02
# The daemon's wait for the reaper's final sweep at a normal exit.
_CLOSE_TIMEOUT_S = 10.0

LogFormat = Literal["json", "console"]


def marked_processes(daemon_pid: int, proc_dir: Path = Path("/proc")) -> list[int]:
    """Pids of live processes whose environment has ``ELASTICD_DAEMON_PID=<daemon_pid>`` (zombies have none;
    other users' environments are unreadable, so only our own processes are ever found)."""
    marker = f"{envvars.DAEMON_PID}={daemon_pid}".encode()
    skip = {os.getpid(), daemon_pid}
    found = []
    for entry in proc_dir.iterdir():
        if not entry.name.isdigit() or int(entry.name) in skip:
            continue
        if _has_marker(entry / "environ", marker):
            found.append(int(entry.name))
    return found


def _has_marker(environ: Path, marker: bytes) -> bool:
    try:
        return marker in environ.read_bytes().split(b"\0")
    except OSError:  # gone, or not ours
        return False


def sweep(daemon_pid: int, timeout_s: float = SWEEP_TIMEOUT_S) -> int:
    """SIGKILL every marked process until none is left or ``timeout_s`` passed; returns how many were killed."""
    marker = f"{envvars.DAEMON_PID}={daemon_pid}".encode()
    deadline = time.monotonic() + timeout_s
    killed = 0
    while (pids := marked_processes(daemon_pid)) and time.monotonic() < deadline:
        for pid in pids:
            killed += _kill_if_marked(pid, marker)
        time.sleep(_SWEEP_POLL_S)
    return killed


def _kill_if_marked(pid: int, marker: bytes) -> int:
    # Through a pidfd: if the pid was reused since the scan, the check below reads the new process, never kills it.
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return 0
    try:
        if not _has_marker(Path(f"/proc/{pid}/environ"), marker):
            return 0
        signal.pidfd_send_signal(fd, signal.SIGKILL)
        return 1
    except OSError:
        return 0
    finally:
        os.close(fd)


class Reaper:
    """The daemon's handle on its reaper process: :meth:`start` it first, :meth:`close` it last."""

    def __init__(self, process: subprocess.Popen[bytes] | None) -> None:
        self._process = process

    @classmethod
    def start(cls, daemon_pid: int, log_format: LogFormat | None = None) -> Reaper:
        if not sys.platform.startswith("linux"):
            return cls(None)
        process = subprocess.Popen(
            [sys.executable, "-m", MODULE, str(daemon_pid), *([log_format] if log_format else [])],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,  # one line once it is ready for SIGTERM (see close)
            start_new_session=True,
        )
        return cls(process)

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def close(self) -> None:
        """SIGTERM: the reaper sweeps (whatever is still marked is killed) and exits; waited for, bounded."""
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        # A SIGTERM that came before the reaper blocked it would end it without a sweep: wait for its ready line.
        assert process.stdout is not None
        select.select([process.stdout], [], [], _CLOSE_TIMEOUT_S)
        process.stdout.close()
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=_CLOSE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def __enter__(self) -> Reaper:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def main(argv: list[str]) -> int:
    """``DAEMON_PID [json|console]``."""
    daemon_pid = int(argv[0])
    log_format: LogFormat | None = "console" if argv[1:] == ["console"] else "json" if argv[1:] == ["json"] else None
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    set_parent_death_signal(signal.SIGTERM)
    with contextlib.suppress(OSError):
        os.write(1, b"ready\n")
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)  # the daemon closes its end; nothing more is said on it
        os.close(devnull)
    if parent_is(daemon_pid):
        signal.sigwait({signal.SIGTERM})
    # else: the daemon died before the request; sweep at once.
    killed = sweep(daemon_pid)
    if killed:
        # Imported only now: the reaper idles for the whole run, and structlog is most of what it would load.
        from elasticd.logging import configure_logging, get_logger

        with contextlib.suppress(OSError):  # stderr may be gone with the daemon's terminal
            configure_logging(log_format, stdlib=False)
            get_logger(daemon_pid=daemon_pid).warning("orphans_killed", killed=killed)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
