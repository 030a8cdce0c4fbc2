"""A DDP communication hook whose failures never reach the training loop.

:class:`ResilientAllReduce` all-reduces (mean) each gradient bucket on the process group held by a
:class:`GroupHolder`, which re-forming swaps, so the same registered hook serves every group the model ever trains
in. Each bucket's all-reduce gets a bounded wait. When one fails (a peer died: gloo reports a reset connection) or
runs past its deadline, or when :meth:`ResilientAllReduce.abort` is called from outside, the step is marked failed in
the shared :class:`~elasticd.worker.hot.failure.StepHealth` and *every* bucket of the step still in flight is
completed at once with its own gradient (divided by the world size, possibly partly reduced: the step is
discarded): DDP waits for all buckets before the backward pass returns, so
completing only the failed one would leave the step blocked on the next. Buckets that become ready after the failure
complete at once without touching the broken group. The optimizer step is then skipped by the step guard.

The buffers DDP broadcasts from rank 0 before each forward (BatchNorm's statistics, BERT's position ids) go through the
same machinery (:meth:`ResilientAllReduce.sync_buffers`, registered as DDP's buffer hook): a peer lost during that
broadcast fails the step like a bucket's all-reduce, where DDP's own broadcast raised out of the forward pass and the
worker died (the group then restarted cold).

Where the bucket is reduced: gloo in torch 2.13 cannot abort a pending collective (only ``Work.wait(timeout)``
gives control back; ``abort()``, ``shutdown()`` and ``destroy_process_group()`` leave the operation running until
the group's timeout), so an abandoned all-reduce may still write into its tensor later. DDP's bucket itself is
reduced (in place, as DDP's own hook does) when that write can reach nothing a later step reads: every failed step
is followed by a re-formation, which rebuilds DDP's buckets as new tensors (``reform.py``), and a bucket a
collective given up on still holds is never reduced in place again until that collective has ended. DDP skips the
rebuild with ``find_unused_parameters`` (without ``static_graph``); for such a model a copy is reduced instead (one
per bucket, written by the division by the world size, reused while steps succeed and never again once a step
failed), as every model's was before: measured on the 50M job (``bench/step_overhead.py``), the copy's extra pass
over the gradients cost the hot path 3.4 % of a 1.74 s step.

Per step the hook costs one Python call per bucket and one completion callback on gloo's thread: nothing else wakes
(measured by ``bench/step_overhead.py``; the failure notice is asked as each bucket goes in flight and pushed by its
owner through :meth:`ResilientAllReduce.nudge`, the deadline watcher idles on a slow tick).

On a GPU (NCCL; **unverified, no GPU here**) a collective's torch future completes when the collective is *enqueued*
(CUDA events order the result, not the future), so it says nothing about a peer that never arrives: such buckets
are polled (``Work.is_completed``, a CUDA event query) by the deadline watcher every ``poll_interval`` instead, a
completed one is checked for an error (``Work.wait``), and the future DDP gets back is device-aware. The price is
that the end of the backward pass waits on the host for the last bucket's all-reduce (about one poll interval
later than the GPU finishes it), which is also what makes a failed step known before the optimizer step.

This module deliberately has no ``from __future__ import annotations``: DDP compares the hook's ``bucket`` annotation
with ``dist.GradBucket`` itself and refuses a hook whose annotation is the string ``"dist.GradBucket"``.
"""

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel.distributed import _BufferCommHookLocation

from elasticd.worker.hot.backend import keep_forever
from elasticd.worker.hot.errors import UnsupportedSetup
from elasticd.worker.hot.failure import StepHealth, ask_notice
from elasticd.worker.hot.given_up import GIVEN_UP, ended

# A backstop, not the detector: a dead peer makes gloo fail within milliseconds (connection reset), and a vanished
# or hung one is the daemons' call (their verdict reaches the hook through abort()). A bucket's wait includes the
# slowest peer's compute before it reaches the same bucket, which a rank-0-only evaluation can make minutes long, so
# anything short would fail healthy steps.
DEFAULT_BUCKET_TIMEOUT = timedelta(minutes=10)
# While nothing is in flight the deadline watcher wakes this often (a fraction of the bucket timeout) rather than
# being woken by every step: a bucket's deadline is then enforced at most this much late, and a healthy step pays no
# thread wake-up for a backstop that should never fire.
_IDLE_TICKS_PER_TIMEOUT = 8
# How often a polled bucket (a GPU collective, see the module's docstring) is asked whether it completed: the end of
# a backward pass waits up to this long after the GPU finished the last bucket.
DEFAULT_POLL_INTERVAL = timedelta(milliseconds=1)
# A completed work is asked for its error with a wait that returns at once; a positive timeout makes NCCL's wait
# block the host (and raise) instead of only ordering the current stream after it.
_COMPLETED_WAIT = timedelta(seconds=5)
# The in-flight entry of the buffers' broadcast (DDP's buckets are numbered from 0).
BUFFERS = -1


