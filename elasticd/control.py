"""Run-wide requests through etcd: ``elasticd stop`` writes ``control/drain``; every daemon polls it."""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Sequence

from elasticd.endpoints import Endpoint
from elasticd.errors import EXIT_OK
from elasticd.etcd.access import EtcdAccess
from elasticd.etcd.client import EtcdClient
from elasticd.keys import RunKeys

DRAIN = "drain"


def drain_requested(client: EtcdClient, keys: RunKeys) -> bool:
    return client.get(keys.control(DRAIN)) is not None


def request_drain(
    etcd: Sequence[Endpoint], run_id: str, connect_timeout_s: float, *, access: EtcdAccess | None = None
) -> int:
    """``elasticd stop``: ask every node of ``run_id`` to stop its workers and exit 0 (options resolved by the option
    table: endpoints parsed, run id checked)."""
    client = EtcdClient.connect(
        etcd,
        connect_timeout_s=connect_timeout_s,
        **(access or EtcdAccess()).connect_kwargs(),
    )
    try:
        request = {"requested_at": time.time(), "by": f"{socket.gethostname()}:{os.getpid()}"}
        client.put(RunKeys(run_id).control(DRAIN), json.dumps(request).encode())
    finally:
        client.close()
    print(f"drain requested for run {run_id!r}")
    return EXIT_OK
