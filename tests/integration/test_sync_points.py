"""The worker library's sync points over a real gloo group of two processes (``scripts/sync_ranks.py``).

A request one rank sees (the daemon's SIGUSR2, a joiner's bid) reaches every rank at the same step. With long steps
(``BLOCKING_STEP_S`` or more, one step per sync point) a sync point waits for its own tiny all-reduce and acts at
once; with short ones it acts on the previous sync point's, which has long finished, a sync interval later.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from elasticd.worker.coordination import BLOCKING_STEP_S, TARGET_SYNC_S
from tests.helpers import free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

SCRIPT = Path(__file__).parent / "scripts" / "sync_ranks.py"
REQUEST_AT = 20  # the script's


def _run(step_time_s: float) -> list[dict[str, Any]]:
    port = free_port()
    ranks = [
        subprocess.Popen(
            [sys.executable, str(SCRIPT), str(port), str(rank), str(step_time_s)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    results = []
    for rank in ranks:
        out, err = rank.communicate(timeout=90)
        assert rank.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def test_with_long_steps_a_request_is_honoured_at_the_step_it_was_made_on_every_rank() -> None:
    results = _run(2 * BLOCKING_STEP_S)
    assert [r["requested"] for r in results] == [[REQUEST_AT], [REQUEST_AT]], results
    assert {r["interval"] for r in results} == {1}


def test_with_short_steps_a_request_is_honoured_one_sync_interval_later_on_every_rank() -> None:
    step_time_s = TARGET_SYNC_S / 5  # five steps per sync point
    results = _run(step_time_s)
    steps = [r["requested"] for r in results]
    assert steps[0] == steps[1] and len(steps[0]) == 1, results
    assert REQUEST_AT < steps[0][0] <= REQUEST_AT + 2 * 5, results  # the next sync point's values, acted on after
