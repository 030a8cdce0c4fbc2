"""Rank 0's commits while etcd cannot take them (elasticd/worker/commit_queue.py): held, then landed in step order."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from elasticd.lineage import CheckpointRecord
from elasticd.worker.checkpoints import CheckpointStore, CommitDeferredError
from elasticd.worker.commit_queue import DEFERRED, SUPERSEDED, CommitQueue, Sealed


class Etcd:
    """A fence whose etcd is away until ``back`` is set; it records what it took, in order."""

    def __init__(self) -> None:
        self.back = threading.Event()
        self.taken: list[int] = []

    def __call__(self, record: CheckpointRecord) -> bool:
        if not self.back.is_set():
            raise CommitDeferredError("etcd put at e1:2379 failed: UNAVAILABLE: no leader")
        self.taken.append(record.step)
        return True


def sealed(store: CheckpointStore, step: int) -> Sealed:
    (store.begin(step) / "model.bin").write_bytes(b"w%d" % step)
    return Sealed(store, store.seal(step, {}), 0.0, 0.01)


def test_commits_etcd_cannot_take_wait_and_land_oldest_first_the_oldest_given_up_past_the_limit(
    tmp_path: Path,
) -> None:
    store, etcd = CheckpointStore(tmp_path, "q", keep=10, token="1.abc"), Etcd()
    events: list[tuple[str, dict[str, Any]]] = []
    queue = CommitQueue(etcd, lambda name, **fields: events.append((name, fields)), limit=3)
    for step in (10, 20, 30, 40):
        assert queue.commit(sealed(store, step)) is None  # held: etcd is away
    assert [f["step"] for n, f in events if n == DEFERRED] == [10, 20, 30, 40]
    (dropped,) = [f for n, f in events if n == "checkpoint_abandoned"]
    assert dropped["step"] == 10 and dropped["reason"] == SUPERSEDED
    assert not (store.dir / Path(dropped["path"]).name).exists()
    assert queue.pending == [20, 30, 40]

    etcd.back.set()
    assert queue.wait(10)
    assert etcd.taken == [20, 30, 40]  # in step order
    assert [c.step for c in store.committed()] == [20, 30, 40]
    assert queue.commit(sealed(store, 50)) is True  # nothing waits: committed at once
    assert etcd.taken[-1] == 50


def test_a_commit_etcd_answers_is_decided_at_once_and_a_refusal_removes_its_directory(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, "q", token="1.abc")
    events: list[str] = []
    queue = CommitQueue(lambda record: record.step != 20, lambda name, **fields: events.append(name))
    assert queue.commit(sealed(store, 10)) is True
    assert queue.commit(sealed(store, 20)) is False
    assert not store.partial_path(20).exists()
    assert events == ["checkpoint_committed", "checkpoint_fenced"]
