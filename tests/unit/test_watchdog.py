"""The hang watchdog's rules on hand-written board slots and a fake clock: allowances per phase, auto timeout."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from elasticd.agent.watchdog import AUTO_FLOOR_S, EXIT_ALLOWANCE_S, AutoTimeout, Watchdog
from elasticd.board import Phase, Slot
from tests.helpers import records

TRAINING = Slot(
    pid=1,
    phase=Phase.TRAINING,
    entered_step=10,
    completed_step=10,
    progress_t=100.0,
    step_done_t=100.0,
    step_s=0.1,
    own_s=0.02,
    dump_request=0,
    dump_done=0,
)


def watchdog(timeout_s: float | None = 2.0, startup_s: float = 60.0) -> Watchdog:
    w = Watchdog(lambda _rank: None, timeout_s=timeout_s, startup_s=startup_s)
    w.reset((0, 1), started_at=0.0)
    return w


def test_training_rank_silent_beyond_the_timeout_is_a_hang_naming_it() -> None:
    w = watchdog()
    busy = replace(TRAINING, entered_step=11)
    assert w.check(101.9, {0: TRAINING, 1: busy}) is None
    s = w.check(102.5, {0: replace(TRAINING, progress_t=102.4, completed_step=11), 1: busy})
    assert s is not None and s.local_ranks == (1,) and s.step == 11
    assert s.silent_s == pytest.approx(2.5) and s.allowance_s == 2.0


@pytest.mark.parametrize("phase", [Phase.STARTING, Phase.LOADING, Phase.CHECKPOINT, Phase.DONE])
def test_startup_checkpoint_and_final_phases_get_the_startup_allowance(phase: Phase) -> None:
    w = watchdog(timeout_s=2.0, startup_s=60.0)
    slot = replace(TRAINING, phase=phase)
    assert w.check(150.0, {0: slot}) is None
    assert w.check(161.0, {0: slot}) is not None


def test_parked_worker_is_never_a_hang() -> None:
    assert watchdog().check(10_000.0, {0: replace(TRAINING, phase=Phase.PARKED)}) is None


def test_first_step_of_a_process_gets_the_startup_allowance() -> None:
    first = replace(TRAINING, step_done_t=0.0)
    w = watchdog(timeout_s=2.0, startup_s=60.0)
    assert w.check(150.0, {0: first}) is None
    assert w.check(161.0, {0: first}) is not None


def test_worker_without_a_slot_is_not_watched() -> None:
    # a script that does not use the worker library never reports progress: silence means nothing
    w = watchdog(startup_s=60.0)
    assert w.check(10_000.0, {0: None}) is None
    assert w.check(10_000.0, {0: None, 1: TRAINING}) is not None  # the attached rank still is


def test_auto_timeout_learns_from_steps_after_warmup() -> None:
    auto = AutoTimeout(factor=5.0, floor_s=0.5, warmup=5)
    assert auto.value is None
    for _ in range(4):
        auto.observe(0.1)
    assert auto.value is None
    auto.observe(0.1)
    assert auto.value == pytest.approx(0.5)  # 5 x 0.1 s
    for _ in range(20):
        auto.observe(0.3)
    assert auto.value == pytest.approx(1.5)  # the p99 follows the slower steps


def test_a_rare_slow_step_keeps_the_timeout_above_it_after_leaving_the_window() -> None:
    auto = AutoTimeout(factor=5.0, floor_s=0.5, warmup=5, window=100)
    auto.observe(1.6)  # a slow step every few hundred (a sync, a log flush)
    for _ in range(300):
        auto.observe(0.1)
    assert auto.p99 == pytest.approx(0.1)
    assert auto.value == pytest.approx(3.2)  # 2 x the longest seen, not 5 x p99 = 0.5 s


def test_auto_timeout_has_a_floor_and_a_cap() -> None:
    auto = AutoTimeout(warmup=1, cap_s=10.0)
    auto.observe(0.001)
    assert auto.value == AUTO_FLOOR_S
    auto.observe(100.0)
    assert auto.value == 10.0


def test_auto_watchdog_uses_the_startup_allowance_until_warm_then_the_learned_timeout() -> None:
    w = watchdog(timeout_s=None, startup_s=60.0)
    slot = TRAINING
    now = 100.0
    assert w.check(now + 30, {0: slot}) is None  # not warmed up: 60 s allowance
    for step in range(11, 20):  # the first step seen is not learned (one-off work)
        now += 0.1
        slot = replace(slot, completed_step=step, entered_step=step, progress_t=now, step_done_t=now, step_s=0.1)
        w.check(now, {0: slot})
    assert w.timeout_s == pytest.approx(0.5)
    assert w.check(now + 0.4, {0: slot}) is None
    assert w.check(now + 0.6, {0: slot}) is not None


def test_checkpoint_time_is_not_learned_as_a_step() -> None:
    # the worker reports step times with saves excluded; a long CHECKPOINT phase is judged by its own allowance
    w = watchdog(timeout_s=None, startup_s=60.0)
    now, slot = 100.0, TRAINING
    for step in range(11, 20):
        now += 0.1
        slot = replace(slot, completed_step=step, progress_t=now, step_done_t=now, step_s=0.1)
        w.check(now, {0: slot})
    saving = replace(slot, phase=Phase.CHECKPOINT, progress_t=now)
    assert w.check(now + 30.0, {0: saving}) is None
    assert w.timeout_s == pytest.approx(0.5)


def test_work_the_script_marks_busy_gets_the_startup_allowance() -> None:
    w = watchdog(timeout_s=2.0, startup_s=60.0)
    evaluating = replace(TRAINING, phase=Phase.BUSY)
    assert w.check(150.0, {0: evaluating}) is None
    assert w.check(161.0, {0: evaluating}) is not None


def test_run_busy_marks_the_slot_and_restores_training(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from elasticd.board import SlotWriter, read_slot
    from elasticd.layout import slot_path
    from elasticd.worker.run import Run

    path = slot_path(tmp_path, 0)
    run = SimpleNamespace(slot=SlotWriter(path))
    run.slot.resumed(3)
    with Run.busy(run):  # type: ignore[arg-type]  # a namespace with the one attribute busy() uses, not a Run
        slot = read_slot(path)
        assert slot is not None and slot.phase is Phase.BUSY
    slot = read_slot(path)
    assert slot is not None and slot.phase is Phase.TRAINING


def test_exited_worker_is_a_failure_for_torch_never_a_hang() -> None:
    # Issue 10, Why 13: a worker whose all-reduce failed exits; until the agent reaps it, its slot still says
    # "training" and its silence grows. A zombie (or a pid that is gone) is never suspected.
    exited = {7}
    w = Watchdog(lambda _rank: None, timeout_s=2.0, startup_s=60.0, exited=lambda pid: pid in exited)
    w.reset((0, 1), started_at=0.0)
    dead, alive = replace(TRAINING, pid=7), replace(TRAINING, pid=8)
    assert w.check(105.0, {0: dead}) is None
    s = w.check(105.0, {0: dead, 1: alive})  # a live silent rank next to it still is
    assert s is not None and s.local_ranks == (1,)


def test_only_silent_ranks_are_asked_whether_they_exited() -> None:
    asked: list[int] = []
    w = Watchdog(lambda _rank: None, timeout_s=2.0, startup_s=60.0, exited=records(asked, result=False))
    w.reset((0,), started_at=0.0)
    assert w.check(101.0, {0: TRAINING}) is None
    assert asked == []  # one read of /proc per silent rank, not per rank and tick


def test_exiting_worker_gets_the_exit_allowance_not_the_hang_timeout() -> None:
    # an exception escaped the script (the worker library's excepthook marks the slot): teardown takes seconds
    w = watchdog(timeout_s=0.5, startup_s=600.0)
    exiting = replace(TRAINING, phase=Phase.EXITING)
    assert w.check(100.0 + EXIT_ALLOWANCE_S - 1, {0: exiting}) is None
    assert w.check(100.0 + EXIT_ALLOWANCE_S + 1, {0: exiting}) is not None  # stuck in its exit: watched again


def test_uncaught_exception_marks_the_slot_exiting_and_chains_to_the_previous_hook(tmp_path: Path) -> None:
    import sys

    from elasticd.board import SlotWriter, read_slot
    from elasticd.layout import slot_path
    from elasticd.worker.diagnostics import WorkerDiagnostics

    seen: list[type[BaseException]] = []
    previous = sys.excepthook
    sys.excepthook = lambda kind, value, tb: seen.append(kind)
    try:
        slot = SlotWriter(slot_path(tmp_path, 0))
        slot.resumed(3)
        diagnostics = WorkerDiagnostics(tmp_path, 0, slot)
        error = RuntimeError("Connection reset by peer")
        sys.excepthook(RuntimeError, error, None)
        read = read_slot(slot_path(tmp_path, 0))
        assert read is not None and read.phase is Phase.EXITING
        assert seen == [RuntimeError]  # the traceback is still printed by whoever printed it before
        diagnostics.close()
        assert sys.excepthook is not diagnostics._on_uncaught
        sys.excepthook(ValueError, ValueError(), None)
        assert seen == [RuntimeError, ValueError]
        slot.close()
    finally:
        sys.excepthook = previous


def test_a_worker_waiting_to_join_in_place_is_never_a_hang() -> None:
    assert watchdog().check(10_000.0, {0: replace(TRAINING, phase=Phase.JOINING)}) is None


def test_workers_excused_while_a_hung_peer_elsewhere_is_killed_are_watched_again_after() -> None:
    w = watchdog(timeout_s=2.0)
    w.excuse(until=110.0)
    assert w.check(105.0, {0: TRAINING}) is None  # silent 5 s, excused: the culprit's node acts
    assert w.check(110.5, {0: TRAINING}) is not None
