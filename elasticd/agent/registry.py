"""The node registry: ``/elasticd/<run-id>/nodes/<node-id>``, a JSON record kept alive by an etcd lease.

Each daemon owns its record. The lease makes liveness automatic: a node killed with kill -9 disappears from the
registry ``ttl_s`` seconds later, with nobody cleaning up. A keep-alive thread refreshes the lease every second and,
when the lease was lost (etcd restarted, a long partition), grants a new one and writes the record again.

Once the keep-alive runs, :meth:`NodeRegistry.update` only changes the record in memory and wakes that thread to
write it: an update comes from the supervisor loop and from the beat receiver's thread, and neither may wait on etcd
(seen: a beat thread held ~5 s by a write while etcd regained quorum processed the worker's ``reconfigured`` beat
too late, and the daemon then waited out torch's 5-minute exit barrier for a node the group had already let go).

A second daemon with the same node id is told apart from a restart of a dead one (:class:`Holder`): on the same
machine at once, from the process identity in the record (``elasticd/procid.py``); elsewhere by watching the
holder's lease, which a live holder refreshes every second.
"""

from __future__ import annotations

import contextlib
import enum
import json
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from elasticd import __version__, procid
from elasticd.errors import NodeIdInUseError
from elasticd.etcd.client import EtcdClient, EtcdError
from elasticd.keys import RunKeys
from elasticd.logging import get_logger

# Seconds a dead daemon's record outlives it.
DEFAULT_TTL_S = 10
# Seconds between refreshes of the record's lease (at most ttl/3): short, so that a second daemon with the same node
# id sees the lease refreshed, the holder alive, within ~1.5 s; it costs one small etcd call per second per node.
REFRESH_INTERVAL_S = 1.0
# Seconds between looks at a held record while claiming.
_CLAIM_POLL_S = 0.2
# etcd reports a lease's remaining TTL in whole seconds, measured on the server; this much of the elapsed time we
# measure here may be request latency, not time the server saw pass.
_LATENCY_MARGIN_S = 0.25

# Changes kept in a node's record for `elasticd status --watch` (each is one line there).
RECENT_KEPT = 5


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
        probe: str | None = None,
    ) -> None:
        """``probe``: ``host:port`` where this daemon answers the other daemons' reachability probes."""
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
            "epoch": None,  # the membership epoch in force (hot recovery; agent/reconfig.py), None before the first
            "probe": probe,  # agent/reachability.py
            **procid.identity(),  # boot_id, pid_ns, pid_start: lets a daemon on this machine tell if we still run
        }
        self._stop = threading.Event()
        self._wake = threading.Event()  # set by update() and release(): the keep-alive writes the record now
        self._thread: threading.Thread | None = None
        self._log = get_logger(node_id=node_id)

    @property
    def record(self) -> dict[str, Any]:
        with self._lock:
            return dict(self._record)

    def claim(self, wait_s: float | None = None) -> None:
        """Create the record; if another daemon holds the id, tell whether it is alive (:class:`Holder`).

        A live holder gets :class:`NodeIdInUseError` at once (same machine) or once its lease is seen refreshed
        (~1.5 s). A holder known to be dead (same machine, its process gone) is replaced at once. Otherwise the
        record is waited for up to ``wait_s`` (default: the TTL + 2 s): a killed daemon's record expires within
        the TTL, so one that outlives that wait belongs to a live daemon.
        """
        deadline = time.monotonic() + (self._ttl_s + 2 if wait_s is None else wait_s)
        lease = self._client.grant_lease(self._ttl_s)
        holder = Holder(self._client, self._key)
        while True:
            if self._client.create(self._key, self._encode(), lease_id=lease):
                with self._lock:
                    self._lease = lease
                return
            state = holder.look()
            if state == HolderState.GONE and holder.lease is not None:
                self._log.warning("stale_node_record_replaced", holder=holder.description)
                with contextlib.suppress(EtcdError):  # revoking deletes the record; a failure is retried
                    self._client.revoke_lease(holder.lease)
                continue
            if state == HolderState.ALIVE or time.monotonic() >= deadline:
                self._client.revoke_lease(lease)
                raise NodeIdInUseError(
                    f"node id {self._record['node_id']!r} is held by a live daemon ({holder.description}); "
                    "pass a unique --node-id"
                )
            self._client.refresh_lease(lease)
            time.sleep(_CLAIM_POLL_S)

    def update(self, **fields: Any) -> None:
        """Merge ``fields`` into the record and have it written: by the keep-alive thread once it runs (this returns
        at once), else here. A failed write is logged and retried at the next refresh."""
        with self._lock:
            self._record.update(fields)
            lease, writer = self._lease, self._thread
        if lease is None:
            return
        if writer is not None:
            self._wake.set()
            return
        self._write(lease)

    def _write(self, lease: int) -> bool:
        try:
            self._client.put(self._key, self._encode(), lease_id=lease)
        except EtcdError as exc:
            self._log.warning("registry_update_failed", error=str(exc))
            return False
        return True

    def note(self, kind: str, **fields: Any) -> None:
        """Add a change (a restart, a re-formation in place, a fallback) to the record's ``recent``, newest last and
        at most :data:`RECENT_KEPT` (``elasticd status --watch`` shows them)."""
        entry = {"at": round(time.time(), 3), "kind": kind, **{k: v for k, v in fields.items() if v is not None}}
        with self._lock:
            recent = [*self._record.get("recent", []), entry][-RECENT_KEPT:]
        self.update(recent=recent)

    def start_keepalive(self) -> None:
        self._thread = threading.Thread(target=self._keepalive, name="elasticd-registry", daemon=True)
        self._thread.start()

    def _keepalive(self) -> None:
        interval_s = min(self._ttl_s / 3, REFRESH_INTERVAL_S)
        refresh_at = time.monotonic() + interval_s
        unwritten = False  # an update whose write failed: written again with the next refresh
        while True:
            woken = self._wake.wait(max(refresh_at - time.monotonic(), 0.0))
            if self._stop.is_set():
                return
            self._wake.clear()
            with self._lock:
                lease = self._lease
            if (woken or unwritten) and lease is not None:
                unwritten = not self._write(lease)
            if time.monotonic() < refresh_at:
                continue
            refresh_at = time.monotonic() + interval_s
            try:
                if lease is not None and self._client.refresh_lease(lease):
                    continue
                # The lease is gone (etcd restarted or we were cut off longer than the TTL): claim anew.
                new_lease = self._client.grant_lease(self._ttl_s)
                with self._lock:
                    self._lease = new_lease
                self._client.put(self._key, self._encode(), lease_id=new_lease)
                unwritten = False
                self._log.info("registry_lease_renewed", lease=new_lease)
            except EtcdError as exc:
                self._log.warning("registry_keepalive_failed", error=str(exc))

    def release(self) -> None:
        """Stop the keep-alive and remove the record (revoking the lease deletes it at once)."""
        self._stop.set()
        self._wake.set()
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


