"""The backward cutoff's count of failed steps' backward passes that ran to their end (``step_failed``'s
``backward_uncut``): what the sharded in-place test holds at zero."""

from __future__ import annotations

from elasticd.worker.hot.cutoff import BackwardCutoff
from elasticd.worker.hot.failure import StepHealth


class _Accelerator:
    def backward(self, loss: float) -> float:
        return loss


def test_a_backward_that_ends_with_its_step_failed_is_counted_uncut_and_a_healthy_one_is_not() -> None:
    health = StepHealth()
    cutoff = BackwardCutoff(health, notice=lambda: None, abort=lambda _reason: None)
    accelerator = _Accelerator()
    cutoff.wrap(accelerator)  # no collective calls cut(): nothing stops the pass
    accelerator.backward(1.0)
    assert (cutoff.cuts, cutoff.uncut) == (0, 0)
    health.fail("a peer died")
    accelerator.backward(1.0)
    assert (cutoff.cuts, cutoff.uncut) == (0, 1)
