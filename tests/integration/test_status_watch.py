"""``elasticd status --watch`` in a pseudo-terminal, against a real 3-node run: both the nodes and a moving step
count show, a node killed shows as lost, and Ctrl-C ends the view with status 0."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import signal
import struct
import subprocess
import sys
import termios
import threading
from pathlib import Path

import pytest

from elasticd.etcd.server import EmbeddedEtcd
from tests.integration.cluster import Cluster, train_args, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[()][A-Za-z0-9]|\r")
_END_OF_FRAME = "Ctrl-C to leave"


class Terminal:
    """A process on a pseudo-terminal of 200 x 60, its output collected as plain text."""

    def __init__(self, args: list[str]) -> None:
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 60, 200, 0, 0))
        env = dict(os.environ, TERM="xterm-256color", COLUMNS="200", LINES="60")
        self.proc = subprocess.Popen(args, stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True)
        os.close(slave)
        self._master = master
        self._chunks: list[bytes] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                data = os.read(self._master, 65536)
            except OSError:
                return
            if not data:
                return
            self._chunks.append(data)

    def frames(self) -> list[str]:
        text = _ANSI.sub("", b"".join(self._chunks).decode(errors="replace"))
        return [f for f in text.split(_END_OF_FRAME) if f.strip()][:-1] or [""]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        os.close(self._master)


def header_step(frame: str) -> int | None:
    found = re.findall(r"world size \S+\s+step (\d+)", frame)
    return int(found[-1]) if found else None


def test_the_watch_shows_the_nodes_a_moving_step_and_a_lost_node_then_ends_on_ctrl_c(
    etcd: EmbeddedEtcd, tmp_path: Path
) -> None:
    names = ["watch-a", "watch-b", "watch-c"]
    with Cluster(etcd.endpoint, tmp_path, run_id="watched", min_nodes=2, max_nodes=3, script_args=train_args(900)) as c:
        for name in names:
            c.start(name)
        c.wait_step(lambda s: s["world_size"] == 3 and s["step"] >= 5, timeout_s=120, what="3 workers training")
        term = Terminal(
            [sys.executable, "-m", "elasticd", "status", "--watch", "--etcd", etcd.endpoint, "--run-id", "watched"]
        )
        try:

            def moving() -> tuple[int, int] | None:
                steps = [s for s in map(header_step, term.frames()) if s is not None]
                shown = all(name in term.frames()[-1] for name in names)
                return (steps[0], steps[-1]) if shown and len(steps) >= 2 and steps[-1] > steps[0] else None

            first, later = wait_until(moving, 30, "the view to show 3 nodes and a step count that moves")
            assert later > first
            seen = len(term.frames())
            c.nodes["watch-c"].kill()

            def lost() -> str | None:
                recent = [f for f in term.frames()[seen:] if "lost watch-c" in f or "watch-c  gone" in f]
                return recent[-1] if recent else None

            frame = wait_until(lost, 60, "the view to show watch-c lost")
            assert "re-formed in place (failure): lost watch-c" in frame or "watch-c  gone" in frame, frame
            term.proc.send_signal(signal.SIGINT)
            assert term.proc.wait(15) == 0
        finally:
            term.close()
