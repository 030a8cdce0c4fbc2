"""Atomic checkpoint saves of an accelerate training state, blocking or in the background (DESIGN.md §2, §3).

This module owns how a save happens across ranks: who creates ``step-N.partial/``, where the barriers are, who
asks the fence and commits. What an asynchronous save copies to host memory is :mod:`elasticd.worker.snapshot`'s;
the layout, manifest and verification belong to :mod:`elasticd.worker.checkpoints`.

accelerate's ``save_state`` writes in place and has no final barrier; here every save goes to the ``.partial`` dir
and rank 0 commits once all ranks have written, so a crash at any moment leaves the previous checkpoint the latest.
Both ways write the files of ``save_state``, in its format: ``accelerator.load_state(path)`` loads a commit. An
asynchronous save blocks for a host-memory snapshot and one barrier; a thread per rank then writes the files with
accelerate's ``save_accelerator_state`` (a sharded model's shards through DCP first) and its part of the save (its
files' hashes, in its marker), and rank 0's waits for every marker before committing.

A background write belongs to the group that started it. Each one is a :class:`_Job` that keeps that group's view
(fencing token, writer directory, rank, world size) whatever happens to the saver meanwhile. When the group re-forms
in place (:meth:`CheckpointSaver.regroup`) a write still in flight is handed over: past its seal it finishes under
the token it started with (committed, or refused by the fence: the epoch's decision moved the token); before it, it
is abandoned (``checkpoint_abandoned``) and its directory removed, since a member lost with the old group may never
write its part. What a lost writer left (its rank 0 died) is removed by the new group's rank 0 once every rank's old
write has ended (``sweep``).

A collective of a save itself can fail: a peer dies, or is stopped, while the ranks agree on the save. Without hot
recovery that is the worker's end (the daemon restarts cold). With it (``on_group_failure`` set), the save is given
up like any failed step: rank 0, the only rank that commits, removes the partial directory unless it was sealed
(``checkpoint_abandoned``), every rank tells the hot path, and the next step boundary re-forms the group in place.
"""

from __future__ import annotations

import atexit
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.checkpointing import save_accelerator_state, save_custom_state
from accelerate.utils import RNG_STATE_NAME, DistributedType

from elasticd import rundir
from elasticd.layout import done_marker
from elasticd.messages import Kind
from elasticd.worker.checkpoints import (
    Checkpoint,
    CheckpointStore,
    Fence,
    Parts,
    cannot_reshard,
    read_parts,
    write_part,
)
from elasticd.worker.commit_queue import ABANDONED, CommitQueue, Sealed
from elasticd.worker.hot.given_up import GIVEN_UP
from elasticd.worker.planning import TrainingStopped
from elasticd.worker.snapshot import Snapshot, Snapshotter, is_sharded

# The events a rank's daemon hears of: the worker forwards them as messages of these kinds.
COMMITTED = Kind.CHECKPOINT_COMMITTED
FAILED = Kind.CHECKPOINT_FAILED
FENCED = Kind.CHECKPOINT_FENCED
# ABANDONED (commit_queue's): a background write of a group that re-formed in place, given up before its seal.
# This rank's files are on disk, not yet committed (fault injection kills a rank here: a torn checkpoint).
WRITTEN = "checkpoint_written"
# Rank 0: every file and the manifest are durable, the fence is asked next (fault injection freezes a node here).
SEALED = "checkpoint_sealed"
# Seconds an exiting worker gives its writer to hear the fence's answer about a sealed checkpoint (one etcd
# transaction, bounded by the client's own timeouts; this only bounds a stuck one).
EXIT_SETTLE_S = 30.0
# save_state of these writes engine-specific files that a host snapshot cannot reproduce: saved blocking. So is FSDP
# but FSDP2's SHARDED_STATE_DICT (snapshot.py stages its shards).
_NO_SNAPSHOT = frozenset(
    {DistributedType.FSDP, DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM, DistributedType.XLA}
)
# How often a rank waiting in a save's agreement looks whether the group failed elsewhere (hot recovery), in s.
_AGREEMENT_POLL_S = 0.001
# Rank 0's writer looks for the other ranks' markers this often (s): one stat per rank on the shared filesystem.
_MARKER_POLL_S = 0.05
# The error of a rank that failed only because another rank's write did (the one with the OS error reports that).
PEER_FAILED = "another rank's write of this checkpoint failed"
# Why a handed-over write is abandoned (the checkpoint_abandoned event's reason).
REGROUPED = "the group re-formed in place while it was written"
# Why a save is given up when one of its own collectives failed (hot recovery: the group re-forms next).
GROUP_FAILED = "a collective of the save failed (a peer was lost)"
# How a rank left a collective of a save that the group's failure elsewhere would never let complete.
FAILED_ELSEWHERE = "the group failed elsewhere (a failure notice) while this rank waited"


