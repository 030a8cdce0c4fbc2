"""Committed checkpoints on disk, in the layout of DESIGN.md §3.

::

    <checkpoint-dir>/<run-id>/step-000000001200/          committed: accelerate save_state files + elasticd.json
    <checkpoint-dir>/<run-id>/step-000000001300.partial/  being written; never loaded, removed on the next start

A checkpoint is written into ``step-N.partial/``; the commit writes the manifest ``elasticd.json`` last (sizes and
sha256 of every file, fsynced), renames the directory (atomic on one filesystem) and fsyncs the parent. A directory
without ``.partial`` therefore always holds a complete save, whatever moment a crash hit.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MANIFEST = "elasticd.json"
MANIFEST_VERSION = 1
_COMMITTED = re.compile(r"^step-(\d{12})$")
_PARTIAL = re.compile(r"^step-(\d{12})\.partial$")


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
        digest = hashlib.sha256()
        with path.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                digest.update(chunk)
        files[str(path.relative_to(directory))] = {"size": path.stat().st_size, "sha256": digest.hexdigest()}
    return {"version": MANIFEST_VERSION, "wall_time": time.time(), **meta, "files": files}


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
