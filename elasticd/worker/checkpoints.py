"""Committed checkpoints on disk, in the layout of DESIGN.md §3 (the names: :mod:`elasticd.layout`).

::

    <checkpoint-dir>/<run-id>/step-000000001200/                   committed: save_state files + elasticd.json
    <checkpoint-dir>/<run-id>/step-000000001300.<writer>.partial/  being written by one writer; never loaded

Each writer (a group of workers holding one fencing token, elasticd/lineage.py) saves into a directory of its own,
so a stale writer can never touch what the current one writes. The commit (:meth:`CheckpointStore.commit`) makes
the files durable, writes the manifest ``elasticd.json`` last (sizes and sha256 of every file, fsynced), asks the
fence (under a daemon: one etcd transaction that records the checkpoint if the writer's token is still current:
the commit point), and only then renames the directory to ``step-N`` (atomic on one filesystem) and fsyncs the
parent. A refused writer removes its own directory. A crash between the record and the rename is rolled forward
by the next loader, which finds the recorded writer's directory with the recorded manifest.

A committed directory can still rot afterwards (a disk error, a half-copied restore, someone editing a file):
:meth:`CheckpointStore.verify` checks it against its manifest. :meth:`CheckpointStore.resolve` picks the newest
recorded checkpoint that verifies; :meth:`CheckpointStore.latest_loadable` does the same from the disk alone, for
a run without a daemon. Both report each checkpoint they skip.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elasticd.layout import MANIFEST, RunLayout, committed_step, done_marker, is_partial
from elasticd.lineage import LOCAL_WRITER, CheckpointRecord, writer_id

MANIFEST_VERSION = 1

Parts = dict[str, dict[str, Any]]  # relative path -> {"size", "sha256"}: what the ranks reported (write_part)
# A fence: True when the checkpoint of this record may be committed (it is then recorded); it raises
# CommitDeferredError when it cannot tell now (etcd away).
Fence = Callable[[CheckpointRecord], bool]
# Hashing reads files in chunks of this many bytes: large enough for throughput, small enough to bound memory.
_HASH_CHUNK_BYTES = 1 << 20


class CommitDeferredError(Exception):
    """The fence could not be asked now (etcd away, no quorum): the record may or may not be written; the sealed
    directory is kept, and publishing the same record again later is safe (the lineage takes a record once)."""


@dataclass(frozen=True, slots=True)
class Checkpoint:
    step: int
    path: Path

    def manifest(self) -> dict[str, Any]:
        return json.loads((self.path / MANIFEST).read_text())


def build_manifest(directory: Path, meta: dict[str, Any], parts: Parts | None = None) -> dict[str, Any]:
    """The manifest of ``directory``: ``meta`` plus each file's size and sha256 (the one schema, in one place).

    ``parts``: entries the ranks that wrote those files reported (:func:`write_part`); only the other files are
    hashed here."""
    parts = parts or {}
    files = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST):
        name = str(path.relative_to(directory))
        files[name] = parts.get(name) or {"size": path.stat().st_size, "sha256": _sha256(path)}
    return {"version": MANIFEST_VERSION, "wall_time": time.time(), **meta, "files": files}


def own_files(directory: Path, rank: int) -> list[Path]:
    """The files of ``directory`` that ``rank`` wrote, by the names accelerate and DCP give them: DCP's
    ``__{rank}_{n}.distcp`` (``FileSystemWriter``'s per-rank prefix), accelerate's ``random_states_{rank}.pkl``
    (its ``RNG_STATE_NAME``) and per-rank ``*_rank{rank}.bin``. Whatever no rank claims (DCP's ``.metadata``, the
    scheduler, the sampler, rank 0's ``custom_checkpoint_{i}.pkl``, whose index is not a rank) rank 0's seal hashes
    itself."""
    names = re.compile(rf"(__{rank}_\d+\.distcp|random_states_{rank}\.pkl|.*_rank{rank}\.bin)")
    return sorted(p for p in directory.rglob("*") if p.is_file() and names.fullmatch(p.name))


def write_part(directory: Path, rank: int) -> None:
    """``rank``'s part of a save into ``directory``: its own files fsynced, then their sizes and sha256 in its
    marker (``done_marker``), written whole (a temporary name, fsynced, renamed): rank 0 seals once every rank's is
    there. The ranks hash their shards in parallel, on their own hosts."""
    entries = {}
    for path in own_files(directory, rank):
        _fsync_file(path)
        entries[str(path.relative_to(directory))] = {"size": path.stat().st_size, "sha256": _sha256(path)}
    marker = directory / done_marker(rank)
    temporary = marker.with_name(marker.name + ".tmp")
    with temporary.open("w") as fh:
        json.dump(entries, fh)
        fh.flush()
        os.fsync(fh.fileno())
    temporary.rename(marker)


def per_rank_world(directory: Path) -> int | None:
    """The world size a checkpoint of per-rank model files (accelerate's ``*_rank{r}.bin``, FSDP's sharded state
    dict saved without DCP) was written at, or None when it has none: such files load only at that world size,
    unlike DCP's, which reshard at any."""
    ranks = {int(m.group(1)) for p in directory.rglob("*_rank*.bin") if (m := _RANK_FILE.fullmatch(p.name))}
    return max(ranks) + 1 if ranks else None


def cannot_reshard(directory: Path, world_size: int) -> str | None:
    """Why the checkpoint in ``directory`` cannot load at ``world_size``, or None when it can."""
    saved = per_rank_world(directory)
    if saved in (None, world_size):
        return None
    return (
        f"checkpoint {directory} holds one model file per rank for {saved} ranks (saved without DCP): it loads at"
        f" {saved} processes only, this run has {world_size}; save with accelerator.save_state (DCP, resharded on"
        " load) or start a new --run-id"
    )


_RANK_FILE = re.compile(r".*_rank(\d+)\.bin")


def read_parts(directory: Path, world_size: int) -> Parts:
    """Every rank's reported entries (:func:`write_part`), its markers removed; FileNotFoundError for a missing
    one."""
    parts: Parts = {}
    markers = [directory / done_marker(rank) for rank in range(world_size)]
    for marker in markers:
        parts.update(json.loads(marker.read_text()))
    for marker in markers:
        marker.unlink()
    return parts


def manifest_files(manifest: dict[str, Any]) -> dict[str, tuple[int, str]]:
    """``{relative path: (size in bytes, sha256 hex)}`` as ``build_manifest`` recorded them; ValueError, KeyError or
    TypeError when the manifest does not have that shape."""
    return {str(name): (int(entry["size"]), str(entry["sha256"])) for name, entry in dict(manifest["files"]).items()}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(_HASH_CHUNK_BYTES), b""):
            digest.update(chunk)
    return digest.hexdigest()


class CheckpointStore:
    """The checkpoints of one run under ``root / run_id``."""

    def __init__(self, root: Path | str, run_id: str = "default", keep: int = 3, token: str | None = None) -> None:
        self.layout = RunLayout(Path(root), run_id)
        self.dir = self.layout.dir
        self.keep = keep
        self.token = token or LOCAL_WRITER  # the writer's fencing token (elasticd/lineage.py); "local" without one
        self.writer = writer_id(token)

    def adopt_token(self, token: str) -> None:
        """Write as the group that holds ``token`` from now on (a membership epoch moved the fence in place)."""
        self.token = token
        self.writer = writer_id(token)

    def pinned(self) -> CheckpointStore:
        """This store as its writer is now: a later :meth:`adopt_token` does not change the copy (a background write
        keeps the token and directory it started with)."""
        return copy.copy(self)

    def committed(self) -> list[Checkpoint]:
        """Committed checkpoints (a manifest present), oldest first."""
        if not self.dir.is_dir():
            return []
        found = []
        for entry in self.dir.iterdir():
            step = committed_step(entry.name)
            if step is not None and (entry / MANIFEST).is_file():
                found.append(Checkpoint(step, entry))
        return sorted(found, key=lambda c: c.step)

    def latest(self) -> Checkpoint | None:
        committed = self.committed()
        return committed[-1] if committed else None

    def verify(self, cp: Checkpoint) -> str | None:
        """None when every file the manifest lists exists with its recorded size and sha256 (files it does not list
        are allowed); else a short reason naming the first problem found."""
        try:
            entries = manifest_files(cp.manifest())
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return f"unreadable manifest: {type(exc).__name__}: {exc}"
        paths = []
        for name, (size, sha256) in entries.items():
            if Path(name).is_absolute() or ".." in Path(name).parts:
                return f"manifest names a file outside the checkpoint: {name}"
            path = cp.path / name
            if not path.is_file():
                return f"missing file: {name}"
            if path.stat().st_size != size:  # cheap, so every size is checked before any file is hashed
                return f"size mismatch: {name} has {path.stat().st_size} bytes, manifest says {size}"
            paths.append((name, path, sha256))
        for name, path, sha256 in paths:
            if _sha256(path) != sha256:
                return f"sha256 mismatch: {name}"
        return None

    def latest_loadable(self, on_bad: Callable[[Checkpoint, str], None]) -> Checkpoint | None:
        """The newest committed checkpoint on disk that verifies, or None (a run without a daemon: no lineage).
        Each newer one that does not is passed to ``on_bad`` with the reason and skipped."""
        for cp in reversed(self.committed()):
            reason = self.verify(cp)
            if reason is None:
                return cp
            on_bad(cp, reason)
        return None

    def resolve(self, records: list[CheckpointRecord], on_bad: Callable[[Checkpoint, str], None]) -> Checkpoint | None:
        """The newest of the lineage's ``records`` whose directory holds the recorded manifest and verifies.

        A record whose directory is missing while its writer's directory holds the recorded manifest is a commit
        that crashed between the record and the rename: it is rolled forward (renamed) here. Directories the
        records do not name are never candidates.
        """
        for record in sorted(records, key=lambda r: r.step, reverse=True):
            cp = Checkpoint(record.step, self.dir / record.dir)
            reason = self._roll_forward(record) or self._matches(record, cp) or self.verify(cp)
            if reason is None:
                return cp
            on_bad(cp, reason)
        return None

    def record_for(self, cp: Checkpoint, token: str) -> CheckpointRecord:
        """A lineage record of a committed directory (used to adopt one found on disk into a fresh lineage)."""
        manifest_sha = _sha256(cp.path / MANIFEST)
        return CheckpointRecord(cp.step, cp.path.name, cp.path.name, manifest_sha, token, time.time())

    def partial_path(self, step: int) -> Path:
        """This writer's directory for ``step``."""
        return self.layout.partial(step, self.writer)

    def begin(self, step: int) -> Path:
        """A fresh, empty directory of this writer to save ``step`` into."""
        path = self.partial_path(step)
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        return path

    def commit(self, step: int, meta: dict[str, Any], fence: Fence | None = None) -> Checkpoint | None:
        """Make this writer's files durable, write the manifest last, ask ``fence`` (the commit point) and rename
        the directory to ``step-N``; prune to ``keep``. None when the fence refused: the directory is removed.
        :class:`CommitDeferredError` when the fence could not be asked: the sealed directory stays for a retry."""
        return self.publish(self.seal(step, meta), fence)

    def seal(self, step: int, meta: dict[str, Any], parts: Parts | None = None) -> CheckpointRecord:
        """Make this writer's files of ``step`` durable and write the manifest last: the record to commit.
        ``parts``: the files the ranks made durable and hashed themselves (:func:`read_parts`)."""
        partial = self.partial_path(step)
        parts = parts or {}
        for path in partial.rglob("*"):
            if path.is_file() and str(path.relative_to(partial)) not in parts:
                _fsync_file(path)
        manifest = build_manifest(partial, {"step": step, **meta}, parts)
        manifest_path = partial / MANIFEST
        with manifest_path.open("w") as fh:
            json.dump(manifest, fh, indent=1, sort_keys=True)
            fh.flush()
            os.fsync(fh.fileno())
        _fsync_dir(partial)
        final = self.layout.checkpoint(step)
        # The same step committed before (a save right after resuming there): that one stays, this one goes.
        existing = final / MANIFEST if (final / MANIFEST).is_file() else None
        return CheckpointRecord(
            step, final.name, partial.name, _sha256(existing or manifest_path), self.token, time.time()
        )

    def publish(self, record: CheckpointRecord, fence: Fence | None = None) -> Checkpoint | None:
        """Ask ``fence`` to record the sealed ``record`` (stamped now), then rename its directory to ``step-N`` and
        prune; None when refused (the directory is removed). The fence's :class:`CommitDeferredError` passes
        through with the directory kept: ``record`` may be published again later."""
        record = dataclasses.replace(record, committed_at=time.time())
        partial, final = self.dir / record.partial, self.dir / record.dir
        if fence is not None and not fence(record):
            shutil.rmtree(partial, ignore_errors=True)
            return None
        if (final / MANIFEST).is_file():
            shutil.rmtree(partial, ignore_errors=True)
        else:
            partial.rename(final)
            _fsync_dir(self.dir)
        self.prune()
        return Checkpoint(record.step, final)

    def prune(self) -> None:
        for old in self.committed()[: -self.keep]:
            shutil.rmtree(old.path, ignore_errors=True)

    def remove_partials(self, keep: frozenset[str] = frozenset()) -> list[Path]:
        """Remove every ``.partial`` directory except those named in ``keep`` (the lineage's records: a commit that
        may still be rolled forward). Call it once when a group starts, before it saves, from the group that holds
        the current token: every other writer was fenced off already and can never commit what it left."""
        removed = []
        if self.dir.is_dir():
            for entry in self.dir.iterdir():
                if is_partial(entry.name) and entry.name not in keep:
                    shutil.rmtree(entry, ignore_errors=True)
                    removed.append(entry)
        return removed

    def _roll_forward(self, record: CheckpointRecord) -> str | None:
        final, partial = self.dir / record.dir, self.dir / record.partial
        if final.exists() or record.partial == record.dir or not partial.is_dir():
            return None if final.exists() else "missing directory"
        if not (partial / MANIFEST).is_file() or _sha256(partial / MANIFEST) != record.manifest_sha256:
            return "missing directory (its writer's directory does not hold the recorded manifest)"
        partial.rename(final)
        _fsync_dir(self.dir)
        return None

    @staticmethod
    def _matches(record: CheckpointRecord, cp: Checkpoint) -> str | None:
        try:
            actual = _sha256(cp.path / MANIFEST)
        except OSError as exc:
            return f"unreadable manifest: {exc}"
        return None if actual == record.manifest_sha256 else "manifest differs from the one the lineage recorded"


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