class HolderState(enum.Enum):
    FREE = "free"  # nobody holds the id (any more)
    ALIVE = "alive"  # a live daemon holds it
    GONE = "gone"  # the holder is known to be dead: it ran on this machine and its process is gone
    UNKNOWN = "unknown"  # not known yet: look again


class Holder:
    """Evidence, gathered over successive :meth:`look` calls, about the daemon whose record holds a node id."""

    def __init__(self, client: EtcdClient, key: str, clock: Callable[[], float] = time.monotonic) -> None:
        self._client = client
        self._key = key
        self._clock = clock
        self.lease: int | None = None
        self.record: dict[str, Any] = {}
        self._first_ttl: tuple[int, int, float] | None = None  # (lease, remaining TTL in s, when we read it)

    @property
    def description(self) -> str:
        return f"host {self.record.get('host')}, pid {self.record.get('pid')}"

    def look(self) -> HolderState:
        held = self._client.get(self._key)
        if held is None:
            return HolderState.FREE
        try:
            record = json.loads(held[0])
        except ValueError:
            record = None
        self.record = record if isinstance(record, dict) else {}
        self.lease = self._client.lease_of(self._key)
        if procid.same_machine(self.record):
            return HolderState.ALIVE if procid.still_running(self.record) else HolderState.GONE
        if self.lease is None:
            return HolderState.UNKNOWN
        return self._judge_ttl(self.lease, self._client.lease_ttl(self.lease), self._clock())

    def _judge_ttl(self, lease: int, ttl: int, now: float) -> HolderState:
        # Unrefreshed, the remaining TTL falls as fast as time passes; a reading that fell less than the time that
        # passed (less one second of rounding down and the request latency) proves that the holder refreshed it.
        if ttl < 0:
            return HolderState.FREE
        if self._first_ttl is None or self._first_ttl[0] != lease:
            self._first_ttl = (lease, ttl, now)
            return HolderState.UNKNOWN
        _, first, then = self._first_ttl
        refreshed = ttl >= first + 1 - (now - then - _LATENCY_MARGIN_S)
        return HolderState.ALIVE if refreshed else HolderState.UNKNOWN
