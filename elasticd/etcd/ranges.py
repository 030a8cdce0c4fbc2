"""Reads of key ranges, mixed into :class:`~elasticd.etcd.client.EtcdClient`: prefixes, counts, keys alone, and reads
as of an earlier revision (``rendezvous/lease_handler.py`` ranks a round's members by counting at the revision that
formed it). Each goes through the client's ``_call`` (its lock, timeout and error translation)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

T = TypeVar("T")


def check_prefix(prefix: str) -> None:
    # etcd reads an empty range start as "no key"; elasticd never means "the whole keyspace".
    if not prefix:
        raise ValueError("an etcd key prefix must not be empty")


class RangeReads:
    """The range reads of an etcd client (see the module docstring)."""

    _raw: Any  # pyetcd's client

    if TYPE_CHECKING:

        def _call(self, operation: str, fn: Callable[[], T], report: bool = True, renewed: bool = False) -> T: ...

    def get_prefix(self, prefix: str, revision: int | None = None) -> list[tuple[str, bytes, int]]:
        """(key, value, mod_revision) of every key under ``prefix``, in key order (as of ``revision``; None: now)."""
        check_prefix(prefix)
        kwargs: dict[str, Any] = {} if revision is None else {"revision": revision}
        response = self._call("get_prefix", lambda: self._raw.get_prefix_response(prefix, **kwargs))
        return [
            (bytes(kv.key).decode("utf-8", "surrogateescape"), bytes(kv.value), int(kv.mod_revision))
            for kv in response.kvs
        ]

    def read_prefix(self, prefix: str) -> tuple[list[tuple[str, bytes, int]], int]:
        """:meth:`get_prefix` and the store's revision it was read at (a watch from the next one misses nothing)."""
        check_prefix(prefix)
        response = self._call("get_prefix", lambda: self._raw.get_prefix_response(prefix))
        items = [
            (bytes(kv.key).decode("utf-8", "surrogateescape"), bytes(kv.value), int(kv.mod_revision))
            for kv in response.kvs
        ]
        return items, int(response.header.revision)

    def read_key(self, key: str) -> tuple[tuple[bytes, int] | None, int]:
        """``get``'s (value, mod_revision) or None, and the store's revision it was read at, in one request."""
        response = self._call("get", lambda: self._raw.get_response(key))
        found = (bytes(response.kvs[0].value), int(response.kvs[0].mod_revision)) if response.kvs else None
        return found, int(response.header.revision)

    def count_prefix(self, prefix: str) -> int:
        return self.count_prefix_at(prefix)[0]

    def count_prefix_at(self, prefix: str) -> tuple[int, int]:
        """How many keys lie under ``prefix``, and the revision of that answer (a wait from the next one misses
        nothing written after it): one small answer whatever the count."""
        check_prefix(prefix)
        response = self._call("count", lambda: self._raw.get_prefix_response(prefix, count_only=True))
        return int(response.count), int(response.header.revision)

    def count_range(self, start: str, end: str, revision: int | None = None) -> int:
        """How many keys lie in ``[start, end)`` as of ``revision`` (None: now): one small answer whatever the count."""
        kwargs: dict[str, Any] = {"range_end": end, "count_only": True}
        if revision is not None:
            kwargs["revision"] = revision
        return int(self._call("count", lambda: self._raw.get_response(start, **kwargs)).count)

    def keys_under(self, prefix: str, *, limit: int = 0, revision: int | None = None) -> list[str]:
        """The keys under ``prefix`` in key order (the first ``limit`` when it is > 0), without their values."""
        check_prefix(prefix)
        kwargs: dict[str, Any] = {"keys_only": True}
        if limit > 0:
            kwargs["limit"] = limit
        if revision is not None:
            kwargs["revision"] = revision
        response = self._call("get_prefix", lambda: self._raw.get_prefix_response(prefix, **kwargs))
        return [bytes(kv.key).decode("utf-8", "surrogateescape") for kv in response.kvs]
