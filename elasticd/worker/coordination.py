"""Agreement between ranks on when to checkpoint, at sync points that cost one tiny collective.

Four things need every rank to act at the same step: a checkpoint the daemon asks for (``SIGUSR2`` to the worker:
a node is joining cold, the run is draining), a checkpoint that is due by wall time, a new sync interval, and (hot
recovery) admitting the warm workers of a joining node, which any rank may have seen bid. Rather than
an all-reduce every step (1-1.5 ms on gloo here, 5-7% of a 20 ms step), ranks meet every ``interval`` steps, where
rank 0 sizes the interval from its step time so that sync points come about every :data:`TARGET_SYNC_S` seconds.
Each sync point starts an asynchronous all-reduce and acts on the one started at the previous sync point, which has
long finished: no rank waits, and every rank acts on the same values at the same step. A request therefore takes
effect within about two intervals. Step-count checkpoints need no agreement at all.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from elasticd.board import Phase, SlotWriter
from elasticd.worker.hot.given_up import GIVEN_UP

# Seconds of training between sync points; the all-reduce overlaps training, its launch costs a few µs.
TARGET_SYNC_S = 0.25
# Steps at least this long (rank 0's average, agreed like the interval) make a sync point wait for its own all-reduce
# and act on it at once: ~1-1.5 ms on gloo, under 0.3 % of such a step, and a join, a leave or a checkpoint request
# takes effect a step sooner. At one step per sync point, acting on the previous sync point's values costs a whole
# step: 2.5-4 s of a joiner's wait on the 1.2 GB benchmark job (bench/join_contention.py).
BLOCKING_STEP_S = 0.5
MAX_INTERVAL_STEPS = 1000
REQUEST_SIGNAL = signal.SIGUSR2
# Seconds a worker waits, after the checkpoint its daemon asked for, to be stopped for the planned change. Past it
# the change was called off (its daemon died, say) and training goes on.
PARK_TIMEOUT_S = 120.0


@dataclass(frozen=True, slots=True)
class SyncOutcome:
    checkpoint: bool = False
    requested: bool = False  # the daemon asked: after the save, park until the daemon stops the group
    admit: bool = False  # joiners wait or a node leaves: every rank moves to a new epoch at this step (hot recovery)


class Coordinator:
    """Tracks requests and due times; :meth:`at_step` returns what every rank must do after ``step``."""

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        every_steps: int = 0,
        every_seconds: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
        collective: bool | None = None,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.every_steps = every_steps
        self.every_seconds = every_seconds
        self._clock = clock
        self._collective = (world_size > 1 and dist.is_initialized()) if collective is None else collective
        self.requested = False
        self.interval = 1
        self._next_sync = 0
        self._last_checkpoint = clock()
        self._step_time_s = 0.0
        self._blocking = False  # agreed at the last sync point: this one waits for its own all-reduce
        # the all-reduce started at the last sync point, its flags and the group it runs in
        self._pending: tuple[Any, torch.Tensor, Any] | None = None
        # Hot recovery sets it: a failed agreement is then a failed step (re-formed in place), not an exception.
        self.on_failure: Callable[[str], None] | None = None
        # Hot recovery sets it: does the group want a new epoch (joiners that fit the batch, a node that leaves)?
        self.wants_change: Callable[[], bool] | None = None

    def listen(self) -> None:
        """Let the daemon ask for a checkpoint with ``SIGUSR2`` (main thread only, as Python requires)."""

        def on_request(_signum: int, _frame: FrameType | None) -> None:
            self.requested = True

        signal.signal(REQUEST_SIGNAL, on_request)

    def checkpointed(self) -> None:
        self._last_checkpoint = self._clock()

    def at_step(self, step: int, step_time_s: float) -> SyncOutcome:
        """Called by every rank after every optimizer step, with the same ``step``."""
        # exponential average: one slow step (a checkpoint, a restart) does not resize the interval by itself
        self._step_time_s = step_time_s if not self._step_time_s else 0.8 * self._step_time_s + 0.2 * step_time_s
        by_count = bool(self.every_steps) and step % self.every_steps == 0
        if step < self._next_sync:
            return SyncOutcome(checkpoint=by_count)
        join = self.wants_change is not None and self.wants_change()
        time_due = bool(self.every_seconds) and self._clock() - self._last_checkpoint >= self.every_seconds
        if time_due:
            self._last_checkpoint = self._clock()  # scheduled: not due again while the agreement travels
        # the request is consumed by this sync point's all-reduce, which carries it to every rank
        sent, self.requested = self.requested, False
        requested, time_due, interval, admit = self._agree(sent, time_due, self._wanted_interval(), join)
        self.interval = interval
        self._next_sync = step + interval
        return SyncOutcome(checkpoint=by_count or time_due or requested, requested=requested, admit=admit)

    def regroup(self, rank: int, world_size: int, *, planned: bool = False) -> None:
        """The group was re-formed in place: leave the agreement in flight in the old one, agree at the next step.

        ``planned``: every old member was at this step boundary (a join), so that agreement completes; a checkpoint
        request it carried is kept. After a failure it may never complete, and is dropped."""
        if planned and self._pending is not None:
            work, flags, _ = self._pending
            try:
                work.wait()
                self.requested = self.requested or flags[0].item() > 0
            except RuntimeError:
                pass  # a peer died meanwhile: the next step fails and recovers like any failure
        if self._pending is not None and not planned:
            # the old group's agreement may still fail in gloo's threads: its Work is held until it has ended (a
            # pending gloo Work's destructor can throw and abort the process), and the old group with it
            GIVEN_UP.hold(self._pending[0], self._pending[2])
        self.rank, self.world_size = rank, world_size
        self._collective = world_size > 1
        self._pending = None
        self._next_sync = 0
        self._blocking = False  # a joiner's coordinator has agreed nothing yet: every member starts async again

    def _wanted_interval(self) -> int:
        if self._step_time_s <= 0:
            return 1
        wanted = int(TARGET_SYNC_S / self._step_time_s)
        # grow at most 2x per sync point: the first steps' times (cut short, or warming up) must not set a long
        # interval on their own, which would delay every request by that many steps
        return max(1, min(MAX_INTERVAL_STEPS, wanted, 2 * self.interval))

    def _agree(
        self, requested: bool, time_due: bool, interval: int, join: bool = False
    ) -> tuple[bool, bool, int, bool]:
        """Any rank's request or join counts; rank 0's clock, interval and blocking count (so every rank agrees).

        Returns the values agreed at the previous sync point (nothing the first time) and starts the next round;
        with steps of :data:`BLOCKING_STEP_S` or longer, waits for that round too and returns both agreed together.
        """
        if not self._collective:
            return requested, time_due, interval, join
        leader = self.rank == 0
        blocking = leader and self._step_time_s >= BLOCKING_STEP_S
        flags = torch.tensor(
            [float(requested), float(time_due and leader), float(interval if leader else 0), float(join), blocking],
            dtype=torch.float64,
        )
        if dist.get_backend() == "nccl":
            flags = flags.cuda()
        agreed: tuple[bool, bool, int, bool] = (False, False, 1, False)
        if self._pending is not None:
            work, previous, _ = self._pending
            self._pending = None
            if not self._waited(work):
                return agreed
            agreed = self._decoded(previous, agreed)
        work = dist.all_reduce(flags, op=dist.ReduceOp.SUM, async_op=True)
        if not self._blocking:  # mode agreed before this sync point: the same on every rank
            self._pending = (work, flags, dist.group.WORLD)
            return agreed
        if not self._waited(work):
            return agreed
        return self._decoded(flags, agreed)

    def _waited(self, work: Any) -> bool:
        """Wait for one agreement; False (the step failed, with hot recovery) when a peer is gone."""
        try:
            work.wait()
        except RuntimeError as exc:
            if self.on_failure is None:
                raise
            self.on_failure(f"checkpoint agreement failed: {exc}")
            return False
        return True

    def _decoded(self, flags: torch.Tensor, earlier: tuple[bool, bool, int, bool]) -> tuple[bool, bool, int, bool]:
        """The values of one agreement, with what an ``earlier`` one agreed (any request counts), and the mode of the
        next sync point."""
        values = flags.tolist()
        self._blocking = values[4] > 0
        return (
            earlier[0] or values[0] > 0,
            earlier[1] or values[1] > 0,
            max(1, int(values[2])),
            earlier[3] or values[3] > 0,
        )


def park(slot: SlotWriter, log: Any, step: int, timeout_s: float = PARK_TIMEOUT_S) -> None:
    """After a requested checkpoint: wait to be stopped for the planned change (see :data:`PARK_TIMEOUT_S`)."""
    log.info("parked", step=step)
    slot.set_phase(Phase.PARKED)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(0.1)
    log.warning("park_timeout", step=step)
    slot.set_phase(Phase.TRAINING)