class GroupHolder:
    """The process group gradients are reduced on; None means torch's current default group."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self._group = group

    @property
    def group(self) -> dist.ProcessGroup:
        if self._group is not None:
            return self._group
        default = dist.group.WORLD
        if default is None:
            raise RuntimeError("no process group: initialise one before the first backward pass")
        return default

    def set(self, group: dist.ProcessGroup | None) -> None:
        self._group = group


@dataclass(eq=False, slots=True)
class _InFlight:
    bucket: int  # DDP's bucket index; BUFFERS for the module's buffers
    generation: int
    gradient: torch.Tensor  # DDP's bucket: what the step gets back after a failure (the step is discarded)
    reduced: torch.Tensor  # what the collective writes into: the bucket itself, or a copy of it
    future: torch.futures.Future[torch.Tensor]
    deadline: float  # time.monotonic() seconds
    polled: bool  # settled by the watcher polling its collective (else by the collective's future callback)
    group: Any  # the group the collective is issued on
    settled: bool = False
    work: Any = None  # the collective, once issued: kept while the entry lives, and past its end if it is given up on

    @property
    def what(self) -> str:
        return "broadcast of the module's buffers" if self.bucket == BUFFERS else f"all-reduce of bucket {self.bucket}"


class ResilientAllReduce:
    """The hook's state: in-flight buckets, their deadlines and the thread that enforces them."""

    def __init__(
        self,
        holder: GroupHolder,
        health: StepHealth,
        *,
        timeout: timedelta = DEFAULT_BUCKET_TIMEOUT,
        notice: Callable[[], str | None] | None = None,
        notice_interval: timedelta | None = None,
        poll: bool | None = None,
        poll_interval: timedelta = DEFAULT_POLL_INTERVAL,
    ) -> None:
        """``notice``, when given, says whether the step is already known to have failed elsewhere (a survivor whose
        all-reduce waits on another survivor that already gave up: only the peers of a dead rank see a reset
        connection); a reason fails the step at once. It is asked as each bucket goes in flight and, while buckets
        are in flight, whenever :meth:`nudge` is called (the notice's owner calls it when the answer changes: no
        thread wakes on a healthy step), or with ``notice_interval`` every that often instead (a notice that must be
        fetched, and cannot tell when it changes). ``poll``: settle buckets by polling their collective every
        ``poll_interval`` rather than by its future; None (the default) polls the buckets on a GPU, whose futures
        complete at enqueue (True polls every bucket, for tests on gloo).
        """
        if min(timeout, poll_interval, notice_interval or timeout) <= timedelta(0):
            raise ValueError(f"intervals must be positive, got {timeout}, {notice_interval} and {poll_interval}")
        self.holder = holder
        self.health = health
        self.timeout_s = timeout.total_seconds()
        self.notice = notice
        self.notice_interval_s = None if notice_interval is None else notice_interval.total_seconds()
        self.poll = poll
        self.poll_interval_s = poll_interval.total_seconds()
        self._cond = threading.Condition()
        self._in_flight: list[_InFlight] = []
        self._closed = False
        self._watcher: threading.Thread | None = None
        self._nudged = False
        # Whether DDP's buckets are reduced in place: register() decides (not when DDP never rebuilds them); a hook
        # not registered on a DDP model reduces copies.
        self.in_place = False
        # DDP buckets a collective given up on still holds (their address -> that collective): reduced into a copy
        # until it has ended.
        self._held_buckets: dict[int, Any] = {}
        # The copies the collectives write into when a bucket is not reduced in place, one per bucket index, reused
        # step after step (a fresh 1-25 MB tensor per bucket and step costs page faults on a CPU); dropped when a
        # step fails, since a collective given up on may still write into its copy later.
        self._copies: dict[int, torch.Tensor] = {}

    def register(self, model: Any) -> None:
        """Register on ``model`` (the ``DistributedDataParallel`` that ``accelerator.prepare`` returned)."""
        if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
            raise UnsupportedSetup(
                "this model wrapper", f"expected DistributedDataParallel, got {type(model).__name__} (FSDP, DeepSpeed?)"
            )
        # DDP rebuilds its buckets at a re-formation only if it may (Reducer::should_rebuild_buckets)
        self.in_place = bool(getattr(model, "static_graph", False)) or not model.find_unused_parameters
        try:
            model.register_comm_hook(state=self, hook=resilient_allreduce_hook)
        except RuntimeError as exc:
            if "only be called once" in str(exc):
                raise UnsupportedSetup("a user communication hook", "the model already has one") from None
            raise
        # DDP calls it before each forward, only when it would broadcast the buffers itself (broadcast_buffers, a
        # model with buffers, outside no_sync)
        model._register_buffer_comm_hook(self, resilient_buffer_hook, _BufferCommHookLocation.PRE_FORWARD)

    # -- the hook ------------------------------------------------------------------------------------------------

    def reduce(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        gradient = bucket.buffer()
        on_device = gradient.device.type != "cpu"
        polled = on_device if self.poll is None else self.poll
        # device-aware on a GPU: DDP's stream then waits for the value it gets, whichever thread set it
        future: torch.futures.Future[torch.Tensor] = (
            torch.futures.Future(devices=[gradient.device]) if on_device else torch.futures.Future()
        )
        generation, failed = self.health.state()
        if failed:
            future.set_result(gradient)  # the step is lost already: leave the broken group alone
            return future
        group = self.holder.group
        index = bucket.index()
        if self._reducible_in_place(gradient):
            reduced = gradient.div_(group.size())
        else:
            reduced = torch.div(gradient, group.size(), out=self._copy_for(index, gradient))
        deadline = time.monotonic() + self.timeout_s
        entry = _InFlight(index, generation, gradient, reduced, future, deadline, polled, group)
        self._issue(entry, _all_reduce)
        return future

    def sync_buffers(self, buffers: dict[str, torch.Tensor]) -> None:
        """DDP's buffer hook, before each forward: rank 0's buffers broadcast to every rank, as DDP's own broadcast
        does, on the group held, with the buckets' bounded wait. A failure (a peer lost, the notice, the deadline)
        fails the step instead of raising out of the forward pass (BatchNorm's statistics, BERT's position ids: a
        node lost during the broadcast took the whole group cold); the buffers then keep this rank's values, and the
        step is discarded. One broadcast per dtype and device."""
        layouts: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for tensor in buffers.values():
            layouts.setdefault((tensor.dtype, tensor.device), []).append(tensor)
        for tensors in layouts.values():
            if not self._broadcast(tensors):
                return  # the step failed: leave the broken group alone

    def _broadcast(self, tensors: list[torch.Tensor]) -> bool:
        """Broadcast ``tensors`` (one dtype, one device) from rank 0, through a new flat tensor (a broadcast given up
        on may still write into it later: it is no tensor of the model); False when the step failed."""
        generation, failed = self.health.state()
        if failed:
            return False
        flat = torch.cat([t.detach().reshape(-1) for t in tensors])
        on_device = flat.device.type != "cpu"
        future: torch.futures.Future[torch.Tensor] = (
            torch.futures.Future(devices=[flat.device]) if on_device else torch.futures.Future()
        )
        polled = on_device if self.poll is None else self.poll
        deadline = time.monotonic() + self.timeout_s
        self._issue(_InFlight(BUFFERS, generation, flat, flat, future, deadline, polled, self.holder.group), _broadcast)
        future.wait()
        if self.health.state()[1]:
            return False  # what the broadcast wrote, if anything, is not used
        offset = 0
        for tensor in tensors:
            tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
            offset += tensor.numel()
        return True

    def _issue(self, entry: _InFlight, collective: Callable[[Any, torch.Tensor], Any]) -> None:
        """Put ``entry`` in flight and issue its collective (``group.allreduce``, ``group.broadcast``): its future is
        settled when the collective ends, or at once with the step failed (notice, abort, deadline, an error)."""
        generation, polled = entry.generation, entry.polled
        with self._cond:
            if not self._in_flight and self.notice_interval_s is not None:
                self._cond.notify_all()  # start the notice's clock now
            self._in_flight.append(entry)
            self._ensure_watcher()
        if self.notice_interval_s is None:
            # In flight first, then asked: a notice that comes after this answer nudges the watcher, which then
            # sees this bucket in flight.
            noticed = self._ask_notice()
            if noticed is not None:
                self._fail(generation, f"failure notice: {noticed}", None)
                return
        try:
            # What dist.all_reduce calls underneath, without its registry lookup: the group held need not be
            # registered (re-forming takes the old default group out of torch's registry).
            work = collective(entry.group, entry.reduced)
            with self._cond:
                # Kept while the entry lives, and past it when the step fails: _fail keeps the works it sees, and a
                # failure that came while the collective was being issued (a nudge, another bucket) is seen here.
                entry.work = work
                given_up = entry.settled
                if polled and not given_up:
                    self._cond.notify_all()  # the watcher starts polling it now
            if given_up:
                self._give_up(entry)
            elif not polled:
                work.get_future().add_done_callback(lambda done: self._on_done(entry, done))
        except Exception as exc:  # a group that is already broken may refuse the call itself
            self._fail(entry.generation, f"{entry.what} refused: {exc}", entry.bucket)

    def nudge(self) -> None:
        """The notice may have changed: ask it now if a bucket is in flight. Thread-safe, cheap."""
        with self._cond:
            if self._in_flight:  # else nothing to release: the next bucket asks the notice itself
                self._nudged = True
                self._cond.notify_all()

    def abort(self, reason: str, *, generation: int | None = None) -> None:
        """Fail the step of ``generation`` (default: the current one): in-flight buckets complete unreduced, later
        ones skip the collective. Thread-safe; for an out-of-band verdict (a peer declared dead or hung). A verdict
        about a generation whose failure was already consumed changes nothing."""
        self._fail(self.health.generation if generation is None else generation, reason, None)

    def close(self) -> None:
        """Stop the deadline watcher (in-flight buckets are left as they are)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._watcher is not None:
            self._watcher.join(timeout=5.0)

    # -- completion ----------------------------------------------------------------------------------------------

    def _on_done(self, entry: _InFlight, done: torch.futures.Future[Any]) -> None:
        # Runs on gloo's thread when the collective ends, however late: keep it short, decide under the lock.
        try:
            done.value()
        except Exception as exc:
            self._fail(entry.generation, f"{entry.what} failed: {exc}", entry.bucket)
            return
        with self._cond:
            if entry.settled:
                return  # given up on already (deadline or another bucket's failure): its result is not used
            entry.settled = True
            self._in_flight.remove(entry)
        entry.future.set_result(entry.reduced)

    def _on_polled(self, entry: _InFlight) -> None:
        # The watcher saw the collective complete: it succeeded unless waiting for it raises (NCCL's error, or the
        # watchdog's abort after a timeout, is stored in the work).
        try:
            entry.work.wait(_COMPLETED_WAIT)
        except Exception as exc:
            self._fail(entry.generation, f"{entry.what} failed: {exc}", entry.bucket)
            return
        with self._cond:
            if entry.settled:
                return
            entry.settled = True
            self._in_flight.remove(entry)
        entry.future.set_result(entry.reduced)

    def _fail(self, generation: int, reason: str, bucket: int | None) -> None:
        # Record first: the training thread may leave backward the moment the last future completes, and the step
        # guard must then see the failure.
        self.health.fail(reason, generation=generation, bucket=bucket)
        with self._cond:
            settled = [e for e in self._in_flight if e.generation <= generation]
            for entry in settled:
                entry.settled = True
            self._in_flight = [e for e in self._in_flight if not e.settled]
            given_up = [e for e in settled if e.work is not None]
            if settled:
                self._copies = {}  # a given-up collective may still write into its copy: never reuse one
        for entry in given_up:
            self._give_up(entry)
        for entry in settled:
            entry.future.set_result(entry.gradient)

    def _reducible_in_place(self, gradient: torch.Tensor) -> bool:
        """Whether ``gradient`` (DDP's bucket) may be the collective's tensor: no collective given up on holds it."""
        if not self.in_place:
            return False
        with self._cond:
            if not self._held_buckets:
                return True
            self._held_buckets = {ptr: work for ptr, work in self._held_buckets.items() if not ended(work)}
            return gradient.data_ptr() not in self._held_buckets

    def _give_up(self, entry: _InFlight) -> None:
        """An issued collective given up on may still end (or fail) later in gloo's threads, and call back into
        Python there: its Work is held until it has ended (``given_up.py``; a pending gloo Work's destructor can
        throw its stored IoException: std::terminate, "Fatal Python error: Aborted" while garbage-collecting, seen
        in tests), and a bucket it reduces in place is not reduced in place again meanwhile. One the watcher polls
        (a GPU's: NCCL aborts its communicator) is kept for ever, as before (unverified, no GPU here)."""
        if entry.reduced is entry.gradient and entry.bucket != BUFFERS:
            with self._cond:
                self._held_buckets[entry.gradient.data_ptr()] = entry.work
        if entry.polled:
            keep_forever(entry.work)
        else:
            GIVEN_UP.hold(entry.work, entry.group)

    def _copy_for(self, index: int, gradient: torch.Tensor) -> torch.Tensor:
        # Under the GIL, from DDP's autograd hook: no two reduce() calls of one hook run at once.
        copy = self._copies.get(index)
        layout = (gradient.shape, gradient.dtype, gradient.device)
        if copy is None or (copy.shape, copy.dtype, copy.device) != layout:
            copy = self._copies[index] = torch.empty_like(gradient)
        return copy

    def _ensure_watcher(self) -> None:
        if self._watcher is None:
            self._watcher = threading.Thread(target=self._watch, name="elasticd-hot-deadline", daemon=True)
            self._watcher.start()

    def _watch(self) -> None:
        interval = self.notice_interval_s
        next_notice = 0.0  # polling the notice: a step is asked about only after its buckets waited one interval
        while True:
            with self._cond:
                if self._closed:
                    return
                nudged, self._nudged = self._nudged, False
                if not self._in_flight:
                    # Polling the notice, the first bucket of a step wakes the watcher; otherwise nothing does (a
                    # nudge while nothing is in flight has nothing to release), and a tick finds the deadlines.
                    self._cond.wait(timeout=None if interval is not None else self.timeout_s / _IDLE_TICKS_PER_TIMEOUT)
                    next_notice = time.monotonic() + (interval or 0.0)
                    continue
                now = time.monotonic()
                polled = [e for e in self._in_flight if e.polled and e.work is not None]
                done = [e for e in polled if ended(e.work)]
                late = next((e for e in self._in_flight if e.deadline <= now), None)
                due = nudged if interval is None else now >= next_notice
                ask = late is None and not done and self.notice is not None and due
                if late is None and not done and not ask:
                    wake = min(e.deadline for e in self._in_flight)
                    if self.notice is not None and interval is not None:
                        wake = min(wake, next_notice)
                    if polled:
                        wake = min(wake, now + self.poll_interval_s)
                    self._cond.wait(timeout=wake - now)
                    continue
                generation = late.generation if late is not None else self._in_flight[0].generation
            if done:
                for entry in done:  # outside the lock: settling sets futures, whose callbacks may run DDP code
                    self._on_polled(entry)
                continue  # a deadline that passed meanwhile is seen on the next round
            if late is not None:
                self._fail(generation, f"{late.what} timed out after {self.timeout_s:g}s", late.bucket)
                continue
            next_notice = time.monotonic() + (interval or 0.0)
            noticed = self._ask_notice()  # outside the lock: it may be a network round trip
            if noticed is not None:
                self._fail(generation, f"failure notice: {noticed}", None)

    def _ask_notice(self) -> str | None:
        return ask_notice(self.notice)


def _all_reduce(group: Any, tensor: torch.Tensor) -> Any:
    return group.allreduce([tensor])


def _broadcast(group: Any, tensor: torch.Tensor) -> Any:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    return group.broadcast([tensor], options)


def resilient_allreduce_hook(state: ResilientAllReduce, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's entry point (``register_comm_hook(state, hook)``); the annotations are the ones DDP accepts."""
    return state.reduce(bucket)


def resilient_buffer_hook(state: ResilientAllReduce, buffers: dict[str, torch.Tensor]) -> None:
    """DDP's buffer entry point (``_register_buffer_comm_hook``): nothing for DDP to wait on afterwards."""
    state.sync_buffers(buffers)
