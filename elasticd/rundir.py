"""The run's checkpoint directory ``<checkpoint-dir>/<run-id>/``: can it be written, and if not, which OS error says
why (DESIGN.md §3, checkpoint layout).

Both sides use it. The daemon checks the directory once at start (:func:`prepare`): a directory that cannot be
written is the user's mistake, one line and exit 2, instead of workers that fail every save. A worker whose save
failed names the cause with :func:`os_error_of`: torch reports a full disk as ``RuntimeError: unexpected pos ...``
with no errno at all, so when the exception carries no ``OSError`` a probe of the directory asks the OS directly.
"""

from __future__ import annotations

import errno
import os
import uuid
from pathlib import Path

from elasticd.errors import CheckpointDirError
from elasticd.layout import PROBE_PREFIX

# One filesystem block: a write of this size needs a free block, as a checkpoint file does (a 1-byte file can fit in
# an inode on some filesystems and pass on a full disk).
_PROBE_BYTES = 4096
# A directory that vanishes under the probe is probed again one level up, at most this many times.
_PROBE_TRIES = 4


def probe(directory: Path) -> OSError | None:
    """Create, write, fsync and remove a small file in ``directory``; None when all of it worked, else the OSError
    (with ``filename`` set to the path that failed). The file is removed on every path out."""
    path = directory / f"{PROBE_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, b"\0" * _PROBE_BYTES)
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        if exc.filename is None:
            exc.filename = str(path)
        return exc
    finally:
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        except OSError:
            pass  # on a read-only filesystem the file could not have been created either
    return None


def prepare(directory: Path) -> None:
    """Create ``directory`` (and its parents) and :func:`probe` it; :class:`CheckpointDirError` names the directory
    and the OS error when either fails."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CheckpointDirError(directory, exc) from None
    failure = probe(directory)
    if failure is not None:
        raise CheckpointDirError(directory, failure)


def os_error_of(exc: BaseException, directory: Path) -> OSError | None:
    """The OS error behind a failed write: ``exc`` itself or one in its chain of causes, else the error a probe of
    ``directory`` (the nearest existing one above it) gets now, else None (the write failed for another reason)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, OSError) and current.errno is not None:
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    found: OSError | None = None
    for _ in range(_PROBE_TRIES):
        while not directory.is_dir() and directory != directory.parent:
            directory = directory.parent
        found = probe(directory)
        # ENOENT: the directory went away meanwhile (another rank gave up the same save); ask the one above it
        if not isinstance(found, FileNotFoundError):
            break
    if found is not None:
        found.filename = str(directory)  # the directory the save wrote into, not the probe's own file
    return found


def describe(exc: OSError) -> dict[str, str | None]:
    """Event fields for an OS error: ``errno`` as its symbolic name (ENOSPC), ``path``, and ``os_error``, the text."""
    name = errno.errorcode.get(exc.errno, str(exc.errno)) if exc.errno is not None else None
    return {"errno": name, "path": None if exc.filename is None else str(exc.filename), "os_error": exc.strerror}
