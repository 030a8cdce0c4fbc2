"""Committed checkpoints on disk, in the layout of DESIGN.md §3.

::

    <checkpoint-dir>/<run-id>/step-000000001200/          committed: accelerate save_state files + elasticd.json
    <checkpoint-dir>/<run-id>/step-000000001300.partial/  being written; never loaded, removed on the next start

A checkpoint is written into ``step-N.partial/``; the commit writes the manifest ``elasticd.json`` last (sizes and
sha256 of every file, fsynced), renames the directory (atomic on one filesystem) and fsyncs the parent. A directory
without ``.partial`` therefore always holds a complete save, whatever moment a crash hit.

A committed directory can still rot afterwards (a disk error, a half-copied restore, someone editing a file):
:meth:`CheckpointStore.verify` checks it against its manifest, and :meth:`CheckpointStore.latest_loadable` picks
the newest one that verifies, reporting each one it skips.
"""

from __future__ import annotations

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

MANIFEST = "elasticd.json"
MANIFEST_VERSION = 1
_COMMITTED = re.compile(r"^step-(\d{12})$")
_PARTIAL = re.compile(r"^step-(\d{12})\.partial$")
# Hashing reads files in chunks of this many bytes: large enough for throughput, small enough to bound memory.
_HASH_CHUNK_BYTES = 1 << 20


def step_dirname(step: int) -> str:
    return f"step-{step:012d}"


@dataclass(frozen=True, slots=True)
class Checkpoint:
    step: int
    path: Path

    def manifest(self) -> dict[str, Any]:
        return json.loads((self.path / MANIFEST).read_text())


def build_manifest(directory: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """The manifest of ``directory``: ``meta`` plus each file's size and sha256 (the one schema, in one place)."""
    files = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST):
        files[str(path.relative_to(directory))] = {"size": path.stat().st_size, "sha256": _sha256(path)}
    return {"version": MANIFEST_VERSION, "wall_time": time.time(), **meta, "files": files}


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

    def __init__(self, root: Path | str, run_id: str = "default", keep: int = 3) -> None:
        self.dir = Path(root) / run_id
        self.keep = keep

    def committed(self) -> list[Checkpoint]:
        """Committed checkpoints (a manifest present), oldest first."""
        if not self.dir.is_dir():
            return []
        found = []
        for entry in self.dir.iterdir():
            match = _COMMITTED.match(entry.name)
            if match and (entry / MANIFEST).is_file():
                found.append(Checkpoint(int(match.group(1)), entry))
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
        """The newest committed checkpoint that verifies, or None. Each newer one that does not is passed to
        ``on_bad`` with the reason (the caller logs a warning) and skipped. ``.partial`` dirs are never candidates."""
        for cp in reversed(self.committed()):
            reason = self.verify(cp)
            if reason is None:
                return cp
            on_bad(cp, reason)
        return None

    def partial_path(self, step: int) -> Path:
        return self.dir / f"{step_dirname(step)}.partial"

    def begin(self, step: int) -> Path:
        """A fresh, empty ``step-N.partial/`` to save into."""
        path = self.partial_path(step)
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        return path

    def commit(self, step: int, meta: dict[str, Any]) -> Checkpoint:
        """Write the manifest last, rename ``.partial`` to its committed name and prune to ``keep``."""
        partial = self.partial_path(step)
        for path in partial.rglob("*"):
            if path.is_file():
                _fsync_file(path)
        manifest = build_manifest(partial, {"step": step, **meta})
        manifest_path = partial / MANIFEST
        with manifest_path.open("w") as fh:
            json.dump(manifest, fh, indent=1, sort_keys=True)
            fh.flush()
            os.fsync(fh.fileno())
        final = self.dir / step_dirname(step)
        if final.exists():  # the same step saved again after a restart: the newer save wins
            shutil.rmtree(final)
        partial.rename(final)
        _fsync_dir(self.dir)
        self.prune()
        return Checkpoint(step, final)

    def prune(self) -> None:
        for old in self.committed()[: -self.keep]:
            shutil.rmtree(old.path, ignore_errors=True)

    def remove_partials(self) -> list[Path]:
        """Remove every ``.partial`` directory (call once at start, before any rank saves)."""
        removed = []
        if self.dir.is_dir():
            for entry in self.dir.iterdir():
                if _PARTIAL.match(entry.name):
                    shutil.rmtree(entry, ignore_errors=True)
                    removed.append(entry)
        return removed


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
