"""``elasticd etcd``: a local etcd (v3 API, 127.0.0.1) for development, in the foreground until interrupted."""

from __future__ import annotations

import signal
import threading
from pathlib import Path

from elasticd.errors import EXIT_OK
from elasticd.etcd.server import EmbeddedEtcd


def serve_forever(data_dir: Path | None, port: int) -> int:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with EmbeddedEtcd(data_dir=data_dir, client_port=port) as etcd:
        print(f"etcd {etcd.endpoint} (data: {etcd.data_dir}); pass --etcd {etcd.endpoint}. Ctrl-C stops it.")
        stop.wait()
    return EXIT_OK
