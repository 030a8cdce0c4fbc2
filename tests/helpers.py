"""Small helpers shared by the tests (import as ``tests.helpers``)."""

from __future__ import annotations

import socket

# Generous: the test machine has 2 cores shared with other test runs; etcd alone starts in ~0.2 s.
ETCD_READY_TIMEOUT_S = 30.0


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago; callers must tolerate losing it to another process."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
