"""``elasticd etcd``: a local etcd (v3 API, 127.0.0.1) for development, in the foreground until interrupted.

Only this user can use it: it requires a login, whose generated password is in a 0600 file of its data dir
(elasticd/etcd/server.py, ``auth=True``); the banner says how to connect.
"""

from __future__ import annotations

import errno
import signal
import socket
import threading
from pathlib import Path

from elasticd import options as o
from elasticd.errors import EXIT_OK, ConfigError
from elasticd.etcd.server import EmbeddedEtcd

HOST = "127.0.0.1"


def serve_forever(data_dir: Path | None, port: int) -> int:
    o.PORT.value(port)
    _check_free(port)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with EmbeddedEtcd(data_dir=data_dir, host=HOST, client_port=port, auth=True) as etcd:
        access = etcd.access
        print(
            f"etcd {etcd.endpoint} (data: {etcd.data_dir}); only this user can log in: user {access.user}, password "
            f"in a file readable by this user only. Ctrl-C stops it. Connect with:\n"
            f"--etcd {etcd.endpoint} --etcd-user {access.user} --etcd-password-file {access.password_file}",
            flush=True,
        )
        stop.wait()
    return EXIT_OK


def _check_free(port: int) -> None:
    """A busy port is the user's to fix; say so before etcd prints a Go stack trace about it.

    SO_REUSEADDR, as etcd's own listener has: connections of a stopped etcd in TIME_WAIT do not keep the port from
    a restart (for ~60 s); a socket that listens on it still does."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((HOST, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ConfigError(o.PORT.flag, f"port {port} on {HOST} is already in use") from None
            raise
