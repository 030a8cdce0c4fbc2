"""The progress board read by the daemon while another process writes it without pause: never a torn slot."""

from __future__ import annotations

from pathlib import Path

import pytest

from elasticd.board import SlotWriter, read_slot
from elasticd.layout import slot_path

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def _write_forever(path: str, seconds: float) -> None:
    import time

    writer = SlotWriter(path)
    writer.resumed(1)
    step, deadline = 1, time.monotonic() + seconds
    while time.monotonic() < deadline:
        step += 1
        writer.enter(step)
        writer.completed(step, step_s=0.01, own_s=0.001)


def test_reads_during_constant_writes_never_see_a_half_written_slot(tmp_path: Path) -> None:
    """A reader racing a writer in another process never sees a valid slot with a zero progress time (which
    struct.pack_into's zero-filling used to show about 3 % of the time)."""
    import multiprocessing
    import time

    path = slot_path(tmp_path, 0)
    SlotWriter(path).close()
    writer = multiprocessing.get_context("fork").Process(target=_write_forever, args=(str(path), 1.5))
    writer.start()
    try:
        time.sleep(0.2)
        torn = reads = 0
        while writer.is_alive() and reads < 20_000:
            slot = read_slot(path)
            reads += 1
            consistent = slot is not None and slot.progress_t > 0 and 1 <= slot.completed_step <= slot.entered_step
            torn += not consistent
        assert reads > 1000 and torn == 0, (torn, reads)
    finally:
        writer.join(timeout=5)
