"""What this node's workers told the daemon through their beats, per worker generation.

The beat receiver thread feeds :meth:`WorkerReports.on_beat`; the supervisor loop reads the answers: do all local
workers speak the checkpoint-request protocol (``hello``), have they all saved the checkpoint a planned change waits
for (``checkpoint_saved``), did one of them give up for good (``fatal``). :meth:`reset` starts a new generation
whenever the group is (re)started, so nothing from a previous generation is mistaken for an answer.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from elasticd.messages import Capability, Kind, kind_of


@dataclass(frozen=True, slots=True)
class Fatal:
    reason: str
    message: str
    exit_code: int


class WorkerReports:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._local_ranks: set[int] = set()
        self._capable: set[int] = set()
        self._stacks: set[int] = set()  # registered the stack dump signal (SIGUSR1 is safe to send)
        self._in_place: set[int] = set()  # armed hot recovery: re-forms its group in place when a peer is lost
        self._saved: dict[int, tuple[int, bool]] = {}  # local rank -> (step, committed)
        self._fatal: Fatal | None = None
        self.last_step: int | None = None

    def reset(self, local_ranks: set[int]) -> None:
        with self._lock:
            self._local_ranks = set(local_ranks)
            self._capable.clear()
            self._stacks.clear()
            self._in_place.clear()
            self._saved.clear()
            self._fatal = None

    def on_beat(self, beat: dict[str, Any]) -> None:
        kind = kind_of(beat)
        local_rank = int(beat.get("local_rank", 0))
        with self._lock:
            if kind is Kind.HELLO:
                capabilities = beat.get("capabilities") or []
                if Capability.CHECKPOINT_REQUEST in capabilities:
                    self._capable.add(local_rank)
                if Capability.STACKS in capabilities:
                    self._stacks.add(local_rank)
                if Capability.IN_PLACE in capabilities:
                    self._in_place.add(local_rank)
            elif kind is Kind.CHECKPOINT_SAVED and beat.get("requested"):
                self._saved[local_rank] = (int(beat.get("step", 0)), beat.get("committed") is not False)
            elif kind is Kind.FATAL and self._fatal is None:
                self._fatal = Fatal(
                    str(beat.get("reason", "")), str(beat.get("message", "")), int(beat.get("exit_code", 1))
                )
            elif kind is Kind.STEP and isinstance(beat.get("step"), int):
                self.last_step = beat["step"]

    def all_capable(self) -> bool:
        with self._lock:
            return bool(self._local_ranks) and self._local_ranks <= self._capable

    def all_in_place(self) -> bool:
        """Every local worker armed hot recovery: a peer's loss is re-formed in place, not restarted."""
        with self._lock:
            return bool(self._local_ranks) and self._local_ranks <= self._in_place

    def can_dump_stacks(self) -> set[int]:
        with self._lock:
            return set(self._stacks)

    def all_saved(self) -> bool:
        with self._lock:
            return bool(self._local_ranks) and self._local_ranks <= set(self._saved)

    def saved_step(self) -> int | None:
        """The step of the checkpoint the workers saved on request, if it was committed (else None)."""
        with self._lock:
            committed = [step for step, ok in self._saved.values() if ok]
            if not committed or len(committed) < len(self._saved):
                return None
            return max(committed)

    def saved_but_fenced(self) -> int | None:
        """The step of a requested checkpoint that the fence refused (its steps will be redone), else None."""
        with self._lock:
            fenced = [step for step, ok in self._saved.values() if not ok]
            return max(fenced) if fenced else None

    def clear_saved(self) -> None:
        with self._lock:
            self._saved.clear()

    @property
    def fatal(self) -> Fatal | None:
        with self._lock:
            return self._fatal
