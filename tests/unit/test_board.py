"""The progress board: what a worker writes is what its daemon reads; requests and answers never clobber."""

from __future__ import annotations

import os
from pathlib import Path

from elasticd.agent.evidence import main_thread, process_state
from elasticd.board import NullSlotWriter, Phase, Slot, SlotWriter, read_slot, request_dump
from elasticd.layout import slot_path


def _slot(path: Path) -> Slot:
    slot = read_slot(path)
    assert slot is not None, "no slot"
    return slot


def test_worker_updates_are_read_by_the_daemon(tmp_path: Path) -> None:
    path = slot_path(tmp_path, 1)
    writer = SlotWriter(path)
    slot = read_slot(path)
    assert slot is not None and slot.phase is Phase.STARTING and slot.pid == os.getpid() and slot.step_done_t == 0
    writer.resumed(20)
    writer.enter(21)
    assert _slot(path).entered_step == 21
    writer.completed(21, step_s=0.1, own_s=0.02)
    slot = read_slot(path)
    assert slot is not None
    assert (slot.phase, slot.completed_step, slot.entered_step) == (Phase.TRAINING, 21, 21)
    assert slot.step_s == 0.1 and slot.own_s == 0.02 and slot.step_done_t == slot.progress_t > 0
    writer.set_phase(Phase.CHECKPOINT)
    assert _slot(path).phase is Phase.CHECKPOINT
    writer.close()


def test_dump_request_and_answer_live_in_separate_fields(tmp_path: Path) -> None:
    path = slot_path(tmp_path, 0)
    writer = SlotWriter(path)
    assert request_dump(path) == 1 and request_dump(path) == 2
    writer.completed(5, 0.1, 0.01)  # a worker update never erases the daemon's request
    assert writer.dump_request == 2
    writer.answered_dump(2)
    slot = read_slot(path)
    assert slot is not None and (slot.dump_request, slot.dump_done, slot.completed_step) == (2, 2, 5)


def test_missing_or_foreign_file_reads_as_no_slot(tmp_path: Path) -> None:
    assert read_slot(tmp_path / "absent") is None
    (tmp_path / "junk").write_bytes(b"x" * 200)
    assert read_slot(tmp_path / "junk") is None


def test_null_writer_does_nothing() -> None:
    w = NullSlotWriter()
    w.completed(1, 0.1, 0.1)
    w.set_phase(Phase.DONE)
    assert w.dump_request == 0


FAULTHANDLER_DUMP = """Thread 0x00007fec323ff6c0 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 331 in wait
  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap

Current thread 0x00007fec5c095b80 (most recent call first):
  File "/venv/torch/autograd/graph.py", line 979 in _engine_run_backward
  File "/venv/torch/_tensor.py", line 623 in backward
  File "/work/examples/train.py", line 115 in <module>
"""


def test_main_thread_is_the_one_that_runs_the_script() -> None:
    frames = main_thread(FAULTHANDLER_DUMP)
    assert frames[0] == "/venv/torch/autograd/graph.py:979 in _engine_run_backward"
    assert frames[-1].endswith("in <module>")
    assert main_thread("") == []


def test_process_state_reads_proc() -> None:
    assert process_state(os.getpid()) == "running"
    assert process_state(2**22 + 12345) == "gone"
