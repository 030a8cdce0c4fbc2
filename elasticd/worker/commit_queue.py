"""Rank 0's commits that etcd could not take when they were sealed: kept, and committed in step order once it can.

A commit is one etcd transaction (the fence, ``worker/fence.py``). While etcd is away or has no quorum (a leader
lost, a partition, an outage of seconds) the transaction gets no answer, and the writer cannot know whether it was
applied. Refusing the checkpoint then (removing its directory) could remove one that etcd did record once the answer
was lost; waiting for etcd in the writer would hold up the next save, and training behind it. Instead the sealed
checkpoint is queued here (``checkpoint_commit_deferred``, once) and a thread of its own asks again with a growing
pause: the oldest first, each one only after the one before it is decided, and every later checkpoint behind them,
so commits land in step order whatever etcd did meanwhile. The lineage takes a record once and never lets an older
step replace a newer latest (``Lineage.commit``), so asking again is always safe.

The queue is bounded (:data:`LIMIT` sealed checkpoints on disk): past it the oldest is given up
(``checkpoint_abandoned``, reason :data:`SUPERSEDED`) and its directory removed: a newer one is queued behind it.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from elasticd.lineage import CheckpointRecord
from elasticd.messages import Kind
from elasticd.worker.checkpoints import CheckpointStore, CommitDeferredError, Fence

# Sealed checkpoints at most waiting for etcd (their directories stay on disk until committed).
LIMIT = 3
# Pause between two attempts while etcd stays away: from the first value, doubling up to the last (s).
RETRY_FIRST_S, RETRY_MAX_S = 0.25, 2.0
DEFERRED = Kind.CHECKPOINT_DEFERRED
# A checkpoint given up before it was committed; its directory is removed (also the saver's: a hand-over).
ABANDONED = "checkpoint_abandoned"
# Why a queued checkpoint was given up (a newer one waits behind it).
SUPERSEDED = "superseded by a newer checkpoint while etcd could not take commits"


@dataclass(frozen=True, slots=True)
class Sealed:
    """A checkpoint whose files and manifest are durable: what :meth:`CheckpointStore.publish` commits."""

    store: CheckpointStore  # the writer's store as it was (its token and directories)
    record: CheckpointRecord
    start: float  # time.monotonic() the save began
    blocking_s: float | None  # what the save blocked training for (None: a blocking save)


class CommitQueue:
    """Commits sealed checkpoints through ``fence`` (none: commits without asking), reporting each with ``emit(name,
    **fields)``: ``checkpoint_committed``, ``checkpoint_fenced``, ``checkpoint_commit_deferred``."""

    def __init__(self, fence: Fence | None, emit: Callable[..., None], limit: int = LIMIT) -> None:
        self._fence = fence
        self._emit = emit
        self._limit = limit
        self._items: deque[Sealed] = deque()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._asking: Sealed | None = None  # the one the drain publishes now (never dropped meanwhile)
        self._stop = threading.Event()

    def commit(self, sealed: Sealed) -> bool | None:
        """Commit ``sealed`` now, unless older checkpoints wait for etcd (then it waits behind them) or etcd cannot
        be asked (then it starts the wait): True committed, False refused, None queued."""
        with self._lock:
            if self._items:
                behind = self._items[-1].record.step
                self._emit(DEFERRED, step=sealed.record.step, error=f"behind step {behind}, which waits for etcd")
                self._enqueue(sealed)
                return None
        try:
            return self._publish(sealed)
        except CommitDeferredError as exc:
            self._emit(DEFERRED, step=sealed.record.step, error=str(exc))
            with self._lock:
                self._enqueue(sealed)
            return None

    def _publish(self, sealed: Sealed) -> bool:
        """Ask the fence about one sealed checkpoint and report: True committed, False refused; CommitDeferredError
        when etcd cannot be asked."""
        step = sealed.record.step
        committed = sealed.store.publish(sealed.record, self._fence)
        if committed is None:
            self._emit(Kind.CHECKPOINT_FENCED, step=step)
            return False
        total_s = time.monotonic() - sealed.start
        self._emit(
            Kind.CHECKPOINT_COMMITTED,
            step=step,
            blocking_s=total_s if sealed.blocking_s is None else sealed.blocking_s,
            total_s=total_s,
            path=str(committed.path),
            asynchronous=sealed.blocking_s is not None,
        )
        return True

    @property
    def pending(self) -> list[int]:
        """The steps waiting for etcd, oldest first."""
        with self._lock:
            return [s.record.step for s in self._items]

    def wait(self, timeout_s: float) -> bool:
        """Until nothing waits (True) or ``timeout_s`` passed (False)."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._items, timeout=timeout_s)

    def close(self) -> None:
        """Stop asking (the worker exits): what still waits stays sealed on disk, never recorded; the next group
        removes it."""
        self._stop.set()

    def _enqueue(self, sealed: Sealed) -> None:
        self._items.append(sealed)
        while len(self._items) > self._limit:
            # the oldest, unless the drain asks etcd about it right now: then the one after it
            victim = 1 if self._items[0] is self._asking else 0
            dropped = self._items[victim]
            del self._items[victim]
            partial = dropped.store.dir / dropped.record.partial
            shutil.rmtree(partial, ignore_errors=True)
            self._emit(
                ABANDONED, step=dropped.record.step, old_rank=0, committer=False, path=str(partial),
                reason=SUPERSEDED,
            )  # fmt: skip
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._drain, name="elasticd-commit-queue", daemon=True)
            self._thread.start()

    def _drain(self) -> None:
        pause = RETRY_FIRST_S
        while not self._stop.is_set():
            with self._lock:
                if not self._items:
                    self._idle.notify_all()
                    return
                oldest = self._asking = self._items[0]
            try:
                self._publish(oldest)
            except CommitDeferredError:
                with self._lock:
                    self._asking = None  # between two attempts it may be given up for a newer one
                self._stop.wait(pause)
                pause = min(pause * 2, RETRY_MAX_S)
                continue
            except Exception as exc:  # a thread has no caller: the failure is an event
                self._emit(Kind.CHECKPOINT_FAILED, step=oldest.record.step, error=repr(exc))
            pause = RETRY_FIRST_S
            with self._lock:
                self._asking = None
                if self._items and self._items[0] is oldest:
                    self._items.popleft()
