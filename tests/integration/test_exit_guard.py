"""A worker that gave up on a collective in place ends cleanly, though the collective is still pending in gloo.

Real processes and a real gloo group (``scripts/given_up_at_exit.py``): the given-up collective fails while rank 0
tears its interpreter down, which aborts the process unless the exit guard skips the teardown
(``elasticd/worker/hot/exit_guard.py``; seen at the end of in-place runs as "terminate called after throwing an
instance of 'gloo::IoException'").
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

SCRIPT = Path(__file__).parent / "scripts" / "given_up_at_exit.py"
# What the script writes to --write's file without flushing it (scripts/given_up_at_exit.py's WRITTEN).
WRITTEN = "written by the script, never flushed\n"


def _run(*flags: str) -> tuple[int, str]:
    """Rank 0's exit status and output (rank 1 runs beside it)."""
    port = str(free_port())
    peer = subprocess.Popen(
        [sys.executable, str(SCRIPT), port, "1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        done = subprocess.run(
            [sys.executable, str(SCRIPT), port, "0", *flags], capture_output=True, text=True, timeout=60
        )
    finally:
        try:
            peer.wait(timeout=30)
        except subprocess.TimeoutExpired:
            peer.kill()
            peer.wait()
    return done.returncode, done.stdout + done.stderr


def test_without_the_guard_the_teardown_aborts_the_process() -> None:
    # the fault itself, so that the test below means something: if torch stops aborting here, this says so
    code, out = _run("--no-guard")
    assert "pending given-up collectives: 1" in out, out
    assert code == -signal.SIGABRT, out
    assert "gloo::IoException" in out, out


def test_the_guard_ends_the_process_with_status_0_after_the_other_exit_handlers() -> None:
    code, out = _run()
    assert code == 0, out
    assert "teardown_skipped_at_exit" in out, out
    assert "another exit handler ran" in out, out
    assert "terminate called" not in out, out


def test_an_exception_that_escapes_the_script_still_ends_it_with_status_1() -> None:
    code, out = _run("--raise")
    assert code == 1, out
    assert "the script failed after run.close()" in out, out  # the traceback, printed as Python does
    assert "another exit handler ran" in out, out
    assert "terminate called" not in out, out


@pytest.mark.parametrize("how", ["sys.exit", "raise"])
def test_the_guard_keeps_the_status_a_system_exit_gave_and_flushes_a_file_the_script_never_flushed(
    tmp_path: Path, how: str
) -> None:
    written = tmp_path / "unflushed.txt"
    code, out = _run("--exit", f"{how}:3", "--write", str(written))
    assert code == 3, out
    assert written.read_text() == WRITTEN, out
    assert "teardown_skipped_at_exit" in out and "another exit handler ran" in out, out
    assert "terminate called" not in out, out


def test_a_fallback_exit_runs_the_exit_handlers_flushes_files_and_exits_with_its_own_code(tmp_path: Path) -> None:
    written = tmp_path / "unflushed.txt"
    code, out = _run("--fallback", "5", "--write", str(written))
    assert code == 5, out
    assert written.read_text() == WRITTEN, out
    assert "another exit handler ran" in out, out
    assert "terminate called" not in out, out
