"""What every node of a lease rendezvous follows: the round record and the nodes waiting for the next round.

One thread per node keeps both in memory (:class:`Lobby`), from one etcd watch on ``rdzv/lobby/``: it reads again
only when a key there changes, which is once per membership change (a round opens or forms, a node starts or stops
waiting), never with a node's liveness. So the agent's question asked ten times a second (``num_nodes_waiting``)
costs etcd nothing, and a round's members waiting for it to form wake the moment it does.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from elasticd.etcd.client import EtcdClient, EtcdError
from elasticd.keys import RunKeys
from elasticd.rendezvous.lease_round import RoundRecord

# How long one watch lasts before it is renewed (seconds); a change wakes it at once.
WATCH_SLICE_S = 30.0
# After an etcd error, wait this long before reading again (seconds).
RETRY_S = 0.5


@dataclass(frozen=True, slots=True)
class LobbySeen:
    """The lobby as last read: the round record (None: no round yet) and the revision of its write."""

    record: RoundRecord | None
    revision: int  # the record's mod_revision: the revision that formed a formed round
    waiting: frozenset[str]  # names of the nodes waiting for the next round
    decider: tuple[int, str] | None  # (round, name) of the node that decides when an open round forms
    decider_revision: int  # the decider key's mod_revision (0: none)
    read_at: float  # time.monotonic() of the read

    def same(self, other: LobbySeen) -> bool:
        return (self.record, self.revision, self.waiting, self.decider_revision) == (
            other.record,
            other.revision,
            other.waiting,
            other.decider_revision,
        )


class Lobby:
    """Follows one run's lobby from a thread of its own; :meth:`seen` is the latest reading."""

    def __init__(self, client: EtcdClient, keys: RunKeys) -> None:
        self._client = client
        self._keys = keys
        self._changed = threading.Condition()
        self._seen: LobbySeen | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="elasticd-rdzv-lobby", daemon=True)
            self._thread.start()

    def close(self) -> None:
        self._stop.set()
        with self._changed:
            self._changed.notify_all()

    def seen(self) -> LobbySeen | None:
        with self._changed:
            return self._seen

    def read_now(self) -> LobbySeen:
        """Read the lobby from etcd now (and publish it): after this node wrote there itself."""
        return self._publish(self._read()[0])

    def wait_newer(self, than: LobbySeen | None, timeout_s: float) -> LobbySeen | None:
        """Wait up to ``timeout_s`` for a reading other than ``than``; the latest one either way (while the watch
        fails, the caller's own reads say whether etcd is away)."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while self._seen is than and not self._stop.is_set():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._changed.wait(remaining)
            return self._seen

    def _read(self) -> tuple[LobbySeen, int]:
        """One range read of the lobby: the reading and the store revision it was taken at."""
        items, revision = self._client.read_prefix(self._keys.rdzv_lobby_prefix)
        record, record_revision, decider, decider_revision = None, 0, None, 0
        waiting = []
        for key, value, mod_revision in items:
            if key == self._keys.rdzv_round:
                record, record_revision = RoundRecord.decode(value), mod_revision
            elif key == self._keys.rdzv_decider:
                round_, _, name = value.decode().partition(" ")
                decider, decider_revision = (int(round_), name), mod_revision
            elif key.startswith(self._keys.rdzv_waiting_prefix):
                waiting.append(key[len(self._keys.rdzv_waiting_prefix) :])
        seen = LobbySeen(record, record_revision, frozenset(waiting), decider, decider_revision, time.monotonic())
        return seen, revision

    def _publish(self, seen: LobbySeen) -> LobbySeen:
        with self._changed:
            if self._seen is not None and seen.same(self._seen):
                return self._seen  # nothing new: waiters keep waiting
            self._seen = seen
            self._changed.notify_all()
            return seen

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                seen, revision = self._read()
                self._publish(seen)
                self._client.wait_for_change(self._keys.rdzv_lobby_prefix, revision + 1, WATCH_SLICE_S, prefix=True)
            except EtcdError:
                self._stop.wait(RETRY_S)  # etcd away or slow: the rendezvous's own reads say so to its caller
