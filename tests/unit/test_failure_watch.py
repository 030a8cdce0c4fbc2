"""The failure watch's verdict on a lease seen gone right after etcd was away (worker/hot/watch.py).

etcd's outage is played by a client whose reads fail, then answer: the fault under test is what the watch does with
the answers that follow an outage (real ones, etcd members cut off: tests/integration/test_etcd_cluster.py).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from elasticd.etcd.client import EtcdError
from elasticd.keys import RunKeys
from elasticd.worker.hot.watch import FailureWatch
from tests.integration.cluster import wait_until

KEYS = RunKeys("watched")


class FlakyEtcd:
    """The keys the watch reads, and reads that fail while ``away``."""

    def __init__(self) -> None:
        self.alive = {"n-a", "n-b"}
        self.away = False
        self.changed = threading.Event()

    def _check(self) -> None:
        if self.away:
            raise EtcdError("get", "10.0.0.1:2379", "UNAVAILABLE", "etcdserver: no leader")

    def revision(self) -> int:
        self._check()
        return 1

    def get(self, key: str) -> Any:
        self._check()
        return None

    def get_prefix(self, prefix: str) -> list[tuple[str, bytes, int]]:
        self._check()
        if prefix == KEYS.membership_alive_prefix:
            return [(prefix + n, n.encode(), 1) for n in sorted(self.alive)]
        return []

    def wait_for_change(self, key: str, start_revision: int, timeout_s: float, prefix: bool = False) -> bool:
        self._check()
        changed = self.changed.wait(timeout_s)
        self.changed.clear()
        return changed

    def set_alive(self, *nodes: str) -> None:
        self.alive = set(nodes)
        self.changed.set()

    def outage(self, *, alive_after: set[str]) -> None:
        """etcd away for a while (the watch stream breaks: the watch reads again, and fails), then back with
        ``alive_after`` the live keys."""
        self.away = True
        self.changed.set()
        time.sleep(0.8)  # the watch failed at least once
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
