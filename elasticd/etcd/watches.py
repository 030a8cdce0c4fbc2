"""Watches, mixed into :class:`~elasticd.etcd.client.EtcdClient`: a one-shot wait for the next change of a key or a
prefix, and long-lived watches of several prefixes whose events go to one sink (``worker/hot/watch.py`` keeps a
group's liveness in memory from them, so that a change costs each member one event, never a re-read of O(N) keys).

Both share the client's one watch stream (pyetcd's watcher); registering and cancelling go through the client's lock.
"""

from __future__ import annotations

import contextlib
import functools
import queue
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
import pyetcd
import pyetcd.events
import pyetcd.exceptions
import pyetcd.utils

from elasticd.etcd.errors import EtcdError
from elasticd.etcd.ranges import check_prefix

T = TypeVar("T")
_RPC_ERRORS = (pyetcd.exceptions.Etcd3Exception, grpc.RpcError)

if TYPE_CHECKING:
    import threading


@dataclass(frozen=True, slots=True)
class WatchEvent:
    key: str
    value: bytes  # empty for a deletion
    revision: int  # the change's (its mod_revision)
    deleted: bool


def _events(response: Any) -> list[WatchEvent]:
    return [
        WatchEvent(
            bytes(event.key).decode("utf-8", "surrogateescape"),
            bytes(event.value),
            int(event.mod_revision),
            isinstance(event, pyetcd.events.DeleteEvent),
        )
        for event in response.events
    ]


class Compacted(Exception):
    """The history a watch asked for is gone (etcd compacted it): read the state again."""


class Watches:
    """The watches of an etcd client (see the module docstring)."""

    _raw: Any  # pyetcd's client
    _lock: threading.RLock

    if TYPE_CHECKING:

        def _call(self, operation: str, fn: Callable[[], T], report: bool = True, renewed: bool = False) -> T: ...

        def _watch_error(self, error: BaseException) -> EtcdError: ...

    def wait_for_change(self, key_or_prefix: str, start_revision: int, timeout_s: float, prefix: bool = False) -> bool:
        """Block until the key (or any key under the prefix) changes at a revision >= ``start_revision``.

        Returns False when ``timeout_s`` passed without a change. True may be spurious (a broken watch stream,
        e.g. etcd restarting, is reported to ``on_error`` and returns True): callers re-read and wait again,
        so no change is missed and a lasting outage surfaces as an EtcdError from the re-read."""
        events: queue.SimpleQueue[Any] = queue.SimpleQueue()
        kwargs: dict[str, Any] = {"start_revision": start_revision}
        if prefix:
            check_prefix(key_or_prefix)
            kwargs["range_end"] = pyetcd.utils.prefix_range_end(pyetcd.utils.to_bytes(key_or_prefix))
        watch_id = self._call("watch", lambda: self._raw.add_watch_callback(key_or_prefix, events.put, **kwargs))
        try:
            item = events.get(timeout=max(timeout_s, 0.0))
        except queue.Empty:
            return False
        finally:
            self.cancel_watches([watch_id])
        if isinstance(item, pyetcd.exceptions.RevisionCompactedError):
            return True  # history we asked for is gone: something changed, the caller re-reads
        if isinstance(item, Exception):
            error = self._watch_error(item)
            if error.code != "UNAVAILABLE":
                raise error from None
            # The stream broke (etcd restarting, failover): wake the caller to re-read, which waits for etcd
            # within the request timeout and raises if it stays away.
        return True

    def watch_prefixes(
        self, prefixes: Sequence[str], start_revision: int, sink: Callable[[list[WatchEvent] | BaseException], None]
    ) -> list[int]:
        """Watch every key under each of ``prefixes`` from ``start_revision`` on, until :meth:`cancel_watches`.

        ``sink`` gets, from the watch stream's thread, each answer's events (in revision order per prefix) or an
        exception: pass that to :meth:`watch_failure`. Returns the watches' ids."""
        ids: list[int] = []

        def deliver(response: Any) -> None:
            sink(response if isinstance(response, BaseException) else _events(response))

        def add(prefix: str) -> int:
            end = pyetcd.utils.prefix_range_end(pyetcd.utils.to_bytes(prefix))
            return int(self._raw.add_watch_callback(prefix, deliver, range_end=end, start_revision=start_revision))

        try:
            for prefix in prefixes:
                check_prefix(prefix)
                ids.append(self._call("watch", functools.partial(add, prefix)))
        except BaseException:
            self.cancel_watches(ids)
            raise
        return ids

    def watch_failure(self, item: BaseException) -> Exception:
        """What a watch's exception means: :class:`Compacted`, or the :class:`EtcdError` it is (reported)."""
        if isinstance(item, pyetcd.exceptions.RevisionCompactedError):
            return Compacted(str(item))
        return self._watch_error(item)

    def cancel_watches(self, ids: Sequence[int]) -> None:
        # Only queues cancel requests on the shared stream; cannot block on the network. A failover may have
        # replaced the stream (and its watches with it), and pyetcd then finds no endpoint: ignore.
        with self._lock, contextlib.suppress(*_RPC_ERRORS):
            for watch_id in ids:
                self._raw.watcher.cancel(watch_id)
