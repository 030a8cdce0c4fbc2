"""Real storage faults for integration tests: a small tmpfs that fills up or turns read-only (needs root).

:func:`tmpfs` mounts a tmpfs of a given size (and inode count) and unmounts it on every path out, lazily when a
process still holds it. :func:`fill` takes every free block, :func:`exhaust_inodes` every free inode (then even
``mkdir`` fails with ENOSPC, as on a full ext4 disk, where a new directory needs a block); :func:`remount` flips it
between read-only and read-write.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

_CMD_TIMEOUT_S = 20
# Bytes per filler write: one page, so the last writes take the last free pages one by one.
_CHUNK = 4096


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=_CMD_TIMEOUT_S)


@contextlib.contextmanager
def tmpfs(path: Path, size_kib: int, *, nr_inodes: int | None = None) -> Iterator[Path]:
    """A tmpfs of ``size_kib`` KiB mounted at ``path`` for the duration; the test is skipped where mounting is not
    allowed (not root, or no mount namespace rights)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    path.mkdir(parents=True, exist_ok=True)
    options = f"size={size_kib}k" + (f",nr_inodes={nr_inodes}" if nr_inodes else "")
    mounted = _run("mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path))
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        unmount(path)


def unmount(path: Path) -> None:
    """Unmount ``path``; lazily (``umount -l``) when something still holds it, so no test leaves a mount behind."""
    if _run("umount", str(path)).returncode != 0:
        _run("umount", "-l", str(path))


def remount(path: Path, mode: str, timeout_s: float = 30) -> None:
    """Remount ``path`` ``ro`` or ``rw``. Going read-only fails with EBUSY while a file is open for writing (a
    checkpoint being written), so it is retried until the writer is done."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = _run("mount", "-o", f"remount,{mode}", str(path))
        if result.returncode == 0:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"remount,{mode} of {path} failed: {result.stderr.strip()}")
        time.sleep(0.05)


def fill(path: Path) -> Path:
    """Write a file into ``path`` until the filesystem has no free block left; the filler's path."""
    filler = path / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        while True:
            try:
                os.write(fd, b"\0" * _CHUNK)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                break
    finally:
        os.close(fd)
    return filler


def exhaust_inodes(path: Path) -> list[Path]:
    """Create empty files in ``path/inodes`` until no inode is left; the files made (remove them to give back)."""
    folder = path / "inodes"
    folder.mkdir(exist_ok=True)
    made: list[Path] = []
    while True:
        name = folder / f"i{len(made)}"
        try:
            name.touch()
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            return made
        made.append(name)


def free(path: Path) -> None:
    """Give back what :func:`fill` and :func:`exhaust_inodes` took."""
    (path / "filler").unlink(missing_ok=True)
    inodes = path / "inodes"
    if inodes.is_dir():
        for item in inodes.iterdir():
            item.unlink()
        inodes.rmdir()
