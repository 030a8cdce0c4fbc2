"""A c10d :class:`torch.distributed.Store` over etcd v3, under one key prefix.

This module owns the store torch's rendezvous hands to the agent (torch wraps it in a ``PrefixStore`` per
round). Values are stored as bytes; counters (``add``) as decimal strings like c10d's stores. Blocking reads
wait on an etcd watch that starts right after the revision of the failed read, so no write is missed and
nothing polls. A timeout raises ``torch.distributed.DistStoreError`` (what ``TCPStore`` raises) naming the
missing keys; an etcd failure raises ``torch.distributed.DistNetworkError``. A view made by :meth:`bounded_by`
also stops waiting as soon as its :class:`~elasticd.rendezvous.liveness.RoundWatch` says the round lost a member
(``RoundAbandonedError``), so no wait outlives the member that has to write the key.

C++ callers (``PrefixStore``) can reach every method here except ``delete_key`` and ``num_keys``: torch's
pybind trampoline does not forward those two to Python, so call them on this object directly. :meth:`clone` is
c10d's (``PrefixStore.clone``, ``dist.shrink_group``): a store over the same keys on a connection of its own.
torch's C++ check of a Python store (``torch.distributed._test_python_store``) passes on it
(``tests/integration/test_store.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import ParamSpec, TypeVar, cast

import torch.distributed as dist

from elasticd.errors import ElasticdError
from elasticd.etcd.client import EtcdClient, EtcdError
from elasticd.rendezvous.liveness import RoundAbandonedError, RoundWatch

T = TypeVar("T")
P = ParamSpec("P")
# A wait without deadline (c10d's "no timeout" is a zero timedelta) still re-reads this often (seconds), so a
# watch lost in some way nobody reported cannot park a caller forever.
_NO_TIMEOUT_SLICE_S = 30.0


class EtcdV3Store(dist.Store):
    """c10d Store semantics on etcd: set, get, add, compare_set, wait, check, multi_get, multi_set,
    delete_key, num_keys, clone."""

    def __init__(self, client: EtcdClient, prefix: str, timeout: timedelta | None = None) -> None:
        super().__init__()  # the pybind trampoline needs its C++ half initialised before anything else
        if not prefix:
            raise ValueError("the store needs a non-empty key prefix")
        self._client = client
        self._prefix = prefix if prefix.endswith("/") else prefix + "/"
        self._watch: RoundWatch | None = None
        self._owns_client = False  # a clone's connection is its own to close; a given client is its giver's
        # C++ holds only the C++ half of a clone it asked for: the Python half must stay referenced, or every later
        # call on that clone ends in "Not implemented" (the pybind trampoline finds no Python method)
        self._clones: list[EtcdV3Store] = []
        if timeout is not None:
            self.set_timeout(timeout)

    def bounded_by(self, watch: RoundWatch) -> EtcdV3Store:
        """The same store (client, prefix, timeout) whose waits end when ``watch`` says the round is lost.

        Keep the returned object referenced while a ``PrefixStore`` wraps it: the wrapper holds only its C++ half.
        """
        view = EtcdV3Store(self._client, self._prefix, self._timeout())
        view._watch = watch
        return view

    def clone(self) -> EtcdV3Store:
        """A new store over the same keys (prefix) with the same timeout, on an etcd connection of its own (the same
        endpoints, TLS files and credentials): it works on after this store's client is closed, and :meth:`close`
        closes its connection. Its waits are not bounded by a round watch (the watch reads through this store's
        client). This store keeps every clone it made referenced, for C++ callers (see ``_clones``): a clone lives at
        least as long as the store it came from. An etcd that cannot be reached raises DistNetworkError."""
        try:
            client = self._client.reconnect()
        except ElasticdError as exc:
            raise dist.DistNetworkError(f"etcd store under {self._prefix}: cannot clone: {exc}") from exc
        twin = EtcdV3Store(client, self._prefix, self._timeout())
        twin._owns_client = True
        self._clones.append(twin)
        return twin

    def close(self) -> None:
        """Close the etcd connection this store opened (a clone's); a store over a client it was given leaves that
        client to its owner."""
        if self._owns_client:
            self._client.close()

    @property
    def prefix(self) -> str:
        return self._prefix

    def set(self, key: str, value: bytes | str) -> None:
        self._etcd(self._client.put, self._key(key), _to_bytes(value))

    def get(self, key: str) -> bytes:
        """The value of ``key``, waiting up to the store timeout for it to be set."""
        return self._wait_all([key], self._timeout())[key]

    def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the decimal counter at ``key`` (absent: 0); returns the new value."""
        full = self._key(key)
        current = self._etcd(self._client.get, full)
        while True:
            value, revision = current if current is not None else (b"0", 0)
            try:
                total = int(value) + amount
            except ValueError:
                raise dist.DistStoreError(f"add on key {key!r}: its value {value[:32]!r} is not an integer") from None
            result = self._etcd(self._client.put_if, full, str(total).encode(), revision)
            if result.succeeded:
                return total
            current = result.current  # lost a race: retry from the winner's value, no extra read

    def compare_set(self, key: str, expected_value: bytes | str, desired_value: bytes | str) -> bytes:
        """c10d semantics: set ``desired_value`` when the current value equals ``expected_value`` (or the key
        is absent and ``expected_value`` is empty); return the value that is there afterwards. When the key is
        absent and ``expected_value`` is not empty, nothing is written and ``expected_value`` is returned (as
        TCPStore)."""
        full, expected, desired = self._key(key), _to_bytes(expected_value), _to_bytes(desired_value)
        current = self._etcd(self._client.get, full)
        while True:
            if current is None:
                if expected:
                    return expected
                revision = 0
            else:
                value, revision = current
                if value != expected:
                    return value
            result = self._etcd(self._client.put_if, full, desired, revision)
            if result.succeeded:
                return desired
            current = result.current

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        """Return once every key is set; DistStoreError naming the missing ones after ``timeout`` (default:
        the store timeout)."""
        self._wait_all(list(keys), self._timeout() if timeout is None else timeout)

    def check(self, keys: Sequence[str]) -> bool:
        """True when every key is set now (no waiting)."""
        full = [self._key(k) for k in keys]
        return len(self._etcd(self._client.get_many, full)) == len(set(full))

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        """Values of ``keys`` in order, waiting (store timeout) until all are set."""
        keys = list(keys)
        found = self._wait_all(keys, self._timeout())
        return [found[k] for k in keys]

    def multi_set(self, keys: Sequence[str], values: Sequence[bytes | str]) -> None:
        if len(keys) != len(values):
            raise ValueError(f"multi_set got {len(keys)} keys but {len(values)} values")
        for key, value in zip(keys, values, strict=True):
            self.set(key, value)

    def delete_key(self, key: str) -> bool:
        """True when the key existed."""
        return self._etcd(self._client.delete, self._key(key))

    def num_keys(self) -> int:
        """How many keys this store holds (all rounds, as TCPStore counts all of its keys)."""
        return self._etcd(self._client.count_prefix, self._prefix)

    # -- internals -----------------------------------------------------------------------------------------

    def _timeout(self) -> timedelta:
        # The C++ base class holds the timeout (set_timeout, PrefixStore); torch's stubs do not declare it.
        return cast(timedelta, self.timeout)  # type: ignore[attr-defined]  # not in torch's stubs

    def _key(self, key: str | bytes) -> str:
        return self._prefix + (key.decode("utf-8", "surrogateescape") if isinstance(key, bytes) else key)

    def _wait_all(self, keys: list[str], timeout: timedelta) -> dict[str, bytes]:
        full = {self._key(k): k for k in keys}
        no_deadline = timeout.total_seconds() <= 0
        deadline = time.monotonic() + timeout.total_seconds()
        found = self._etcd(self._client.get_many, list(full))
        while len(found) < len(full):
            # Read the revision first, then the keys: a write after that read has a later revision, which the
            # watch below replays, so nothing set between the read and the start of the watch is missed.
            revision = self._etcd(self._client.revision, self._prefix)
            found = self._etcd(self._client.get_many, list(full))
            missing = [f for f in full if f not in found]
            if not missing:
                break
            remaining = _NO_TIMEOUT_SLICE_S if no_deadline else deadline - time.monotonic()
            watch = self._watch if self._watch is not None and self._watch.active else None
            if remaining <= 0:
                if watch is not None:
                    raise watch.timed_out(full[f] for f in missing)
                raise dist.DistStoreError(
                    f"wait timeout after {int(timeout.total_seconds() * 1000)}ms, "
                    f"keys: {', '.join(full[f] for f in missing)}"
                )
            if watch is not None:
                # Short slices: between two, ask whether the member that has to write is still there.
                remaining = min(remaining, watch.interval_s)
            watched = missing[0] if len(missing) == 1 else _common_prefix(missing)
            self._etcd(self._client.wait_for_change, watched, revision + 1, remaining, prefix=len(missing) > 1)
            if watch is not None:
                try:
                    watch.check()
                except RoundAbandonedError as exc:
                    raise exc.with_keys(full[f] for f in missing) from None
        return {full[f]: v for f, v in found.items()}

    def _etcd(self, call: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return call(*args, **kwargs)
        except EtcdError as exc:
            raise dist.DistNetworkError(f"etcd store under {self._prefix}: {exc}") from exc


def _common_prefix(keys: list[str]) -> str:
    # Character-wise on purpose: etcd prefixes are byte ranges, not path components.
    first, last = min(keys), max(keys)
    length = next((i for i, (a, b) in enumerate(zip(first, last, strict=False)) if a != b), min(len(first), len(last)))
    return first[:length]


def _to_bytes(value: bytes | str) -> bytes:
    return value.encode("utf-8") if isinstance(value, str) else bytes(value)