class CheckpointFailedError(Exception):
    """A save failed on some rank and was abandoned everywhere; its partial directory is removed."""

    def __init__(self, step: int, error: str) -> None:
        super().__init__(f"checkpoint of step {step} failed: {error}")
        self.step = step
        self.error = error


@dataclass(frozen=True, slots=True)
class _Job:
    """One background write as the group that started it sees it. A re-formation in place changes the saver's rank,
    world size and token (and accelerate's) under the writer thread: the thread reads them from here only."""

    step: int
    store: CheckpointStore  # pinned at the start: the fencing token and the writer's directory
    rank: int
    world_size: int
    main: bool  # the rank that commits
    each_node: bool  # accelerate's save_on_each_node
    handed_over: threading.Event = field(default_factory=threading.Event)

    @property
    def partial(self) -> Path:
        return self.store.partial_path(self.step)

    def check(self) -> None:
        """Raise :class:`_HandedOverError` when the group re-formed in place and this write is not sealed yet."""
        if self.handed_over.is_set():
            raise _HandedOverError(REGROUPED)


class CheckpointSaver:
    """Saves ``accelerator``'s state into ``store``, every rank at the same step; one background write at a time.

    ``fence(record)`` is asked on rank 0 once the files and the manifest are durable (from the writer thread for an
    asynchronous save): the commit point. False refuses it: the writer's directory is removed and
    ``checkpoint_fenced`` reported; when etcd cannot be asked the checkpoint waits, sealed, and is committed in
    step order once it can (``checkpoint_commit_deferred``, ``commit_queue.py``). ``on_event(name, fields)`` receives
    ``checkpoint_committed`` (rank 0: step, blocking_s, total_s, path, asynchronous), ``checkpoint_failed`` (the
    rank whose write failed, and rank 0: step, error, errno, path, os_error), ``checkpoint_fenced`` (rank 0:
    step) and ``checkpoint_abandoned`` (each rank whose write was handed over unsealed: step, the rank it wrote
    as, whether it was the one to commit, path, reason), possibly from the writer thread. ``sweep()`` is called on
    rank 0 after a re-formation in place, once every rank's earlier write has ended, to remove the directories of
    writers lost with the old group.

    A failed save never stops training: its directory is removed at once (the space is given back), every rank
    abandons it, and the next save starts afresh; only a directory the fence may already have recorded is kept (the
    next loader rolls it forward, or the next group removes it). The OS error is named even where torch hides it (a
    full disk surfaces from ``torch.save`` as a ``RuntimeError`` without errno; :func:`elasticd.rundir.os_error_of`
    probes).
    """

    def __init__(
        self,
        accelerator: Accelerator,
        store: CheckpointStore,
        *,
        fence: Fence | None = None,
        on_event: Callable[[str, dict[str, Any]], None] | None = None,
        sweep: Callable[[], None] | None = None,
        commit_timeout_s: float = 300,
    ) -> None:
        if accelerator.project_configuration.automatic_checkpoint_naming:
            # save_state would then ignore the directory it is given and write under project_dir/checkpoints.
            raise ValueError("CheckpointSaver needs ProjectConfiguration(automatic_checkpoint_naming=False)")
        self._acc = accelerator
        self._store = store
        self._on_event = on_event
        self._sweep = sweep
        self._commit_timeout_s = commit_timeout_s
        self._writer: threading.Thread | None = None
        self._job: _Job | None = None  # the background write of self._writer
        # a re-formation in place happened since the last sweep (the same on every rank: every member re-formed)
        self._regrouped = False
        self._snapshots = Snapshotter(commit_timeout_s)
        # partial dirs of failed saves that could not be removed then (read-only, or a rank still writing into it)
        self._leftovers: set[Path] = set()
        # the step whose record the fence was asked for: from then on a failure keeps the dir (it may be recorded)
        self._sealed: int | None = None
        # Hot recovery sets it: a failed collective of a save is then a failed step (re-formed in place at the next
        # step boundary), not the worker's end; it is called with the reason.
        self.on_group_failure: Callable[[str], None] | None = None
        # Hot recovery sets it too: has the step already failed elsewhere (a peer's failure notice)? A rank waiting in
        # a save's agreement for a peer that itself waits on a dead rank sees no reset (only the dead rank's peers
        # do): it leaves the agreement on the notice instead.
        self.group_failed: Callable[[], bool] | None = None
        self._queue = CommitQueue(fence, self._emit)  # rank 0's commits, in step order (also those that wait for etcd)
        atexit.register(self._settle_at_exit)

    def save(self, step: int, meta: dict[str, Any], *, asynchronous: bool = False) -> bool | None:
        """Save the state as of now as ``step``, with ``meta`` in the manifest; call on every rank at the same step.

        Blocking: returns once the checkpoint is committed (True) or the fence refused it (False), the same answer on
        every rank; a failure on any rank is reported and raises :class:`CheckpointFailedError` on every rank.
        Asynchronous: first waits for the previous background write, then returns None once the state is copied to
        host memory (``snapshot.py``); the write and commit follow in the background and a failure there is only
        reported. Under DeepSpeed, Megatron-LM, XLA or FSDP other than FSDP2's sharded state dicts, it is blocking."""
        self.wait()
        if self._regrouped:
            self._regrouped = False
            self._acc.wait_for_everyone()  # every rank's write from before the re-formation has ended
            self._sweep_lost()
        self._sweep_leftovers(step)
        self._sealed = None
        start = time.monotonic()
        try:
            if asynchronous and (self._acc.distributed_type not in _NO_SNAPSHOT or is_sharded(self._acc)):
                self._start_write(step, meta, start)
                return None
            return self._save_blocking(step, meta, start)
        except CheckpointFailedError:
            raise  # reported, and every rank raises it together
        except _GroupFailedError as exc:
            self._group_failed(step, str(exc))
            return False
        except Exception as exc:  # outside the writes (the host snapshot, a collective): this rank cannot go on
            self._emit(FAILED, step=step, error=repr(exc))
            raise

    def wait(self, *, everyone: bool = False) -> None:
        """Return once this rank's background write (on rank 0: and its commit) has finished; call it before exit.
        Other ranks may still be writing: with ``everyone=True``, a collective call on every rank, the last save is
        decided (committed, fenced or failed) when it returns, so every rank then sees the same latest checkpoint."""
        if self._writer is not None:
            self._writer.join()
            self._writer, self._job = None, None
        self._snapshots.recycle()
        if everyone:
            self._acc.wait_for_everyone()
            if self._regrouped:
                self._regrouped = False
                self._sweep_lost()

    def regroup(self) -> None:
        """The group re-formed in place (call it before the new token is adopted): hand the background write over.

        It goes on as the old group's, never the new one's: sealed, it is committed or fenced under its own token;
        not yet, it is abandoned at its next step (writing its files, waiting for a lost rank's marker) and its
        directory removed. Returns at once: a write in flight does not hold up the recovery."""
        if self._job is not None:
            self._job.handed_over.set()
        self._regrouped = True
        self._snapshots.regroup()

    def _sweep_lost(self) -> None:
        if self._sweep is not None and self._acc.is_main_process:
            self._sweep()

    def close(self) -> None:
        """Wait for the background write and, a while, for commits that wait for etcd; free the host memory."""
        self.wait()
        self._queue.wait(EXIT_SETTLE_S)
        self._snapshots = Snapshotter(self._commit_timeout_s)

    def load(self, cp: Checkpoint) -> dict[str, Any]:
        """Load ``cp`` into the accelerator's objects with ``accelerator.load_state``; its manifest."""
        self.wait()  # a commit in flight may prune the very checkpoint being loaded
        self._queue.wait(EXIT_SETTLE_S)
        if refusal := cannot_reshard(cp.path, int(self._acc.num_processes)):
            raise TrainingStopped(refusal)
        self._acc.load_state(str(cp.path))
        return cp.manifest()

    def _save_blocking(self, step: int, meta: dict[str, Any], start: float) -> bool:
        acc = self._acc
        failure = _attempt(self._store.begin, step) if acc.is_main_process else None
        # Nobody writes before rank 0 has made the empty partial dir; if it could not, nobody writes at all (save_state
        # would create the dir itself). Each barrier is an agreement, so every rank leaves a failed save together.
        if self._everyone_ok(failure is None):
            partial, rank = self._store.partial_path(step), int(acc.process_index)
            failure = _attempt(acc.save_state, str(partial)) or _attempt(write_part, partial, rank)
            if failure is None:
                self._emit(WRITTEN, step=step)
            # save_state has no final barrier: here every rank's files are complete, or some rank's write failed
            if self._everyone_ok(failure is None):
                # rank 0's: committed; the commit failed; whether the fence was asked (the dir is then kept)
                outcome = [0, 0, 0]
                if acc.is_main_process:
                    try:
                        parts = read_parts(partial, int(acc.num_processes))
                        outcome = [int(bool(self._commit(self._store, step, meta, start, None, parts))), 0, 0]
                    except Exception as exc:
                        failure, outcome = exc, [0, 1, int(self._sealed == step)]
                # no rank goes on (to load, or to exit) before the commit is decided, and every rank learns how: a
                # sum (the others add zeros) that, like the agreements, leaves on the group's failure elsewhere
                committed, errored, sealed = self._sum(outcome)
                if not errored:
                    return bool(committed)
                if sealed:
                    self._sealed = step
        error = self._failed(step, failure, self._store.partial_path(step), acc.is_main_process)
        raise CheckpointFailedError(step, error)

    def _start_write(self, step: int, meta: dict[str, Any], start: float) -> None:
        acc = self._acc
        job = _Job(
            step,
            self._store.pinned(),
            int(acc.process_index),
            int(acc.num_processes),
            bool(acc.is_main_process),
            bool(acc.project_configuration.save_on_each_node),
        )
        failure = _attempt(job.store.begin, step) if job.main else None
        snapshot = self._snapshots.take(acc, is_sharded(acc))
        # the one collective of an async save: rank 0's fresh dir exists before any write, or nobody writes
        if not self._everyone_ok(failure is None):
            self._failed(step, failure, job.partial, job.main)
            return
        for hook in acc._save_model_state_pre_hook.values():  # as save_state does; a hook may edit the weights
            hook(acc._models, snapshot.state["model_states"], str(job.partial))
        acc.project_configuration.iteration += 1
        args = (job, snapshot, meta, start, time.monotonic() - start)
        # A daemon: a writer waiting for a dead rank's marker must not hold up this process's exit.
        self._writer = threading.Thread(target=self._write, args=args, name=f"elasticd-checkpoint-{step}", daemon=True)
        self._job = job
        self._writer.start()

    def _write(self, job: _Job, snapshot: Snapshot, meta: dict[str, Any], start: float, blocking_s: float) -> None:
        step, partial, each_node = job.step, job.partial, job.each_node
        try:
            self._snapshots.write_shards(snapshot, partial)  # DCP's collectives: every rank, on the writers' group
            state = snapshot.state
            save_accelerator_state(str(partial), **state, process_index=job.rank, save_on_each_node=each_node)
            for index, obj in enumerate(snapshot.custom):
                save_custom_state(obj, str(partial), index, save_on_each_node=each_node)
            # save_accelerator_state wrote the RNG of this moment, mid-training; resuming needs the snapshot's.
            torch.save(snapshot.rng, partial / f"{RNG_STATE_NAME}_{job.rank}.pkl")
            self._emit(WRITTEN, step=step)
            job.check()  # no marker after a hand-over: rank 0 cannot seal what this rank gives up
            write_part(partial, job.rank)  # its files' hashes, in its marker: rank 0 commits once it sees every rank's
            if job.main:
                parts = self._await_markers(job)
                job.check()  # the last moment to give up: once sealed, the fence decides
                self._commit(job.store, step, meta, start, blocking_s, parts)
        except _HandedOverError as exc:
            self._abandon(job, str(exc))
        except Exception as exc:  # a thread has no caller to raise to: the failure is an event
            # the dir vanished under this write: a rank whose own write failed removed it (torch then says only
            # "Parent directory ... does not exist"); that rank reports the cause. After a hand-over it may also
            # be a rank that abandoned it: that rank said so.
            if job.handed_over.is_set() and not partial.is_dir():
                self._abandon(job, REGROUPED)
            else:
                self._failed(step, exc if partial.is_dir() else _PeerFailedError(PEER_FAILED), partial, job.main)

    def _await_markers(self, job: _Job) -> Parts:
        partial = job.partial
        markers = [partial / done_marker(rank) for rank in range(job.world_size)]
        deadline = time.monotonic() + self._commit_timeout_s
        while missing := [m.name for m in markers if not m.exists()]:
            job.check()  # a rank lost with the old group never writes its marker
            if not partial.is_dir():  # a rank whose write failed removed it: no marker is coming
                raise _PeerFailedError(PEER_FAILED)
            if time.monotonic() > deadline:
                raise TimeoutError(f"not written within {self._commit_timeout_s:g} s: {', '.join(missing)}")
            time.sleep(_MARKER_POLL_S)
        return read_parts(partial, job.world_size)

    def _commit(
        self, store: CheckpointStore, step: int, meta: dict[str, Any], start: float, blocked: float | None, parts: Parts
    ) -> bool | None:
        """Rank 0: seal and commit the files ``store``'s writer wrote (``parts``: those the ranks hashed): True
        committed, False refused by the fence, None waiting for etcd (``commit_queue.py``: later, in step order)."""
        record = store.seal(step, meta, parts)
        self._emit(SEALED, step=step)
        return self._queue.commit(Sealed(store, record, start, blocked))

    def _everyone_ok(self, ok: bool) -> bool:
        """A collective on every rank: True when ``ok`` on every rank (a barrier that also carries one bit)."""
        return self._sum([0 if ok else 1]) == [0]

    def _sum(self, values: list[int]) -> list[int]:
        """A collective on every rank: ``values`` summed over the ranks. With hot recovery it gives up once the group
        failed elsewhere (``group_failed``): a rank whose peers see no reset (a node frozen or cut off, a peer that
        itself gave up) must not wait for gloo's timeout (seen: rank 0 in a blocking broadcast of the outcome for
        2 min while a peer, frozen, had already contributed to the agreement before it)."""
        acc = self._acc
        if acc.num_processes == 1:
            return values
        summed = torch.tensor(values, dtype=torch.int64, device=acc.device)
        group = dist.group.WORLD
        work = dist.all_reduce(summed, op=dist.ReduceOp.SUM, async_op=True)
        try:
            _collective(lambda: _wait(work, self.group_failed), self.on_group_failure)
        except _GroupFailedError:
            GIVEN_UP.hold(work, group)  # a pending gloo Work's destructor may throw: held until it ends
            raise
        return [int(v) for v in summed.tolist()]

    def _group_failed(self, step: int, error: str) -> None:
        """A collective of the save of ``step`` failed: give the save up on this rank and fail the step in place.

        Only rank 0 removes the partial directory (it alone would commit it, so no rank can remove files under a
        commit); unless sealed: the fence then decided, and said so. What other ranks write later, or a lost rank 0
        left, the next group's rank 0 sweeps (``sweep``, once every rank's earlier write has ended)."""
        partial = self._store.partial_path(step)
        if self._acc.is_main_process and self._sealed != step:
            shutil.rmtree(partial, ignore_errors=True)
            if partial.exists():
                self._leftovers.add(partial)
            self._emit(ABANDONED, step=step, old_rank=0, committer=True, path=str(partial), reason=GROUP_FAILED)
        assert self.on_group_failure is not None
        self.on_group_failure(f"checkpoint of step {step}: {GROUP_FAILED}: {error}")

    def _failed(self, step: int, failure: BaseException | None, partial: Path, main: bool) -> str:
        """Abandon the save of ``step`` into ``partial`` on this rank: remove the dir and report why; the error text.

        The rank whose own write failed reports its error; the other ranks stay quiet, except rank 0 (``main``: the
        one that would have committed), which reports a peer's failure. Removing the dir is also how a failed rank
        tells rank 0's writer, waiting for its marker, not to wait."""
        peer = failure is None or isinstance(failure, _PeerFailedError)
        fields: dict[str, Any] = {}
        if not peer:
            assert failure is not None
            os_error = rundir.os_error_of(failure, partial)
            fields = rundir.describe(os_error) if os_error is not None else {}
        if self._sealed != step:  # past the seal the fence may have recorded it: the loader rolls it forward
            shutil.rmtree(partial, ignore_errors=True)
            if partial.exists():
                self._leftovers.add(partial)
        error = PEER_FAILED if peer else repr(failure)
        if not peer or main:
            self._emit(FAILED, step=step, error=error, **fields)
        return error

    def _abandon(self, job: _Job, reason: str) -> None:
        """Give up a handed-over write before its seal: nothing of it can be committed, so its directory goes (which
        also releases the old rank 0's writer if it waits for this rank's marker)."""
        shutil.rmtree(job.partial, ignore_errors=True)
        if job.partial.exists():
            self._leftovers.add(job.partial)
        self._emit(
            ABANDONED, step=job.step, old_rank=job.rank, committer=job.main, path=str(job.partial), reason=reason
        )

    def _sweep_leftovers(self, step: int) -> None:
        """Try again to remove what failed saves left; never the dir of ``step``, which rank 0 may be making now."""
        for path in list(self._leftovers - {self._store.partial_path(step)}):
            shutil.rmtree(path, ignore_errors=True)
            if not path.exists():
                self._leftovers.discard(path)

    def _settle_at_exit(self) -> None:
        """The process is exiting (an exception in the training loop, say) while the writer asks the fence about a
        sealed checkpoint: let it hear the answer (recorded and renamed, or refused and reported) within
        :data:`EXIT_SETTLE_S` instead of dying mid-commit. A writer still writing files, or waiting for a dead rank,
        is not waited for: it is a daemon thread, and the next start removes its partial directory."""
        writer = self._writer
        if writer is not None and writer.is_alive() and self._sealed is not None:
            writer.join(timeout=min(self._commit_timeout_s, EXIT_SETTLE_S))
        self._queue.wait(EXIT_SETTLE_S)
        self._queue.close()

    def _emit(self, name: str, **fields: Any) -> None:
        if name == SEALED:
            self._sealed = int(fields["step"])
        if self._on_event is not None:
            self._on_event(name, fields)


