"""The non-finite guard's escalation, step by step, without processes."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from elasticd.worker.guard import SKIP_ONLY_LIMIT, NonFiniteGuard, Verdict


def feed(guard: NonFiniteGuard, outcomes: str, start: int = 1) -> list[Verdict]:
    """'.' a finite step, 'n' a non-finite one; returns the verdicts."""
    verdicts = []
    for i, outcome in enumerate(outcomes, start=start):
        guard.last = Verdict.OK if outcome == "." else Verdict.SKIPPED
        verdicts.append(guard.verdict(i))
    return verdicts


def test_isolated_nonfinite_step_is_only_skipped() -> None:
    assert feed(NonFiniteGuard("rollback"), "..n..")[2] is Verdict.SKIPPED


def test_repeats_roll_back_after_the_configured_skips() -> None:
    verdicts = feed(NonFiniteGuard("rollback", skips_before_rollback=3), "nnn")
    assert verdicts == [Verdict.SKIPPED, Verdict.SKIPPED, Verdict.ROLLBACK]


def test_rollbacks_without_progress_end_in_stop() -> None:
    guard = NonFiniteGuard("rollback", skips_before_rollback=2, max_rollbacks=2)
    assert feed(guard, "nn", start=15)[-1] is Verdict.ROLLBACK
    # replayed steps below the rollback point are not progress
    assert feed(guard, "...nn", start=11)[-1] is Verdict.ROLLBACK
    assert feed(guard, "...nn", start=11)[-1] is Verdict.STOP


def test_a_finite_step_past_the_rollback_point_resets_the_count() -> None:
    guard = NonFiniteGuard("rollback", skips_before_rollback=2, max_rollbacks=1)
    assert feed(guard, "nn", start=15)[-1] is Verdict.ROLLBACK
    assert feed(guard, ".......nn", start=11)[-1] is Verdict.ROLLBACK  # step 17 was finite: progress


def test_stop_policy_stops_at_the_first() -> None:
    assert feed(NonFiniteGuard("stop"), ".n") == [Verdict.OK, Verdict.STOP]


def test_skip_policy_never_rolls_back_but_gives_up_eventually() -> None:
    verdicts = feed(NonFiniteGuard("skip"), "n" * SKIP_ONLY_LIMIT)
    assert set(verdicts[:-1]) == {Verdict.SKIPPED} and verdicts[-1] is Verdict.STOP


def test_overflow_is_neither_skip_nor_progress_reset() -> None:
    guard = NonFiniteGuard("rollback", skips_before_rollback=2)
    guard.last = Verdict.SKIPPED
    guard.verdict(1)
    guard.last = Verdict.OVERFLOW
    assert guard.verdict(2) is Verdict.OVERFLOW
    guard.last = Verdict.SKIPPED
    assert guard.verdict(3) is Verdict.ROLLBACK  # the overflow did not break the run of non-finite steps


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="explode"):
        NonFiniteGuard("explode")


def _scaled_optimizer() -> tuple[torch.nn.Linear, Any]:
    """A real accelerate optimizer wrapper around AdamW with a real (CPU) GradScaler, as fp16 training has."""
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer

    Accelerator(cpu=True)  # accelerate's optimizer wrapper reads its shared state
    model = torch.nn.Linear(2, 1)
    scaler = torch.amp.GradScaler("cpu")
    optimizer = AcceleratedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.1), scaler=scaler)
    return model, optimizer


@pytest.mark.parametrize(("bad", "expected"), [(float("inf"), Verdict.OVERFLOW), (float("nan"), Verdict.SKIPPED)])
def test_fp16_scaler_skips_count_inf_as_overflow_and_nan_as_nonfinite(bad: float, expected: Verdict) -> None:
    model, optimizer = _scaled_optimizer()
    guard = NonFiniteGuard("rollback")
    guard.install(optimizer, model.parameters)
    before = model.weight.detach().clone()
    optimizer.scaler.scale(model(torch.ones(1, 2)).sum()).backward()  # what accelerator.backward does in fp16
    grad = model.weight.grad
    assert grad is not None
    grad[0, 0] = bad
    optimizer.step()
    assert optimizer.step_was_skipped
    assert torch.equal(model.weight.detach(), before)  # the scaler kept the bad step away from the weights
    assert guard.verdict(1) is expected


def test_nonfinite_gradient_never_reaches_the_weights_without_a_scaler() -> None:
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer

    Accelerator(cpu=True)
    model = torch.nn.Linear(2, 1)
    optimizer = AcceleratedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.1))
    guard = NonFiniteGuard("rollback")
    guard.install(optimizer, model.parameters)
    before = model.weight.detach().clone()
    model(torch.full((1, 2), float("nan"))).sum().backward()
    optimizer.step()
    assert torch.equal(model.weight.detach(), before) and optimizer.step_was_skipped
    assert guard.verdict(1) is Verdict.SKIPPED
