"""elasticd/rundir.py: the checkpoint directory probe and how a failed write's OS error is named."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from elasticd import rundir
from elasticd.errors import EXIT_USAGE, CheckpointDirError


def test_probe_of_a_writable_directory_passes_and_leaves_nothing(tmp_path: Path) -> None:
    assert rundir.probe(tmp_path) is None
    assert list(tmp_path.iterdir()) == []


def test_probe_of_a_missing_directory_returns_the_os_error(tmp_path: Path) -> None:
    failure = rundir.probe(tmp_path / "missing")
    assert isinstance(failure, FileNotFoundError) and failure.errno == errno.ENOENT


def test_prepare_creates_the_run_directory(tmp_path: Path) -> None:
    rundir.prepare(tmp_path / "ck" / "run")
    assert (tmp_path / "ck" / "run").is_dir()


def test_prepare_under_a_file_is_a_one_line_usage_error_naming_the_directory_and_errno(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("")
    with pytest.raises(CheckpointDirError) as caught:
        rundir.prepare(tmp_path / "afile" / "run")
    message = str(caught.value)
    assert caught.value.exit_code == EXIT_USAGE
    assert "\n" not in message and str(tmp_path / "afile" / "run") in message and "ENOTDIR" in message


def test_os_error_of_finds_an_os_error_among_the_causes(tmp_path: Path) -> None:
    cause = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "f"))
    try:
        try:
            raise cause
        except OSError as exc:
            raise RuntimeError("unexpected pos 576 vs 534") from exc
    except RuntimeError as wrapped:
        found = rundir.os_error_of(wrapped, tmp_path)
    assert found is cause
    assert rundir.describe(cause) == {"errno": "ENOSPC", "path": str(tmp_path / "f"), "os_error": cause.strerror}


def test_os_error_of_probes_when_the_exception_hides_it(tmp_path: Path) -> None:
    # torch reports a full disk as a RuntimeError without errno; on a writable directory the probe finds nothing
    # (a full or read-only disk, where the probe does fail, is tests/integration/test_storage_faults.py's)
    assert rundir.os_error_of(RuntimeError("unexpected pos 576 vs 534"), tmp_path / "gone" / "step.partial") is None
    assert list(tmp_path.iterdir()) == []  # the probe went to the nearest existing directory and cleaned up
