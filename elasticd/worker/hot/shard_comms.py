"""FSDP2's collectives, whose failures never reach the training loop: the sharded counterpart of ``comm_hook.py``.

A sharded model communicates in its forward pass too (each unit's parameters are all-gathered before it runs) and
reduce-scatters its gradients in backward, on FSDP's own calls, so a dead peer would raise from the script's
``model(batch)`` or ``accelerator.backward(loss)``. :class:`ResilientShardComms` is given to every FSDP module
through FSDP2's public hooks (``set_custom_all_gather``, ``set_custom_reduce_scatter``) and issues the same
collectives FSDP's defaults issue (``dist.all_gather_single``, ``dist.reduce_scatter_single``), then waits for each
itself: when one fails (gloo: a reset connection), when the failure notice says the step failed elsewhere, or when
:meth:`abort` is called, the step is marked failed in the shared :class:`~elasticd.worker.hot.failure.StepHealth`
and the call returns as if it had completed. The rest of the step runs on whatever the buffers hold, without
touching the group (every later collective of a failed step returns at once), the step guard skips the optimizer
step, and the step boundary re-forms the group and moves the model onto it (``shard_heal.py``).

What a collective given up on leaves: gloo in torch 2.13 cannot abort it, so it may still end later; its Work is
held until then (``given_up.py``), which keeps its tensors alive, so a late write lands in a buffer nothing reads.
The FSDP modules get new buffers and new parameter groups when the group re-forms (``remesh.py``).

A healthy collective costs a future callback and an event wait here (``bench/step_overhead.py``).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from elasticd.worker.hot.errors import UnsupportedSetup
from elasticd.worker.hot.failure import StepHealth, ask_notice
from elasticd.worker.hot.given_up import GIVEN_UP

# A backstop, as the DDP hook's (comm_hook.py): a dead peer fails gloo within milliseconds, a vanished or hung one
# is the daemons' verdict (the notice); a forward all-gather waits for the slowest peer's whole previous step.
DEFAULT_COLLECTIVE_TIMEOUT = timedelta(minutes=10)
# How often a waiting collective looks at the failure notice: the most a failure elsewhere is noticed late here.
_NOTICE_POLL_S = 0.05


class ResilientShardComms:
    """Every FSDP module's all-gather and reduce-scatter (see the module's docstring)."""

    def __init__(
        self,
        health: StepHealth,
        *,
        notice: Callable[[], str | None] | None = None,
        timeout: timedelta = DEFAULT_COLLECTIVE_TIMEOUT,
    ) -> None:
        self.health = health
        self.notice = notice
        self.timeout_s = timeout.total_seconds()
        self._wake = threading.Event()
        self._waiter: _Waiter | None = None
        # after each collective of a failed step: the backward cutoff unwinds a backward pass here (cutoff.py)
        self.after_failed: Callable[[], None] = lambda: None
        self.all_gather = _Comm(self, "all-gather")
        self.reduce_scatter = _Comm(self, "reduce-scatter")

    def register(self, model: Any) -> None:
        """Give every FSDP module of ``model`` these collectives (again after each re-formation: the rebuilt
        parameter groups start with FSDP's defaults)."""
        modules = [m for m in model.modules() if hasattr(m, "set_custom_all_gather")]
        if not modules:
            raise UnsupportedSetup("this model", "no FSDP2 module in it (fully_shard)")
        for module in modules:
            module.set_custom_all_gather(self.all_gather)
            module.set_custom_reduce_scatter(self.reduce_scatter)

    def abort(self, reason: str, *, generation: int | None = None) -> None:
        """Fail the step of ``generation`` (default: the current one): a waiting collective returns now."""
        self.health.fail(reason, generation=generation)
        self._wake.set()

    def nudge(self) -> None:
        """The notice may have changed: a waiting collective asks it now."""
        self._wake.set()

    def close(self) -> None:
        self._wake.set()

    def agree(self, flags: torch.Tensor) -> bool:
        """The non-finite guard's verdict of a sharded step (``worker/guard.py``), all-reduced with MAX and waited
        for as FSDP's collectives are; False when the step failed instead (here or elsewhere)."""
        world = dist.group.WORLD
        self.run("non-finite check", lambda: dist.all_reduce(flags, op=dist.ReduceOp.MAX, async_op=True), world)
        return not self.health.failed

    def run(self, what: str, issue: Callable[[], Any], group: Any) -> None:
        """Issue a collective (``issue()`` returns its Work) and wait for it, or give it up (the step failed)."""
        generation, failed = self.health.state()
        if failed:
            return  # the step is lost already: leave the broken group alone
        noticed = self._ask_notice()
        if noticed is not None:
            self.health.fail(f"failure notice: {noticed}", generation=generation)
            return
        try:
            work = issue()
        except Exception as exc:  # a group already broken may refuse the call itself
            self.health.fail(f"{what} refused: {exc}", generation=generation)
            return
        done = self._ended(work)
        deadline = time.monotonic() + self.timeout_s
        while not done.is_set():
            self._wake.wait(_NOTICE_POLL_S)
            if done.is_set():
                break
            self._wake.clear()
            reason = self._why_give_up(deadline, what)
            if reason is not None:
                self.health.fail(reason, generation=generation)
                GIVEN_UP.hold(work, group)
                return
        try:
            work.wait()
        except Exception as exc:
            self.health.fail(f"{what} failed: {exc}", generation=generation)

    def _ended(self, work: Any) -> threading.Event:
        """An event set when ``work`` ends: its future's callback, or (a gloo reduce-scatter has no future) the
        waiter thread's ``wait()``."""
        done = threading.Event()

        def finish() -> None:
            done.set()
            self._wake.set()  # the waiting loop returns now, not at its next look at the notice

        try:
            work.get_future().add_done_callback(lambda _f: finish())
        except RuntimeError:  # "Work::getFuture not implemented"
            if self._waiter is None or not self._waiter.idle():
                self._waiter = _Waiter()  # the previous one waits on a collective given up on: leave it there
            self._waiter.submit(work, finish)
        return done

    def _why_give_up(self, deadline: float, what: str) -> str | None:
        if self.health.failed:
            return "the step failed elsewhere"
        noticed = self._ask_notice()
        if noticed is not None:
            return f"failure notice: {noticed}"
        if time.monotonic() >= deadline:
            return f"{what} timed out after {self.timeout_s:g}s"
        return None

    def _ask_notice(self) -> str | None:
        return ask_notice(self.notice)


class _Waiter:
    """A thread that waits for collectives one at a time and says when each ended (whether it failed: the caller's
    ``wait()`` after it tells). Collectives of one rank are waited for one after another, so one thread suffices
    until a wait never returns (a collective given up on); then the caller starts another."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[Any, Callable[[], None]]] = queue.SimpleQueue()
        self._busy = threading.Event()
        threading.Thread(target=self._run, name="elasticd-shard-comm-wait", daemon=True).start()

    def idle(self) -> bool:
        return not self._busy.is_set()

    def submit(self, work: Any, ended: Callable[[], None]) -> None:
        self._busy.set()
        self._queue.put((work, ended))

    def _run(self) -> None:
        while True:
            work, ended = self._queue.get()
            with contextlib.suppress(Exception):  # the caller's own wait() raises it
                work.wait()
            self._busy.clear()
            ended()


class _Comm:
    """One of FSDP2's communication hooks (its ``AllGather``/``ReduceScatter`` interface, duck-typed): FSDP allocates
    through :meth:`allocate` and calls the object; the collective has ended (or was given up) when it returns, so it
    returns no Work."""

    def __init__(self, comms: ResilientShardComms, what: str) -> None:
        self.comms = comms
        self.what = what

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, *args: Any, **kwargs: Any
    ) -> None:
        if self.what == "all-gather":

            def issue() -> Any:
                return dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=True)

        else:
            op = kwargs.get("op", args[0] if args else dist.ReduceOp.SUM)

            def issue() -> Any:
                return dist.reduce_scatter_single(
                    output=output_tensor, input=input_tensor, group=group, op=op, async_op=True
                )

        self.comms.run(self.what, issue, group)
        if self.comms.health.failed:
            self.comms.after_failed()  # may raise: the rest of a failed step's backward pass is not computed
