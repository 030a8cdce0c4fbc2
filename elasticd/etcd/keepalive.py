"""One long-lived LeaseKeepAlive stream per etcd client, shared by every lease the client refreshes.

pyetcd's ``refresh_lease`` opens a gRPC stream for each refresh and closes it after one answer: measured here, 0.86 ms
of the client's CPU per refresh against 0.26 ms for a read, and a stream set up and torn down in etcd each time. A
daemon refreshed its liveness lease four times a second (``agent/node_lease.py``; now four times per TTL granted); at a
thousand nodes that was 4,000 stream set-ups a second for etcd, and ``bench/control_plane.py`` (a thousand simulated
nodes on two cores) cannot hold its leases at all. etcd's own Go client keeps one keep-alive stream per client for all
its leases (clientv3's lessor); this does the same: a refresh is one message on the stream and its answer, matched by
lease id.

Anything unusual ends the stream and the refresh says so (:class:`StreamBroken`): the client then refreshes the old
way, a stream of its own through pyetcd, which reports and fails over as every other call does; the next refresh
opens a new stream. A refresh with no answer within its timeout ends the stream too (a partition: the next one starts
afresh) and raises TimeoutError.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pyetcd


def keepalive_request(lease_id: int) -> Any:
    """etcd's LeaseKeepAliveRequest for ``lease_id``."""
    return pyetcd.etcdrpc.LeaseKeepAliveRequest(ID=lease_id)


class StreamBroken(Exception):
    """The keep-alive stream failed or could not be opened: refresh another way."""


class _Waiter:
    def __init__(self) -> None:
        self.done = threading.Event()
        self.ttl = 0
        self.error: BaseException | None = None


class _Stream:
    """One open stream: its requests, its gRPC call and the refreshes waiting for an answer on it."""

    def __init__(self, open_call: Callable[[Iterator[Any]], Any]) -> None:
        self.requests: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.waiters: dict[int, list[_Waiter]] = {}
        self.lock = threading.Lock()
        self.ended = False
        self.call = open_call(self._outgoing())

    def _outgoing(self) -> Iterator[Any]:
        while (request := self.requests.get()) is not None:
            yield request

    def wait_for(self, lease_id: int) -> _Waiter | None:
        """A waiter for ``lease_id``'s next answer; None when the stream has ended."""
        waiter = _Waiter()
        with self.lock:
            if self.ended:
                return None
            self.waiters.setdefault(lease_id, []).append(waiter)
        return waiter

    def answer(self, lease_id: int, ttl: int) -> None:
        with self.lock:
            waiters = self.waiters.pop(lease_id, [])
        for waiter in waiters:
            waiter.ttl = ttl
            waiter.done.set()

    def end(self, error: BaseException) -> None:
        """Fail every waiting refresh and close the stream (idempotent)."""
        with self.lock:
            if self.ended:
                return
            self.ended = True
            waiters = [w for ws in self.waiters.values() for w in ws]
            self.waiters = {}
        self.requests.put(None)
        with contextlib.suppress(Exception):
            self.call.cancel()
        for waiter in waiters:
            waiter.error = error
            waiter.done.set()


class KeepAliveStream:
    """Refreshes leases over one stream, opened on first use and again after it ended.

    ``open_call(requests)`` starts the gRPC call (``LeaseKeepAlive``) and returns its answers' iterator;
    ``make_request(lease_id)`` builds one request."""

    def __init__(self, open_call: Callable[[Iterator[Any]], Any], make_request: Callable[[int], Any]) -> None:
        self._open_call = open_call
        self._make_request = make_request
        self._lock = threading.Lock()
        self._stream: _Stream | None = None
        self._closed = False

    def refresh(self, lease_id: int, timeout_s: float) -> int:
        """Refresh ``lease_id``: its TTL now (0 or less: etcd no longer knows it). Raises :class:`StreamBroken` and
        TimeoutError (module docstring)."""
        stream = self._current()
        waiter = stream.wait_for(lease_id)
        if waiter is None:
            raise StreamBroken("the keep-alive stream ended")
        stream.requests.put(self._make_request(lease_id))
        if not waiter.done.wait(timeout_s):
            stream.end(TimeoutError("no keep-alive answer"))
            raise TimeoutError(f"no keep-alive answer for lease {lease_id:x} within {timeout_s:g} s")
        if waiter.error is not None:
            raise StreamBroken(str(waiter.error) or type(waiter.error).__name__) from waiter.error
        return waiter.ttl

    def close(self) -> None:
        with self._lock:
            self._closed = True
            stream, self._stream = self._stream, None
        if stream is not None:
            stream.end(StreamBroken("closed"))

    def _current(self) -> _Stream:
        with self._lock:
            if self._closed:
                raise StreamBroken("closed")
            if self._stream is None or self._stream.ended:
                try:
                    self._stream = _Stream(self._open_call)
                except Exception as exc:  # no endpoint, a channel closed under us: the old way reports it
                    raise StreamBroken(str(exc) or type(exc).__name__) from exc
                threading.Thread(
                    target=self._read, args=(self._stream,), name="elasticd-etcd-keepalive", daemon=True
                ).start()
            return self._stream

    @staticmethod
    def _read(stream: _Stream) -> None:
        try:
            for response in stream.call:
                stream.answer(int(response.ID), int(response.TTL))
            error: BaseException = StreamBroken("etcd ended the keep-alive stream")
        except Exception as exc:  # grpc's RpcError (etcd away, cancelled): every waiting refresh hears it
            error = exc
        stream.end(error)
