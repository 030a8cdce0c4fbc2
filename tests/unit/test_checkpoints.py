"""The checkpoint layout: partial dirs are never taken as committed, commits are atomic, old ones pruned."""

from __future__ import annotations

from pathlib import Path

from elasticd.worker.checkpoints import MANIFEST, CheckpointStore


def save(store: CheckpointStore, step: int, payload: bytes = b"weights") -> None:
    (store.begin(step) / "model.bin").write_bytes(payload)
    store.commit(step, {"world_size": 2})


def test_commit_renames_and_writes_a_manifest_with_sizes_and_hashes(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, "run")
    save(store, 20)
    latest = store.latest()
    assert latest is not None and latest.step == 20 and latest.path.name == "step-000000000020"
    manifest = latest.manifest()
    assert manifest["step"] == 20 and manifest["world_size"] == 2
    assert manifest["files"]["model.bin"]["size"] == len(b"weights")
    assert len(manifest["files"]["model.bin"]["sha256"]) == 64
    assert not store.partial_path(20).exists()


def test_partial_is_never_latest_and_is_removed_on_start(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, "run")
    save(store, 10)
    (store.begin(20) / "model.bin").write_bytes(b"half")  # a crash before the commit
    assert store.latest().step == 10  # type: ignore[union-attr]
    assert store.remove_partials() == [store.partial_path(20)]
    assert not store.partial_path(20).exists()


def test_directory_without_manifest_is_not_committed(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, "run")
    save(store, 10)
    save(store, 20)
    (store.latest().path / MANIFEST).unlink()  # type: ignore[union-attr]
    assert store.latest().step == 10  # type: ignore[union-attr]


def test_keeps_only_the_newest_k(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, "run", keep=2)
    for step in (10, 20, 30, 40):
        save(store, step)
    assert [c.step for c in store.committed()] == [30, 40]
