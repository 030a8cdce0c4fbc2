"""torch's rendezvous state held in etcd v3: compare-and-set on ``mod_revision``, expiry through a lease.

This module owns the ``rdzv/state`` key of a run. The value is torch's pickled state, stored as is (etcd v3
keeps binary); the fencing token torch passes around is the key's ``mod_revision``. The key rides on a lease
owned by this backend, so the state of a run nobody writes to any more disappears after ``ttl_s`` by itself.

A state that is not torch's pickle is refused on purpose (``RendezvousStateError``, as a corrupt state): every agent
unpickles what it reads, so nothing else may pass for the state. torch's own backend cases
(``RendezvousBackendTestMixin``, ``test/distributed/elastic/rendezvous/rendezvous_backend_test.py``, not installed with
torch) pass on this backend, all eight once their states are pickles; with their raw ``b"x"`` states the six that
write one fail on that refusal alone.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousStateError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend, Token

from elasticd.etcd.client import EtcdClient, EtcdError, EtcdLeaseNotFoundError, PutIfResult
from elasticd.keys import RunKeys

# Two hours, as torch's etcd backends: a run that nobody touches for that long is abandoned.
DEFAULT_TTL_S = 7200
# pickle protocols >= 2 start with the PROTO opcode; torch's state holder always writes such a pickle.
_PICKLE_PROTO = 0x80


class EtcdV3RendezvousBackend(RendezvousBackend):
    """A :class:`RendezvousBackend` for ``DynamicRendezvousHandler`` over the etcd v3 API (name ``etcd-v3``).

    Thread-safe: torch calls it from the agent's thread and from the keep-alive timer thread.
    """

    def __init__(
        self,
        client: EtcdClient,
        run_id: str,
        *,
        ttl_s: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not run_id:
            raise ValueError("The run id must be a non-empty string.")
        self._client = client
        self._key = RunKeys(run_id).rdzv_state
        self._ttl_s = ttl_s if ttl_s and ttl_s > 0 else DEFAULT_TTL_S
        self._clock = clock
        self._lock = threading.Lock()
        self._lease_id: int | None = None
        self._lease_refreshed_at = 0.0
        # the state's revision as each thread last read or wrote it (rendezvous/wakeup.py watches from there)
        self._seen = threading.local()

    @property
    def name(self) -> str:
        """See base class."""
        return "etcd-v3"

    @property
    def key(self) -> str:
        return self._key

    @property
    def lease_id(self) -> int | None:
        """The lease this backend writes the state on (None before its first write)."""
        return self._lease_id

    def last_revision(self) -> int | None:
        """The state's mod_revision as the calling thread last saw it (None: no state, or not read yet)."""
        revision: int | None = getattr(self._seen, "revision", None)
        return revision

    def get_state(self) -> tuple[bytes, Token] | None:
        """See base class; the token is the key's mod_revision."""
        try:
            current = self._client.get(self._key)
        except EtcdError as exc:
            raise _connection_error(exc) from exc
        self._seen.revision = None if current is None else current[1]
        return None if current is None else self._checked(current)

    def set_state(self, state: bytes, token: Token | None = None) -> tuple[bytes, Token, bool] | None:
        """See base class: one etcd transaction writes ``state`` only if the key's mod_revision still equals
        ``token`` (``None``: only if there is no state) and returns the state it leaves, ours or the winner's.
        """
        if token is None:
            expected = 0
        else:
            try:
                expected = int(token)
            except (TypeError, ValueError):
                # As torch's etcd-v2 backend: a token we never issued cannot match; report what is there.
                current = self.get_state()
                return None if current is None else (*current, False)
        try:
            result = self._put_if(state, expected)
        except EtcdError as exc:
            raise _connection_error(exc) from exc
        self._seen.revision = None if result.current is None else result.current[1]
        if result.current is None:
            return None
        value, revision = self._checked(result.current)
        return value, revision, result.succeeded

    def _put_if(self, state: bytes, expected: int) -> PutIfResult:
        lease_id = self._live_lease()
        try:
            return self._client.put_if(self._key, state, expected, lease_id=lease_id)
        except EtcdLeaseNotFoundError:
            # Expired while nobody wrote, or etcd lost its data: take a new lease and write once more.
            with self._lock:
                if self._lease_id == lease_id:
                    self._lease_id = None
            return self._client.put_if(self._key, state, expected, lease_id=self._live_lease())

    def _live_lease(self) -> int:
        with self._lock:
            now = self._clock()
            if self._lease_id is not None and now - self._lease_refreshed_at >= self._ttl_s / 4:
                # Refreshing at a quarter of the TTL keeps the lease alive through three missed refreshes.
                if not self._client.refresh_lease(self._lease_id):
                    self._lease_id = None
                else:
                    self._lease_refreshed_at = now
            if self._lease_id is None:
                self._lease_id = self._client.grant_lease(self._ttl_s)
                self._lease_refreshed_at = now
            return self._lease_id

    def _checked(self, current: tuple[bytes, int]) -> tuple[bytes, int]:
        value, revision = current
        if not value or value[0] != _PICKLE_PROTO:
            raise RendezvousStateError(
                f"The rendezvous state at {self._key} (revision {revision}) is corrupt: it is not a pickle "
                f"written by torch's rendezvous (starts with {value[:8]!r})."
            )
        return value, revision


def _connection_error(exc: EtcdError) -> RendezvousConnectionError:
    return RendezvousConnectionError(f"The connection to etcd has failed: {exc}")
