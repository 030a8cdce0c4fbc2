"""The training state of a run, in one place: what a checkpoint records besides accelerate's files, and what a
restart (today: a new process; later: a survivor re-forming its process group in place) must restore.

Everything here is plain data. :class:`TrainingState` goes into the checkpoint manifest through ``to_meta`` and
comes back through ``from_meta``; nothing else in the worker library keeps progress of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from elasticd.worker.sampler import DataPosition


@dataclass(frozen=True, slots=True)
class TrainingState:
    """Progress of the run: counts of optimizer steps and of samples, and where the data stands."""

    step: int = 0  # optimizer steps completed (a skipped non-finite step counts: its batch was consumed)
    data: DataPosition = field(default_factory=DataPosition)
    skipped_steps: frozenset[tuple[int, int]] = frozenset()  # (epoch, position) of batches stepped over
    nonfinite_steps: int = 0  # non-finite steps skipped so far, over the whole run
    rollbacks: int = 0

    def to_meta(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "epoch": self.data.epoch,
            "samples_in_epoch": self.data.position,
            "skipped_steps": sorted([list(p) for p in self.skipped_steps]),
            "nonfinite_steps": self.nonfinite_steps,
            "rollbacks": self.rollbacks,
        }

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> TrainingState:
        return cls(
            step=int(meta.get("step", 0)),
            data=DataPosition(int(meta.get("epoch", 0)), int(meta.get("samples_in_epoch", 0))),
            skipped_steps=frozenset((int(e), int(p)) for e, p in meta.get("skipped_steps", [])),
            nonfinite_steps=int(meta.get("nonfinite_steps", 0)),
            rollbacks=int(meta.get("rollbacks", 0)),
        )

    def advanced(self, data: DataPosition) -> TrainingState:
        return replace(self, step=self.step + 1, data=data)
