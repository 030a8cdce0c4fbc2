"""Is a member that did not bid dead? Two answers, the fast one from the kernel, the slow one from etcd.

A member of the hot path keeps a listening TCP socket open (:class:`ProbeListener`) and publishes its address.
After a failure, the survivors probe every member that has not bid for the next epoch (:func:`probe`):

- **refused**: the port is closed, the process is gone (kill -9, a crash, its daemon took it down). The host's
  kernel answers at once, so a killed worker is known dead in about a millisecond, not after a lease expires;
- **accepted**: the process exists. It may still be stopped (SIGSTOP: the kernel accepts for a stopped process) or
  stuck: its node's liveness lease (``agent/node_lease.py``, about a second) says whether its daemon is alive;
- **no answer** within the probe timeout: the host itself is unreachable (power loss, partition); again the lease.

So a member counts as dead when its port refuses or its node's lease is gone, and never on a timer shorter than a
step (``../shared/HOT-RECOVERY.md``: a short grace once excluded a live survivor whose steps took seconds).

A listener also **greets** every connection with one byte and its name (a member's, empty for a daemon) before it
closes it, from a thread of its own that does nothing else (:func:`greet`): a connection the kernel accepted that
brings no greeting within the timeout is **silent**: the process is stopped (SIGSTOP, a frozen VM) or wedged. That
is a verdict on the process, not on its steps, and not on the network (a partition makes the connection time out:
unreachable). Greeted under another name, the port was freed and taken again by another process: the one asked for
is gone (refused). The hot path's silence
watch greets the next node's daemon (``worker/hot/silence.py``), so that a stopped node is known dead before its
lease expires (2 s at etcd's default timing), and a killed one before its workers' sockets close.

Both sides of the probe live here, below the worker library (whose hot path listens and probes) and the daemon
(whose joining node probes a group before it joins, ``group_record.py``); plain sockets, no torch.
"""

from __future__ import annotations

import contextlib
import errno
import socket
import threading
from collections.abc import Callable
from enum import StrEnum

# How long one probe waits for a connection: on a LAN an accept takes well under a millisecond; past this the host
# is treated as unreachable and the lease decides.
PROBE_TIMEOUT_S = 0.2
# What a listener sends every connection before it closes it (greet()), then its name.
GREETING = b"\x01"
_GREETING_MAX = 512  # longer than any name: a member's is its fencing token and a rank


class Probe(StrEnum):
    REFUSED = "refused"  # nobody listens: the process is gone
    ACCEPTED = "accepted"  # the process exists (maybe stopped)
    UNREACHABLE = "unreachable"  # no answer: the lease decides
    SILENT = "silent"  # accepted by the kernel, never greeted (greet()): the process is stopped or wedged


class ProbeListener:
    """A listening socket in the worker: connections are accepted and closed by a daemon thread."""

    def __init__(self, host: str, name: str = "") -> None:
        self._greeting = GREETING + name.encode()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind((host, 0))
        self._sock.listen(64)
        self.port = int(self._sock.getsockname()[1])
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="elasticd-hot-probe", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            with contextlib.suppress(OSError):  # a plain probe() may have gone already
                conn.sendall(self._greeting)
            conn.close()

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()


def probe(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> Probe:
    """Connect to ``host:port`` once."""
    return _connect(address, timeout_s, lambda _conn: Probe.ACCEPTED)


def greet(address: str, timeout_s: float = PROBE_TIMEOUT_S, name: str | None = None) -> Probe:
    """Connect to ``host:port`` and wait up to ``timeout_s`` for the listener's greeting: ACCEPTED (greeted),
    SILENT (connected, never greeted), REFUSED or UNREACHABLE (as :func:`probe`). With ``name``, a greeting under
    another name is REFUSED: another process listens on the port now (seen once in the suite, after a worker's end)."""

    def greeted(conn: socket.socket) -> Probe:
        try:
            greeting = _greeting(conn)
        except TimeoutError:
            return Probe.SILENT
        if name is not None and greeting and greeting != GREETING + name.encode():
            return Probe.REFUSED
        return Probe.ACCEPTED  # greeted, or closed without a greeting: alive enough to close it

    return _connect(address, timeout_s, greeted)


def _greeting(conn: socket.socket) -> bytes:
    """What the listener sent before it closed the connection (at most ``_GREETING_MAX`` bytes)."""
    received = b""
    while len(received) < _GREETING_MAX:
        part = conn.recv(_GREETING_MAX)
        if not part:
            break
        received += part
    return received


def _connect(address: str, timeout_s: float, then: Callable[[socket.socket], Probe]) -> Probe:
    """``then(connection)`` once connected to ``host:port``; REFUSED or UNREACHABLE when that fails."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s) as conn:
            return then(conn)
    except ConnectionRefusedError:
        return Probe.REFUSED
    except OSError as exc:
        if exc.errno in (errno.ECONNREFUSED, errno.ECONNRESET):
            return Probe.REFUSED
        return Probe.UNREACHABLE
