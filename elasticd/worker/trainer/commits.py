"""A ``transformers.Trainer`` checkpoint as a commit of the run's lineage (DESIGN.md §3).

Trainer writes ``checkpoint-N/`` in place and a crash mid-write leaves a folder its ``resume_from_checkpoint=True``
may pick. Here Trainer writes its folder, unchanged, inside this writer's partial directory
(``step-N.<writer>.partial/checkpoint-N/``); once every rank has written its files, rank 0 seals the manifest, asks
the fence (one etcd transaction under the group's fencing token) and renames the directory to ``step-N``: the same
commit as ``save_state`` checkpoints (:class:`~elasticd.worker.checkpoints.CheckpointStore`). Only what the lineage
records is ever resumed from (:mod:`elasticd.worker.resume_point`); a half-written folder is never a candidate.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from elasticd.messages import Kind
from elasticd.worker import resume_point
from elasticd.worker.beats import BeatClient
from elasticd.worker.checkpoints import Checkpoint, CheckpointStore, CommitDeferredError
from elasticd.worker.fence import EtcdFence
from elasticd.worker.settings import WorkerSettings

BadCheckpoint = Callable[[Checkpoint, str], None]
# The manifest's "format" of a commit holding Trainer's folder (a save_state commit has none).
TRAINER_FORMAT = "transformers.Trainer"


def trainer_folder(checkpoint: Checkpoint | Path, step: int | None = None) -> Path:
    """Trainer's own ``checkpoint-N`` folder inside a commit (or inside a partial directory, with ``step``)."""
    if isinstance(checkpoint, Checkpoint):
        return checkpoint.path / f"checkpoint-{checkpoint.step}"
    return checkpoint / f"checkpoint-{step}"


class TrainerCommits:
    """Where Trainer saves, how a save is committed, and which commit a start resumes from."""

    def __init__(
        self, settings: WorkerSettings, accelerator: Any, beats: BeatClient, log: Any, on_bad: BadCheckpoint
    ) -> None:
        s = settings
        self.accelerator = accelerator
        self.store = CheckpointStore(s.checkpoint_dir, s.run_id, keep=s.keep_checkpoints, token=s.fence_token)
        # under a daemon: commits are recorded in the run's lineage, and only what it records is ever loaded
        self.fence = EtcdFence(s.etcd_connect_args, s.run_id) if s.etcd and s.fence_token else None
        self.beats = beats
        self.log = log
        self._bad = on_bad  # a recorded checkpoint that fails verification (SaveEvents.bad_checkpoint)
        if accelerator.is_main_process:  # what a writer left that no record names (a crash mid-save)
            resume_point.remove_partials(self.store, self.fence)
        accelerator.wait_for_everyone()

    def resume_point(self) -> Checkpoint | None:
        """The newest recorded commit that verifies (a collective call: rank 0 chooses, every rank gets it)."""
        return resume_point.choose(
            self.accelerator, self.store, self.fence, int(self.accelerator.num_processes), self.log, self._bad
        )

    def begin(self, step: int) -> Path:
        """The directory Trainer saves ``checkpoint-N`` into for ``step`` (a collective call)."""
        if self.accelerator.is_main_process:
            self.store.begin(step)
        self.accelerator.wait_for_everyone()
        return self.store.partial_path(step)

    def commit(self, step: int, meta: dict[str, Any], started: float) -> Checkpoint | None:
        """After every rank wrote its files of ``step``: rank 0 seals and commits (a collective call). The commit on
        rank 0 (None on the others, and when the fence refused or etcd could not take it now)."""
        self.accelerator.wait_for_everyone()
        if not self.accelerator.is_main_process:
            return None
        record = self.store.seal(step, {**meta, "format": TRAINER_FORMAT})
        try:
            committed = self.store.publish(record, self.fence)
        except CommitDeferredError as exc:
            # the sealed directory stays: the next start rolls it forward if the record was taken after all
            self.log.warning(Kind.CHECKPOINT_DEFERRED.value, step=step, error=str(exc))
            self.beats.send(Kind.CHECKPOINT_DEFERRED, step=step, error=str(exc))
            return None
        if committed is None:
            self.log.warning(Kind.CHECKPOINT_FENCED.value, step=step)
            self.beats.send(Kind.CHECKPOINT_FENCED, step=step)
            return None
        total_s = time.monotonic() - started
        self.beats.send(
            Kind.CHECKPOINT_COMMITTED,
            step=step,
            blocking_s=total_s,
            total_s=total_s,
            path=str(committed.path),
            asynchronous=False,
        )
        return committed
