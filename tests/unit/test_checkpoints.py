"""The checkpoint layout: partial dirs are never taken as committed, commits are atomic, old ones pruned; a committed
checkpoint that no longer matches its manifest is reported and skipped in favour of the one before."""

from __future__ import annotations

from pathlib import Path

import pytest

from elasticd.worker.checkpoints import MANIFEST, Checkpoint, CheckpointStore, build_manifest, manifest_files


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


def _latest(store: CheckpointStore) -> Checkpoint:
    latest = store.latest()
    assert latest is not None, "no committed checkpoint"
    return latest


def test_partial_is_never_latest_and_is_removed_on_start(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, "run")
    save(store, 10)
    (store.begin(20) / "model.bin").write_bytes(b"half")  # a crash before the commit
    assert _latest(store).step == 10
    assert store.remove_partials() == [store.partial_path(20)]
    assert not store.partial_path(20).exists()


def test_directory_without_manifest_is_not_committed(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, "run")
    save(store, 10)
    save(store, 20)
    (_latest(store).path / MANIFEST).unlink()
    assert _latest(store).step == 10


def test_keeps_only_the_newest_k(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, "run", keep=2)
    for step in (10, 20, 30, 40):
        save(store, step)
    assert [c.step for c in store.committed()] == [30, 40]


def two_checkpoints(tmp_path: Path) -> tuple[CheckpointStore, list[tuple[Checkpoint, str]]]:
    """A store with steps 10 and 20 committed, and the list ``on_bad`` reports into."""
    store = CheckpointStore(tmp_path, "run")
    save(store, 10, b"weights-10")
    save(store, 20, b"weights-20")
    return store, []


def newest(store: CheckpointStore) -> Checkpoint:
    latest = store.latest()
    assert latest is not None
    return latest


def test_verify_accepts_an_intact_checkpoint_and_files_the_manifest_does_not_list(tmp_path: Path) -> None:
    store, _ = two_checkpoints(tmp_path)
    (newest(store).path / "notes.txt").write_text("extra files are allowed")
    assert store.verify(newest(store)) is None


def test_verify_reports_a_truncated_file(tmp_path: Path) -> None:
    store, _ = two_checkpoints(tmp_path)
    model = newest(store).path / "model.bin"
    model.write_bytes(model.read_bytes()[:4])
    assert store.verify(newest(store)) == "size mismatch: model.bin has 4 bytes, manifest says 10"


def test_verify_reports_a_flipped_byte_of_the_same_size(tmp_path: Path) -> None:
    store, _ = two_checkpoints(tmp_path)
    model = newest(store).path / "model.bin"
    data = bytearray(model.read_bytes())
    data[3] ^= 0x01
    model.write_bytes(bytes(data))
    assert store.verify(newest(store)) == "sha256 mismatch: model.bin"


def test_verify_reports_a_missing_file(tmp_path: Path) -> None:
    store, _ = two_checkpoints(tmp_path)
    (newest(store).path / "model.bin").unlink()
    assert store.verify(newest(store)) == "missing file: model.bin"


@pytest.mark.parametrize(
    ("manifest", "expected"),
    [
        ("{not json", "unreadable manifest: JSONDecodeError"),
        ('{"step": 20}', "unreadable manifest: KeyError"),
        ('{"files": {"model.bin": {"size": 10}}}', "unreadable manifest: KeyError"),
        ('{"files": {"model.bin": {"size": "ten", "sha256": "x"}}}', "unreadable manifest: ValueError"),
        ("[1, 2]", "unreadable manifest: TypeError"),
        ('{"files": {"../outside.bin": {"size": 1, "sha256": "x"}}}', "manifest names a file outside the checkpoint"),
    ],
)
def test_verify_reports_a_bad_manifest(tmp_path: Path, manifest: str, expected: str) -> None:
    store, _ = two_checkpoints(tmp_path)
    (newest(store).path / MANIFEST).write_text(manifest)
    reason = store.verify(newest(store))
    assert reason is not None and reason.startswith(expected)


def test_latest_loadable_falls_back_to_the_previous_and_reports_why(tmp_path: Path) -> None:
    store, bad = two_checkpoints(tmp_path)
    (newest(store).path / "model.bin").write_bytes(b"weights-2X")  # same size, other content
    loadable = store.latest_loadable(lambda cp, reason: bad.append((cp, reason)))
    assert loadable is not None and loadable.step == 10
    assert [(cp.step, reason) for cp, reason in bad] == [(20, "sha256 mismatch: model.bin")]


def test_latest_loadable_reports_each_bad_one_and_is_none_when_none_verifies(tmp_path: Path) -> None:
    store, bad = two_checkpoints(tmp_path)
    for cp in store.committed():
        (cp.path / MANIFEST).write_text("")
    assert store.latest_loadable(lambda cp, reason: bad.append((cp, reason))) is None
    assert [cp.step for cp, _ in bad] == [20, 10]
    assert all(reason.startswith("unreadable manifest") for _, reason in bad)


def test_latest_loadable_never_takes_a_partial_even_a_complete_looking_one(tmp_path: Path) -> None:
    store, bad = two_checkpoints(tmp_path)
    partial = store.begin(30)
    (partial / "model.bin").write_bytes(b"weights-30")
    (partial / MANIFEST).write_text((newest(store).path / MANIFEST).read_text())  # a crash just before the rename
    loadable = store.latest_loadable(lambda cp, reason: bad.append((cp, reason)))
    assert loadable is not None and loadable.step == 20 and bad == []


def test_manifest_files_reads_back_what_build_manifest_wrote(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.bin").write_bytes(b"abc")
    files = manifest_files(build_manifest(tmp_path, {"step": 1}))
    assert files == {"sub/a.bin": (3, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad")}
