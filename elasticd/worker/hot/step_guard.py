"""The failed-step guard: a step whose gradients were not reduced never reaches the parameters or the LR schedule.

:class:`FailedStepGuard` wraps the optimizer's ``step`` the way the non-finite guard (``elasticd/worker/guard.py``)
does, and skips it through the same switch: accelerate's ``AcceleratedOptimizer._is_overflow``, which its
``AcceleratedScheduler`` reads (``step_was_skipped``) to skip its own step. The two guards compose in either order on
the same optimizer: installed first (inside the non-finite guard, which clears the flag before calling in) it sets
the flag after; installed second it returns before the non-finite guard runs. Either way a failed step is neither a
parameter update nor a non-finite event.

The script's own code after ``optimizer.step()`` still runs on a failed step; given a :class:`Rollback`
(``registered.py``) the guard keeps the state of the objects registered for checkpointing at the skip and puts it
back in :meth:`FailedStepGuard.take`, so a step counter or an EMA kept the accelerate way does not move either.

Every survivor skips alike: a rank whose all-reduce failed skips its step; a rank whose all-reduce completed (the
peer died after sending its last part) steps, and the heal then copies the state of the member with the most steps
to everyone, so all members continue from one state.
"""

from __future__ import annotations

from typing import Any

from elasticd.worker.hot.errors import UnsupportedSetup
from elasticd.worker.hot.failure import StepFailure, StepHealth
from elasticd.worker.hot.registered import Rollback


class FailedStepGuard:
    """Skips the optimizer step of a failed step; :meth:`take` says, once per step, whether it failed."""

    def __init__(self, health: StepHealth, rollback: Rollback | None = None) -> None:
        self.health = health
        self.rollback = rollback
        self.skipped = 0  # optimizer steps skipped so far, for the caller's metrics

    def install(self, optimizer: Any) -> None:
        """Wrap ``optimizer.step`` (an accelerate ``AcceleratedOptimizer``)."""
        if not hasattr(optimizer, "_is_overflow") or not hasattr(optimizer, "gradient_state"):
            raise UnsupportedSetup(
                "this optimizer", f"expected accelerate's AcceleratedOptimizer, got {type(optimizer).__name__}"
            )
        if getattr(optimizer, "scaler", None) is not None:
            # A skipped scaler step leaves the scaler's per-optimizer state half-way (unscaled, no update), and
            # the next step would fail on it: fp16 loss scaling is not carried through a failed step yet.
            raise UnsupportedSetup("fp16 loss scaling", "use bf16 or fp32 with hot recovery")
        original = optimizer.step

        def step(closure: Any = None) -> Any:
            if not optimizer.gradient_state.sync_gradients:
                return original(closure)  # accumulating: accelerate does not step either
            if self.health.failed:
                optimizer._is_overflow = True  # accelerate's scheduler wrapper then skips its step too
                self.skipped += 1
                if self.rollback is not None:
                    self.rollback.keep()  # before the script's post-step code changes its registered objects
                return None
            # Without a scaler accelerate never clears the flag itself: after a skip the schedule would stop for good.
            optimizer._is_overflow = False
            result = original(closure)
            if optimizer._is_overflow and self.health.failed:  # not stepped: it failed inside (a sharded NaN check)
                self.skipped += 1
                if self.rollback is not None:
                    self.rollback.keep()
            return result

        optimizer.step = step

    def take(self) -> StepFailure | None:
        """At the step boundary, after ``optimizer.step``: the failure of the step that just ended, if any.

        Consuming it lets the hook reduce again; call it once per optimizer step, and re-form the group before the
        next step when it returns a failure. A failed step's registered objects are back as they were before it.
        """
        failure = self.health.consume()
        if failure is not None and self.rollback is not None:
            self.rollback.restore()
        return failure
