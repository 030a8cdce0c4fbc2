"""Run-wide requests through etcd: ``elasticd stop`` writes ``control/drain``; every daemon polls it."""

from __future__ import annotations

import json
import os
import socket
import time

from elasticd.errors import EXIT_OK, ConfigError
from elasticd.etcd.access import EtcdAccess
from elasticd.etcd.client import EtcdClient
from elasticd.etcd.endpoints import parse_endpoints
from elasticd.keys import RunKeys, validate_run_id

DRAIN = "drain"


def drain_requested(client: EtcdClient, keys: RunKeys) -> bool:
    return client.get(keys.control(DRAIN)) is not None


def request_drain(etcd: str, run_id: str, connect_timeout_s: float, *, access: EtcdAccess | None = None) -> int:
    """``elasticd stop``: ask every node of ``run_id`` to stop its workers and exit 0."""
    if (why := validate_run_id(run_id)) is not None:
        raise ConfigError("--run-id", f"{run_id!r}: {why}")
    client = EtcdClient.connect(
        parse_endpoints(etcd), connect_timeout_s=connect_timeout_s, **(access or EtcdAccess()).connect_kwargs()
    )
    try:
        request = {"requested_at": time.time(), "by": f"{socket.gethostname()}:{os.getpid()}"}
        client.put(RunKeys(run_id).control(DRAIN), json.dumps(request).encode())
    finally:
        client.close()
    print(f"drain requested for run {run_id!r}")
    return EXIT_OK
