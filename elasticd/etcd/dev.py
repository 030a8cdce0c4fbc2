"""``elasticd etcd``: a local etcd (v3 API, 127.0.0.1) for development, in the foreground until interrupted."""

from __future__ import annotations

import errno
import signal
import socket
import threading
from pathlib import Path

from elasticd.errors import EXIT_OK, ConfigError
from elasticd.etcd.server import EmbeddedEtcd

HOST = "127.0.0.1"


def serve_forever(data_dir: Path | None, port: int) -> int:
    if not 1 <= port <= 65535:
        raise ConfigError("--port", f"must be a TCP port 1-65535, got {port}")
    _check_free(port)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with EmbeddedEtcd(data_dir=data_dir, host=HOST, client_port=port) as etcd:
        print(
            f"etcd {etcd.endpoint} (data: {etcd.data_dir}); pass --etcd {etcd.endpoint}. Ctrl-C stops it.", flush=True
        )
        stop.wait()
    return EXIT_OK


def _check_free(port: int) -> None:
    """A busy port is the user's to fix; say so before etcd prints a Go stack trace about it."""
    with socket.socket() as probe:
        try:
            probe.bind((HOST, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ConfigError("--port", f"port {port} on {HOST} is already in use") from None
            raise
