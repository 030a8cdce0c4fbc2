"""The daemon's die-after-rendezvous fault (``ELASTICD_FAULT_DIE_AFTER_RDZV``) kills its process for real."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from elasticd import envvars

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]


def test_a_fault_that_applies_kills_the_process_with_sigkill_after_saying_so() -> None:
    code = "from elasticd.rendezvous import faults; faults.maybe_die('joined', rank=0, round_=3); print('alive')"
    env = {envvars.FAULT_DIE_AFTER_RDZV: "joined@rank=0"}
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == -signal.SIGKILL
    assert "alive" not in result.stdout
    assert "fault_injected" in result.stdout + result.stderr  # structlog unconfigured here: stdout
