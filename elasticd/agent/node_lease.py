"""This node's short liveness lease: ``membership/alive/<node-id>``, gone about a second after the daemon stops.

The registry's record (``registry.py``) lives on a 10 s lease: right for ``elasticd status``, far too slow to tell the
hot path that a node vanished (power loss, a partition, SIGSTOP: nothing resets a connection, the peers' collectives
just wait). This key lives on a lease of :data:`TTL_S`, refreshed :data:`REFRESHES_PER_TTL` times per TTL; etcd clamps a
TTL to its minimum (about 1.5 times its election timeout: 1 s for the embedded etcd, 2 s for etcd's defaults) and checks
expiry every 0.5 s. The workers watch these keys (``worker/hot/watch.py``): a member's node losing its key fails the
step in flight at once and counts the member as dead for the next membership epoch. The same lease holds the daemon's
name in the rendezvous (``rdzv/alive/<name>``, :meth:`NodeLease.hold`), on both recovery paths: a re-forming round does
not wait for a node whose key is gone until its rendezvous heartbeat expires (~3 s later)
(``rendezvous/lapsed.py``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

from elasticd.errors import ElasticdError
from elasticd.etcd.client import EtcdClient, EtcdError, EtcdLeaseNotFoundError
from elasticd.keys import RunKeys

TTL_S = 1
# Four refreshes per TTL: one late refresh (a GC pause, a slow etcd round trip) must not expire the lease. Of the TTL
# etcd granted: 0.25 s for the embedded etcd's 1 s, 0.5 s for etcd's defaults' 2 s (half of the refreshes a fixed
# 0.25 s made there, for the same safety: a thousand nodes refreshed 4,000 times a second).
REFRESHES_PER_TTL = 4
REFRESH_S = TTL_S / REFRESHES_PER_TTL  # the shortest interval (a TTL etcd granted as asked)
# The longest one refresh may wait for etcd (its own client: nothing else queues before it). Short, so that a refresh
# sent while etcd had no leader is given up and the next one, to a member that has one again, goes out at once:
# after an election etcd extends every lease by about one election timeout beyond its TTL, and no more.
REQUEST_TIMEOUT_S = 1.0


class NodeLease:
    """Holds the key while the daemon runs; :meth:`close` revokes it (a clean exit is noticed at once)."""

    def __init__(
        self,
        client: EtcdClient,
        keys: RunKeys,
        node_id: str,
        *,
        on_error: Callable[[str], None] = lambda _: None,
        reconnect: Callable[[], EtcdClient] | None = None,
    ) -> None:
        self._client = client  # its own: closed by close()
        self._reconnect = reconnect
        self._connecting: threading.Thread | None = None
        self._swap = threading.Lock()  # held while self._client is replaced
        self._keys = keys
        self._key = keys.membership_alive(node_id)
        self._node_id = node_id
        self._on_error = on_error
        self._lease: int | None = None
        self._also: dict[str, str] = {}  # more keys on the same lease (hold())
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.refresh_s = REFRESH_S  # a quarter of the TTL granted

    def start(self, *, own_thread: bool = True) -> None:
        """Take the lease and keep it: refreshed by a thread of its own, or (``own_thread=False``) by whoever calls
        :meth:`tick` every :attr:`refresh_s` (``bench/control_plane_nodes.py``: one thread for many nodes)."""
        self._renew()
        if own_thread:
            self._thread = threading.Thread(target=self._keepalive, name="elasticd-node-lease", daemon=True)
            self._thread.start()

    def _current(self) -> EtcdClient:
        with self._swap:
            return self._client

    def _renew(self) -> None:
        """A new lease and the key on it (at start, and whenever the lease was lost: etcd restarted, a partition)."""
        client = self._current()
        lease, granted_s = client.grant_lease_ttl(TTL_S)
        self.refresh_s = max(granted_s, TTL_S) / REFRESHES_PER_TTL
        client.put(self._key, self._node_id, lease_id=lease)
        for key, value in list(self._also.items()):
            client.put(key, value, lease_id=lease)
        self._lease = lease

    def hold(self, key: str, value: str) -> None:
        """Keep ``key`` on this lease too: written now, and again with every new lease."""
        self._also[key] = value
        if self._lease is not None:
            with contextlib.suppress(EtcdLeaseNotFoundError):  # lapsed: the next tick's new lease puts every held key
                self._current().put(key, value, lease_id=self._lease)

    def hold_if(self, key: str, value: str, mod_revision: int) -> bool:
        """:meth:`hold`, only if ``key``'s mod_revision is ``mod_revision`` (0: absent) now; True when written."""
        lease = self._lease
        try:
            if lease is None or not self._current().put_if(key, value, mod_revision, lease_id=lease).succeeded:
                return False
        except EtcdLeaseNotFoundError:
            return False  # lapsed: not held (the next tick grants a new lease)
        self._also[key] = value
        return True

    def release(self, key: str) -> None:
        """Stop keeping ``key`` (taken by :meth:`hold`) and delete it now."""
        self._also.pop(key, None)
        self._current().delete(key)

    def _keepalive(self) -> None:
        while not self._stop.wait(self.refresh_s):
            self.tick()

    def tick(self) -> None:
        """One refresh (a new lease if the old one is gone); an error is reported, and the next tick tries again."""
        try:
            if self._lease is not None and self._current().refresh_lease(self._lease):
                return
            self._renew()
        except (EtcdError, ValueError) as exc:  # ValueError: grpc's, on the old connection closed meanwhile
            self._on_error(str(exc))  # etcd away: the key expires, peers treat us as gone; retried next tick
            self._fresh_connection()

    def _fresh_connection(self) -> None:
        """Start connecting anew after a failed refresh (the refreshes go on meanwhile on the old connection).

        A connection that lived through a partition holds what is sent on it behind TCP's retransmission backoff,
        seconds after the heal; when etcd regains quorum it extends every lease by about one election timeout only,
        and a node still waiting on its old connection then loses its key (seen: one node of three, 1 s after quorum
        came back). A new connection, made once etcd answers reads again, reaches it at once."""
        if self._reconnect is None or (self._connecting is not None and self._connecting.is_alive()):
            return
        self._connecting = threading.Thread(target=self._swap_in_fresh, name="elasticd-node-lease-connect", daemon=True)
        self._connecting.start()

    def _swap_in_fresh(self) -> None:
        assert self._reconnect is not None
        try:
            fresh = self._reconnect()
        except ElasticdError:
            return  # nobody answered within the connect timeout: the next failed refresh tries again
        with self._swap:
            if self._stop.is_set():
                fresh.close()
                return
            old, self._client = self._client, fresh
        old.close()

    def announce_leaving(self) -> None:
        """Ask this node's workers' group to let them go at its next agreed step boundary (hot recovery)."""
        self._current().put(self._keys.membership_leaving(self._node_id), self._node_id, lease_id=self._lease)

    def close(self) -> None:
        with self._swap:
            self._stop.set()  # no connection is swapped in from now on
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        if self._lease is not None:
            with contextlib.suppress(EtcdError):
                self._client.revoke_lease(self._lease)
            self._lease = None  # closing again is a no-op
        self._client.close()
