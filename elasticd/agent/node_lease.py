"""This node's short liveness lease: ``membership/alive/<node-id>``, gone about a second after the daemon stops.

The registry's record (``registry.py``) lives on a 10 s lease: right for ``elasticd status``, far too slow to tell
the hot path that a node vanished (power loss, a partition, SIGSTOP: nothing resets a connection, the peers'
collectives just wait). This key lives on a lease of :data:`TTL_S`, refreshed every :data:`REFRESH_S`; etcd clamps a
TTL to its minimum (about 1.5 times its election timeout: 1 s for the embedded etcd, 2 s for etcd's defaults) and checks
expiry every 0.5 s. The workers watch these keys (``worker/hot/watch.py``): a member's node losing its key fails the
step in flight at once and counts the member as dead for the next membership epoch.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

from elasticd.etcd.client import EtcdClient, EtcdError
from elasticd.keys import RunKeys

TTL_S = 1
# Four refreshes per TTL: one late refresh (a GC pause, a slow etcd round trip) must not expire the lease.
REFRESH_S = 0.25


class NodeLease:
    """Holds the key while the daemon runs; :meth:`close` revokes it (a clean exit is noticed at once)."""

    def __init__(
        self, client: EtcdClient, keys: RunKeys, node_id: str, *, on_error: Callable[[str], None] = lambda _: None
    ) -> None:
        self._client = client
        self._keys = keys
        self._key = keys.membership_alive(node_id)
        self._node_id = node_id
        self._on_error = on_error
        self._lease: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._renew()
        self._thread = threading.Thread(target=self._keepalive, name="elasticd-node-lease", daemon=True)
        self._thread.start()

    def _renew(self) -> None:
        """A new lease and the key on it (at start, and whenever the lease was lost: etcd restarted, a partition)."""
        lease = self._client.grant_lease(TTL_S)
        self._client.put(self._key, self._node_id, lease_id=lease)
        self._lease = lease

    def _keepalive(self) -> None:
        while not self._stop.wait(REFRESH_S):
            try:
                if self._lease is not None and self._client.refresh_lease(self._lease):
                    continue
                self._renew()
            except EtcdError as exc:
                self._on_error(str(exc))  # etcd away: the key expires, peers treat us as gone; retried next tick

    def announce_leaving(self) -> None:
        """Ask this node's workers' group to let them go at its next agreed step boundary (hot recovery)."""
        self._client.put(self._keys.membership_leaving(self._node_id), self._node_id, lease_id=self._lease)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        if self._lease is not None:
            with contextlib.suppress(EtcdError):
                self._client.revoke_lease(self._lease)
