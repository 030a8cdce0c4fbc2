"""The failure watch's verdict on a lease seen gone right after etcd was away (worker/hot/watch.py).

etcd's outage is played by a client whose watch stream breaks and whose reads fail, then answer: the fault under test
is what the watch does with the answers that follow an outage (real ones, etcd members cut off:
tests/integration/test_etcd_cluster.py).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import Any

from elasticd.etcd.client import EtcdError
from elasticd.etcd.watches import WatchEvent
from elasticd.keys import RunKeys
from elasticd.worker.hot.watch import FailureWatch
from tests.integration.cluster import wait_until

KEYS = RunKeys("watched")


class FlakyEtcd:
    """The keys the watch reads and follows: reads that fail while ``away``, and a watch stream that breaks then."""

    def __init__(self) -> None:
        self.alive = {"n-a", "n-b"}
        self.away = False
        self.revision = 1
        self.sinks: dict[int, Callable[[Any], None]] = {}
        self._ids = itertools.count(1)

    def _check(self) -> None:
        if self.away:
            raise EtcdError("get", "10.0.0.1:2379", "UNAVAILABLE", "etcdserver: no leader")

    def read_prefix(self, prefix: str) -> tuple[list[tuple[str, bytes, int]], int]:
        self._check()
        assert prefix == KEYS.membership_alive_prefix
        return [(prefix + n, n.encode(), 1) for n in sorted(self.alive)], self.revision

    def keys_under(self, prefix: str, *, revision: int | None = None) -> list[str]:
        self._check()
        return []

    def get_prefix(self, prefix: str, revision: int | None = None) -> list[tuple[str, bytes, int]]:
        self._check()
        return []

    def watch_prefixes(self, prefixes: list[str], start: int, sink: Callable[[Any], None]) -> list[int]:
        self._check()
        ids = []
        for prefix in prefixes:
            if prefix == KEYS.membership_alive_prefix:
                ids.append(next(self._ids))
                self.sinks[ids[-1]] = sink
        return ids

    def watch_failure(self, item: BaseException) -> Exception:
        assert isinstance(item, Exception)
        return item

    def cancel_watches(self, ids: list[int]) -> None:
        for watch_id in ids:
            self.sinks.pop(watch_id, None)

    def set_alive(self, *nodes: str) -> None:
        self.revision += 1
        prefix = KEYS.membership_alive_prefix
        events = [WatchEvent(prefix + n, b"", self.revision, True) for n in sorted(self.alive - set(nodes))]
        events += [WatchEvent(prefix + n, n.encode(), self.revision, False) for n in sorted(set(nodes) - self.alive)]
        self.alive = set(nodes)
        for sink in list(self.sinks.values()):
            sink(events)

    def outage(self, *, alive_after: set[str]) -> None:
        """etcd away for a while (the watch stream breaks: the watch reads again, and fails), then back with
        ``alive_after`` the live keys."""
        self.away = True
        for sink in list(self.sinks.values()):
            sink(EtcdError("watch", "10.0.0.1:2379", "UNAVAILABLE", "the stream broke"))
        time.sleep(0.8)  # the watch failed at least once
        self.revision += 1
        self.alive = alive_after
        self.away = False


def _watch(etcd: FlakyEtcd, grace_s: float) -> FailureWatch:
    watch = FailureWatch(etcd, KEYS, "grp", outage_grace_s=grace_s)  # type: ignore[arg-type]
    watch.follow(1, {"n-a", "n-b"})
    return watch


def test_a_lease_gone_just_after_an_outage_and_back_within_the_grace_is_no_failure() -> None:
    etcd = FlakyEtcd()
    watch = _watch(etcd, grace_s=1.5)
    try:
        time.sleep(0.2)
        etcd.outage(alive_after={"n-a"})  # n-b's lease lapsed as quorum came back
        time.sleep(0.8)  # the watch has read again meanwhile (it retries 0.5 s after an error)
        assert watch.reason() is None
        etcd.set_alive("n-a", "n-b")  # its daemon granted a new lease and put the key back
        time.sleep(1.5)
        assert watch.reason() is None
    finally:
        watch.close()


def test_a_lease_still_gone_after_the_grace_is_a_failure() -> None:
    etcd = FlakyEtcd()
    watch = _watch(etcd, grace_s=1.0)
    try:
        time.sleep(0.2)
        etcd.outage(alive_after={"n-a"})
        begun = time.monotonic()
        wait_until(watch.reason, 5, "the verdict", poll_s=0.02)
        assert watch.reason() == "node liveness lease gone: n-b"
        assert time.monotonic() - begun >= 0.5  # not at the first read after the outage
    finally:
        watch.close()


def test_without_an_outage_a_lost_lease_is_a_failure_at_once() -> None:
    etcd = FlakyEtcd()
    watch = _watch(etcd, grace_s=30.0)
    try:
        time.sleep(0.2)
        etcd.set_alive("n-a")
        wait_until(watch.reason, 2, "the verdict", poll_s=0.02)
        assert watch.reason() == "node liveness lease gone: n-b"
    finally:
        watch.close()


def test_an_event_older_than_the_last_read_is_not_applied() -> None:
    # A cancelled watch may still deliver what it had in flight after the watch read everything again: what was read
    # holds those changes already, and applying an old deletion would fail the step for a node that came back.
    etcd = FlakyEtcd()
    etcd.revision = 5  # the watch reads at revision 5
    watch = _watch(etcd, grace_s=0.0)
    try:
        wait_until(lambda: etcd.sinks, 2, "the watches", poll_s=0.02)
        sink = next(iter(etcd.sinks.values()))
        sink([WatchEvent(KEYS.membership_alive_prefix + "n-b", b"", 3, True)])  # older than the read
        time.sleep(0.3)
        assert watch.reason() is None
        sink([WatchEvent(KEYS.membership_alive_prefix + "n-b", b"", 6, True)])  # newer: believed
        wait_until(watch.reason, 2, "the verdict", poll_s=0.02)
        assert watch.reason() == "node liveness lease gone: n-b"
    finally:
        watch.close()
