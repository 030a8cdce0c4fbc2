"""The node registry: ``/elasticd/<run-id>/nodes/<node-id>``, a JSON record kept alive by an etcd lease.

Each daemon owns its record. The lease makes liveness automatic: a node killed with kill -9 disappears from the
registry ``ttl_s`` seconds later, with nobody cleaning up. A keep-alive thread refreshes the lease and, when the lease
was lost (etcd restarted, a long partition), grants a new one and writes the record again.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from elasticd import __version__
from elasticd.errors import NodeIdInUseError
from elasticd.etcd.client import EtcdClient, EtcdError
from elasticd.keys import RunKeys
from elasticd.logging import get_logger

# Seconds a dead daemon's record outlives it; the refresh runs every ttl/3 so two missed refreshes are tolerated.
DEFAULT_TTL_S = 10


class NodeRegistry:
    """Claims, updates and releases this node's record."""

    def __init__(
        self,
        client: EtcdClient,
        keys: RunKeys,
        node_id: str,
        *,
        ttl_s: int = DEFAULT_TTL_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._client = client
        self._key = keys.node(node_id)
        self._ttl_s = ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._lease: int | None = None
        self._record: dict[str, Any] = {
            "node_id": node_id,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "version": __version__,
            "state": "starting",
            "round": None,
            "workers": 0,
            "world_size": None,
            "nodes": None,
            "last_step": None,
        }
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._log = get_logger(node_id=node_id)

    @property
    def record(self) -> dict[str, Any]:
        with self._lock:
            return dict(self._record)

    def claim(self, wait_s: float | None = None) -> None:
        """Create the record; if a live one holds the id, wait up to ``wait_s`` (default: the TTL + 2 s) for it.

        A record left by a killed daemon of the same id (a restarted pod) expires within the TTL, so waiting that
        long tells a restart from a second live daemon, which gets :class:`NodeIdInUseError`.
        """
        deadline = time.monotonic() + (self._ttl_s + 2 if wait_s is None else wait_s)
        lease = self._client.grant_lease(self._ttl_s)
        while True:
            if self._client.create(self._key, self._encode(), lease_id=lease):
                with self._lock:
                    self._lease = lease
                return
            if time.monotonic() >= deadline:
                self._client.revoke_lease(lease)
                held = self._client.get(self._key)
                owner = json.loads(held[0]) if held else {}
                raise NodeIdInUseError(
                    f"node id {self._record['node_id']!r} is held by a live daemon "
                    f"(host {owner.get('host')}, pid {owner.get('pid')}); pass a unique --node-id"
                )
            self._client.refresh_lease(lease)
            time.sleep(0.5)

    def update(self, **fields: Any) -> None:
        """Merge ``fields`` into the record and write it (errors are logged: the keep-alive rewrites it later)."""
        with self._lock:
            self._record.update(fields)
            lease = self._lease
        if lease is None:
            return
        try:
            self._client.put(self._key, self._encode(), lease_id=lease)
        except EtcdError as exc:
            self._log.warning("registry_update_failed", error=str(exc))

    def start_keepalive(self) -> None:
        self._thread = threading.Thread(target=self._keepalive, name="elasticd-registry", daemon=True)
        self._thread.start()

    def _keepalive(self) -> None:
        interval_s = self._ttl_s / 3
        while not self._stop.wait(interval_s):
            try:
                with self._lock:
                    lease = self._lease
                if lease is not None and self._client.refresh_lease(lease):
                    continue
                # The lease is gone (etcd restarted or we were cut off longer than the TTL): claim anew.
                new_lease = self._client.grant_lease(self._ttl_s)
                with self._lock:
                    self._lease = new_lease
                self._client.put(self._key, self._encode(), lease_id=new_lease)
                self._log.info("registry_lease_renewed", lease=new_lease)
            except EtcdError as exc:
                self._log.warning("registry_keepalive_failed", error=str(exc))

    def release(self) -> None:
        """Stop the keep-alive and remove the record (revoking the lease deletes it at once)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._lock:
            lease, self._lease = self._lease, None
        if lease is not None:
            with contextlib.suppress(EtcdError):  # the lease expires on its own within the TTL
                self._client.revoke_lease(lease)

    def _encode(self) -> bytes:
        with self._lock:
            record = dict(self._record, updated_at=self._clock())
        return json.dumps(record, separators=(",", ":")).encode()


def read_nodes(client: EtcdClient, keys: RunKeys) -> list[dict[str, Any]]:
    """Every live node record of the run, sorted by node id; malformed records are skipped."""
    nodes = []
    for _key, value, _rev in client.get_prefix(keys.nodes_prefix):
        try:
            record = json.loads(value)
        except ValueError:
            continue
        if isinstance(record, dict):
            nodes.append(record)
    return sorted(nodes, key=lambda r: str(r.get("node_id")))
