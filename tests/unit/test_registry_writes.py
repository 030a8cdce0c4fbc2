"""The node record's writes leave the threads that update it: the supervisor loop and the beat receiver never wait
on etcd (agent/registry.py). The client is a stand-in whose ``put`` hangs the way a call to an etcd regaining
quorum does, until the test lets it go."""

from __future__ import annotations

import json
import threading
from typing import Any, cast

from elasticd.agent.registry import NodeRegistry
from elasticd.etcd.client import EtcdClient, EtcdError
from elasticd.keys import RunKeys


class HangingEtcd:
    """``put`` waits for :attr:`release` (or raises the next of :attr:`failures`); every write is kept."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.release.set()
        self.failures: list[EtcdError] = []
        self.writes: list[dict[str, Any]] = []
        self.wrote = threading.Condition()

    def grant_lease(self, ttl_s: int) -> int:
        return 7

    def create(self, key: str, value: bytes, lease_id: int) -> bool:
        return True

    def refresh_lease(self, lease: int) -> bool:
        return True

    def put(self, key: str, value: bytes, lease_id: int | None = None) -> None:
        assert self.release.wait(30), "the test never let the write go"
        if self.failures:
            raise self.failures.pop(0)
        with self.wrote:
            self.writes.append(json.loads(value))
            self.wrote.notify_all()

    def revoke_lease(self, lease: int) -> None:
        pass

    def wait_for(self, **fields: Any) -> dict[str, Any]:
        def written() -> bool:
            return any(fields.items() <= w.items() for w in self.writes)

        with self.wrote:
            assert self.wrote.wait_for(written, timeout=30), (fields, self.writes[-1:])
        return next(w for w in self.writes if fields.items() <= w.items())


def claimed(etcd: HangingEtcd) -> NodeRegistry:
    registry = NodeRegistry(cast(EtcdClient, etcd), RunKeys("r"), "n0", ttl_s=3)
    registry.claim()
    registry.start_keepalive()
    return registry


def test_an_update_returns_while_etcd_holds_the_write_and_the_newest_record_lands_after() -> None:
    etcd = HangingEtcd()
    registry = claimed(etcd)
    try:
        etcd.release.clear()  # etcd stops answering

        def updates() -> None:
            registry.update(epoch=1)
            registry.update(epoch=2, world_size=2)

        updater = threading.Thread(target=updates)
        updater.start()
        updater.join(10)
        assert not updater.is_alive(), "update() waited on etcd"
        etcd.release.set()
        assert etcd.wait_for(epoch=2, world_size=2)["node_id"] == "n0"
    finally:
        etcd.release.set()
        registry.release()


def test_a_write_that_fails_is_written_again_with_the_next_refresh() -> None:
    etcd = HangingEtcd()
    registry = claimed(etcd)
    try:
        etcd.failures.append(EtcdError("put", "127.0.0.1:2379", "DEADLINE_EXCEEDED", "Deadline Exceeded"))
        registry.update(state="running")
        assert etcd.wait_for(state="running")["state"] == "running"  # no further update asked for it
    finally:
        registry.release()


def test_before_the_keepalive_runs_an_update_is_written_at_once() -> None:
    etcd = HangingEtcd()
    registry = NodeRegistry(cast(EtcdClient, etcd), RunKeys("r"), "n0", ttl_s=3)
    registry.claim()
    registry.update(state="rendezvous")
    assert etcd.writes[-1]["state"] == "rendezvous"
    registry.release()
