"""Cutting a doomed backward pass short: once the step is known to have failed, its other gradients are not computed.

A failed step is discarded (``step_guard.py``), yet before this module its backward pass ran to the end: the hook
completes every bucket at once after a failure, but autograd still computes each gradient the step will throw away.
Measured on the 100M-parameter benchmark job (``bench/recovery.py --scenarios node_loss_large``, 3 nodes on this
2-core box): the survivors of a kill -9 learned of it 0.7-1.0 s after the kill, most of it the rest of a backward
pass whose first bucket had already failed. That time is the bulk of what a node loss costs beyond the step it must
redo.

:class:`BackwardCutoff` wraps ``accelerator.backward`` (the call accelerate scripts and Hugging Face's ``Trainer``
make) and gives each parameter a post-accumulate-grad hook. Inside that call only, the hook asks whether the step
failed (here: :class:`~elasticd.worker.hot.failure.StepHealth`; elsewhere: the failure notice, which it then records
through ``abort``) and, if so, raises :class:`BackwardCut`, which unwinds autograd's engine and is caught by the
wrapper: the script's ``accelerator.backward(loss)`` returns as usual, the optimizer step is skipped by the step
guard, and the step boundary re-forms the group. A ``loss.backward()`` the script calls itself is never cut.

What an unwound backward leaves: some parameters' ``.grad`` accumulated, others not (the step is discarded, and the
script's ``zero_grad`` clears them), and DDP's reducer with buckets never marked ready. The reducer starts each
backward afresh (``prepare_for_backward`` resets its bucket counts) and the re-formation that follows every failed
step rebuilds its buckets (``reform.py``); ``tests/integration/test_hot_cutoff.py`` trains two ranks on after a cut
backward under DDP's defaults, ``find_unused_parameters``, ``static_graph`` and ``gradient_as_bucket_view``, and
checks their gradients agree.

A sharded (FSDP2) model sets its sharded gradients itself, so no accumulate-grad hook ever fires: there
:meth:`BackwardCutoff.wrap` wraps ``accelerator.backward`` alone, and FSDP's collectives (``shard_comms.py``) call
:meth:`BackwardCutoff.cut` after each one of a failed step; the wrapper then calls FSDP2's own recovery for a pass
aborted mid-flight (``FSDPModule.reset_iter_state`` on the root: in-flight reductions dropped, every group resharded),
so the step boundary finds the model as after any step. Measured on the ~100M-parameter sharded job: without it a
failed step's forward and backward ran on to its end, about 2 s of the 3.7 s a node loss cost beyond one step.

A healthy step pays one Python call per parameter and a lock read in it (``bench/step_overhead.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from elasticd.worker.hot.failure import StepHealth


class BackwardCut(Exception):
    """Raised inside a backward pass of a failed step; never leaves :meth:`BackwardCutoff.install`'s wrapper."""


class BackwardCutoff:
    """Stops the backward pass of a failed step at the next parameter whose gradient it accumulates."""

    def __init__(
        self,
        health: StepHealth,
        notice: Callable[[], str | None],
        abort: Callable[[str], None],
    ) -> None:
        """``notice()``: why the step failed elsewhere, if it did (the failure watch's verdict); ``abort(reason)``
        records such a failure for this rank's step (the hook's :meth:`abort`, which also releases its buckets)."""
        self._health = health
        self._notice = notice
        self._abort = abort
        # Within the wrapped backward: a plain flag, not a thread-local, since autograd runs a GPU graph's hooks on
        # its own device threads. A training process runs one backward at a time.
        self._inside = False
        self.cuts = 0  # backward passes cut short so far
        # backward passes that ran to their end although their step had failed: a DDP failure in the last bucket
        # leaves nothing to cut; a sharded model's never should (each of its collectives cuts)
        self.uncut = 0

    def install(self, accelerator: Any, model: Any) -> None:
        """Wrap ``accelerator.backward`` and hook every trainable parameter of ``model``."""
        for parameter in model.parameters():
            if parameter.requires_grad:
                parameter.register_post_accumulate_grad_hook(self._check)
        self.wrap(accelerator)

    def wrap(self, accelerator: Any, after_cut: Callable[[], None] = lambda: None) -> None:
        """Wrap ``accelerator.backward`` only (a sharded model's collectives call :meth:`cut`); ``after_cut()``
        runs once a pass was unwound (FSDP2: ``reset_iter_state`` on the root)."""
        original = accelerator.backward

        def backward(loss: Any, **kwargs: Any) -> Any:
            self._inside = True
            try:
                result = original(loss, **kwargs)
                if self._health.failed:
                    self.uncut += 1
                return result
            except BackwardCut:
                self.cuts += 1
                after_cut()
                return None
            finally:
                self._inside = False

        accelerator.backward = backward

    def cut(self) -> None:
        """Within the wrapped backward of a step that failed: unwind the pass (raises :class:`BackwardCut`)."""
        if self._inside and self._health.failed:
            raise BackwardCut("the step failed: its remaining gradients are not computed")

    def _check(self, _parameter: Any) -> None:
        if not self._inside:
            return
        if not self._health.failed:
            reason = self._notice()
            if reason is None:
                return
            self._abort(f"failure notice: {reason}")
        raise BackwardCut("the step failed: its remaining gradients are not computed")
