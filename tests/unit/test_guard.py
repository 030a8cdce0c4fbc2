"""The non-finite guard's escalation, step by step, without processes."""

from __future__ import annotations

import pytest

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