class _PeerFailedError(Exception):
    """Rank 0's writer found the partial dir removed by a rank whose own write failed."""


class _GroupFailedError(Exception):
    """A collective of a save failed (a peer lost) while hot recovery is armed: the step fails in place."""


class _HandedOverError(Exception):
    """The group re-formed in place before this write was sealed: it is abandoned."""


def _wait(work: Any, group_failed: Callable[[], bool] | None) -> None:
    """Wait for a collective of a save; with ``group_failed``, poll it and give up (a RuntimeError, as a failed
    collective raises) once the group is known to have failed elsewhere."""
    if group_failed is not None:
        while not work.is_completed():
            if group_failed():
                raise RuntimeError(FAILED_ELSEWHERE)
            time.sleep(_AGREEMENT_POLL_S)
    work.wait()


def _collective(call: Callable[[], Any], on_group_failure: Callable[[str], None] | None) -> Any:
    """``call()``, a collective of a save; its failure (a peer lost) is :class:`_GroupFailedError` when hot recovery
    handles it (``on_group_failure`` set)."""
    try:
        return call()
    except RuntimeError as exc:  # torch's DistBackendError and gloo's errors are RuntimeErrors
        if on_group_failure is None:
            raise
        raise _GroupFailedError(str(exc)) from exc


def _attempt(action: Callable[..., Any], *args: Any) -> Exception | None:
    """Run one step of a save; the exception it raised, if any (each rank then agrees on the outcome)."""
    try:
        action(*args)
    except Exception as exc:
        return exc
    return None
