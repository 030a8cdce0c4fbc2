"""The progress board: one small shared-memory slot per local worker, written by the worker, read by its daemon.

Beats (a datagram every ≥ 250 ms) carry figures for metrics; the hang watchdog needs something finer and cheaper:
where every rank is *now*. Each worker maps ``<board-dir>/rank-<local_rank>`` (a 64-byte file in the daemon's runtime
directory, :func:`elasticd.layout.slot_path`) and overwrites it at every step boundary and phase change: one
``struct.pack_into``, about a microsecond, no system call. The daemon reads the slots whenever it likes (every
monitor interval). Both clocks are ``CLOCK_MONOTONIC`` (``time.monotonic``), which is one clock for all processes of
a host.

The layout is defined here only, for both sides. Each side packs its fields into bytes first and copies them into the
map in one slice assignment: ``struct.pack_into`` would zero the whole slot before writing it, and a reader could
catch a slot that looks valid with a progress time of 0 (a rank "silent since boot"). The reader also reads until
two reads agree, so it never mixes two updates either.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path

# magic, version, pid, phase, entered step, completed step, progress time, step-done time, step time, own time: the
# worker writes these. Then the dump request (written only by the daemon) and the dump answer (only by the worker),
# so neither side ever overwrites the other's field.
_FORMAT = "<4sHxxIIqqddddQQ"
_WORKER_FORMAT = "<4sHxxIIqqdddd"
SIZE = struct.calcsize(_FORMAT)
_REQUEST_AT = struct.calcsize(_WORKER_FORMAT)
_DONE_AT = _REQUEST_AT + 8
_MAGIC = b"ELBD"
_VERSION = 1


class Phase(IntEnum):
    """Where a worker is; the watchdog gives each phase its own allowance."""

    STARTING = 0  # attached, not yet resumed (imports, process group, model setup)
    LOADING = 1  # loading a checkpoint (resume or rollback)
    TRAINING = 2  # between and inside optimizer steps
    CHECKPOINT = 3  # the blocking part of a save
    PARKED = 4  # saved the checkpoint its daemon asked for; waiting to be stopped
    DONE = 5  # epochs finished: final waits and exit
    BUSY = 6  # the script's own long work between steps (``with run.busy():``, e.g. an evaluation)
    EXITING = 7  # an exception escaped the script: the process is on its way out (a failure for torch to report)
    JOINING = 8  # imported and prepared, waiting to be admitted to a group that trains in place (hot recovery)


@dataclass(frozen=True, slots=True)
class Slot:
    """One worker's position as last written."""

    pid: int
    phase: Phase
    entered_step: int  # the optimizer step whose micro-batches it is working on (last completed + 1 while busy)
    completed_step: int
    progress_t: float  # monotonic time of the last progress: a step completed or a phase changed
    step_done_t: float  # monotonic time of the last completed step (0: none yet in this process)
    step_s: float  # the last step's wall time, checkpoint saves excluded
    own_s: float  # the last step's time that waits for nobody: data wait + forward passes
    dump_request: int
    dump_done: int


class SlotWriter:
    """The worker's side: owns its slot file; every ``update`` rewrites the whole slot."""

    def __init__(self, path: str | Path, pid: int | None = None) -> None:
        self.path = Path(path)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, SIZE)
            self._map = mmap.mmap(fd, SIZE)
        finally:
            os.close(fd)
        self.pid = pid if pid is not None else os.getpid()
        self.phase = Phase.STARTING
        self.entered_step = 0
        self.completed_step = 0
        self.progress_t = time.monotonic()
        self.step_done_t = 0.0
        self.step_s = 0.0
        self.own_s = 0.0
        self._write()

    def _write(self) -> None:
        self._map[:_REQUEST_AT] = struct.pack(
            _WORKER_FORMAT,
            _MAGIC,
            _VERSION,
            self.pid,
            int(self.phase),
            self.entered_step,
            self.completed_step,
            self.progress_t,
            self.step_done_t,
            self.step_s,
            self.own_s,
        )

    @property
    def dump_request(self) -> int:
        """Bumped by the daemon when it wants evidence (read from the shared slot, not written by us)."""
        if self._map.closed:
            return 0
        return int(struct.unpack_from("<Q", self._map, _REQUEST_AT)[0])

    def set_phase(self, phase: Phase) -> None:
        self.phase = phase
        self.progress_t = time.monotonic()
        self._write()

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """The script's own long work between steps (``run.busy()``): the phase the watchdog gives the start-up
        allowance, then back to where it was."""
        previous = self.phase
        self.set_phase(Phase.BUSY)
        try:
            yield
        finally:
            self.set_phase(Phase.TRAINING if previous is Phase.BUSY else previous)

    def enter(self, step: int) -> None:
        self.entered_step = step
        self._write()

    def completed(self, step: int, step_s: float, own_s: float) -> None:
        now = time.monotonic()
        self.completed_step = step
        self.entered_step = max(self.entered_step, step)
        self.progress_t = self.step_done_t = now
        self.step_s = step_s
        self.own_s = own_s
        self.phase = Phase.TRAINING
        self._write()

    def resumed(self, step: int) -> None:
        """After loading: training starts at ``step`` (no step completed in this generation yet)."""
        self.completed_step = self.entered_step = step
        self.set_phase(Phase.TRAINING)

    def answered_dump(self, request: int) -> None:
        self._map[_DONE_AT : _DONE_AT + 8] = struct.pack("<Q", request)

    def close(self) -> None:
        self._map.close()


def read_slot(path: str | Path) -> Slot | None:
    """The slot at ``path``; None while the worker has not created it (or wrote something else there)."""
    try:
        with open(path, "rb") as f:
            data = f.read(SIZE)
            for _ in range(3):  # a read that overlapped a write differs from the next one
                again = os.pread(f.fileno(), SIZE, 0)
                if again == data:
                    break
                data = again
    except OSError:
        return None
    if len(data) < SIZE:
        return None
    magic, version, pid, phase, entered, completed, progress_t, done_t, step_s, own_s, request, done = struct.unpack(
        _FORMAT, data
    )
    if magic != _MAGIC or version != _VERSION:
        return None
    try:
        phase_value = Phase(phase)
    except ValueError:
        return None
    return Slot(pid, phase_value, entered, completed, progress_t, done_t, step_s, own_s, request, done)


def request_dump(path: str | Path) -> int:
    """The daemon's side: ask the worker for its flight-recorder dump; returns the request number."""
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), SIZE) as m:
        request = int(struct.unpack_from("<Q", m, _REQUEST_AT)[0]) + 1
        m[_REQUEST_AT : _REQUEST_AT + 8] = struct.pack("<Q", request)
    return request


class NullSlotWriter(SlotWriter):
    """Without a daemon (plain ``python``, ``accelerate launch``): every update is a no-op."""

    def __init__(self) -> None:  # no file, no map
        self.phase = Phase.STARTING

    def _write(self) -> None:
        pass

    @property
    def dump_request(self) -> int:
        return 0

    def set_phase(self, phase: Phase) -> None:
        self.phase = phase

    def enter(self, step: int) -> None:
        pass

    def completed(self, step: int, step_s: float, own_s: float) -> None:
        pass

    def resumed(self, step: int) -> None:
        pass

    def answered_dump(self, request: int) -> None:
        pass

    def close(self) -> None:
        pass
