"""What the worker makes of its checkpoint saver's events: fault injection points, log lines and daemon messages."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from elasticd.messages import Kind
from elasticd.worker.beats import BeatClient
from elasticd.worker.checkpoints import Checkpoint
from elasticd.worker.commit_queue import DEFERRED
from elasticd.worker.faults import FaultInjector
from elasticd.worker.saver import ABANDONED, FAILED, FENCED, SEALED, WRITTEN


class SaveEvents:
    """The saver's ``on_event`` (and the store's ``on_bad``) for one worker; ``log`` gives its current logger (the
    rank it names changes with a recovery in place)."""

    def __init__(self, log: Callable[[], Any], beats: BeatClient, faults: FaultInjector) -> None:
        self._log = log
        self._beats = beats
        self._faults = faults

    def __call__(self, event: str, fields: dict[str, Any]) -> None:
        if event == WRITTEN:
            self._faults.during_checkpoint(int(fields["step"]))
            return
        if event == SEALED:
            self._faults.before_commit(int(fields["step"]))
            return
        if event in (FENCED, DEFERRED):
            self._log().warning(event, **fields)
        if event == ABANDONED:
            self._log().warning(event, **fields)
            if fields.get("committer"):  # a save its group's replaced token kept from committing: counted as fenced
                self._beats.send(Kind.CHECKPOINT_FENCED, step=fields["step"])
            return
        if event == FAILED:
            self._log().warning(
                "checkpoint_failed",
                step=fields.get("step"),
                error=fields.get("error"),
                errno=fields.get("errno"),
                path=fields.get("path"),
                os_error=fields.get("os_error"),
            )
        self._beats.send(Kind(event), **fields)  # the saver's other events are messages of these kinds

    def bad_checkpoint(self, checkpoint: Checkpoint, reason: str) -> None:
        """A recorded checkpoint failed verification: the one before it is tried."""
        self._log().warning("checkpoint_unusable", path=str(checkpoint.path), reason=reason)
        self._beats.send(Kind.CHECKPOINT_UNUSABLE, step=checkpoint.step, reason=reason)
