"""The hang handler's early exits, without processes or etcd: an exited or exiting worker gives the hang up before
anything is written, and a node left behind by its round reports nothing that could count."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from elasticd.agent.hangs import HangHandler
from elasticd.agent.watchdog import Suspicion, Watchdog
from elasticd.board import Phase, SlotWriter, read_slot
from elasticd.layout import RunLayout, slot_path
from elasticd.metrics import Metrics


class Events:
    def __init__(self) -> None:
        self.seen: list[tuple[str, dict[str, Any]]] = []

    def __getattr__(self, level: str) -> Any:
        return lambda event, **fields: self.seen.append((event, fields))

    def names(self) -> list[str]:
        return [name for name, _ in self.seen]


class Evicted:
    def lost(self, round_: int, members: Sequence[str], *, rendezvous: bool = True) -> dict[str, str]:
        return {}

    def evicted(self, round_: int) -> str | None:
        return "the rendezvous went on to round 5 without this node"


SUSPICION = Suspicion(local_ranks=(0,), silent_s=3.0, allowance_s=0.5, step=31)


def handler(tmp_path: Path, events: Events, *, exited: set[int], liveness: Any = None) -> HangHandler:
    board = tmp_path / "board"
    board.mkdir(exist_ok=True)
    watchdog = Watchdog(lambda r: read_slot(slot_path(board, r)), timeout_s=0.5, startup_s=60.0)
    hangs = HangHandler(
        watchdog=watchdog,
        agreement=None,
        node_id="a",
        board_dir=board,
        run=RunLayout(tmp_path, "run"),
        metrics=Metrics.create(),
        log=lambda: events,
        liveness=liveness,
        exited=lambda pid: pid in exited,
    )
    hangs.watchdog.reset((0,), started_at=0.0)
    return hangs


def handle(hangs: HangHandler, pid: int, suspicion: Suspicion | None = SUSPICION) -> Any:
    return hangs.handle(
        round_=4, members=["a"], pids={0: pid}, ranks={0: 2}, can_dump=set(), started_at=0.0, suspicion=suspicion
    )


def test_a_worker_that_exited_gives_the_hang_up_before_anything_is_written(tmp_path: Path) -> None:
    events = Events()
    assert handle(handler(tmp_path, events, exited={4242}), 4242) is None
    assert events.names() == ["hang_detected", "hang_abandoned"]
    assert events.seen[-1][1]["ranks"] == [2]
    assert not (tmp_path / "run").exists()  # no diagnostics directory for a failure


def test_a_worker_whose_script_raised_is_exiting_and_gives_the_hang_up_too(tmp_path: Path) -> None:
    events = Events()
    hangs = handler(tmp_path, events, exited=set())
    slot = SlotWriter(slot_path(tmp_path / "board", 0), pid=os.getpid())
    slot.set_phase(Phase.EXITING)  # the worker library's excepthook did this: teardown takes seconds
    assert handle(hangs, os.getpid()) is None  # the watchdog fired on it a moment before the exception
    assert events.names() == ["hang_detected", "hang_abandoned"]
    assert not (tmp_path / "run").exists()
    slot.close()


def test_a_node_left_behind_by_its_round_restarts_with_nothing_counted_or_written(tmp_path: Path) -> None:
    events = Events()
    report = handle(handler(tmp_path, events, exited=set(), liveness=Evicted()), os.getpid(), suspicion=None)
    assert report is not None and report.attempt == 0 and report.path == ""
    assert events.names() == ["hang_stale"] and "round 5" in events.seen[0][1]["reason"]
    assert not (tmp_path / "run").exists()


def test_a_worker_stuck_in_its_exit_beyond_the_exit_allowance_is_a_hang_after_all(tmp_path: Path) -> None:
    events = Events()
    hangs = handler(tmp_path, events, exited=set())
    hangs.watchdog.startup_s = 0.01  # the exit allowance is capped by it: overdue at once
    slot = SlotWriter(slot_path(tmp_path / "board", 0), pid=os.getpid())
    slot.set_phase(Phase.EXITING)
    time.sleep(0.05)
    suspicion = hangs.check()
    assert suspicion is not None
    report = handle(hangs, os.getpid(), suspicion)
    assert report is not None and "hang_abandoned" not in events.names()
    assert "hang_diagnosed" in events.names() and report.path
    slot.close()


def test_a_worker_on_its_way_out_holds_off_planned_changes_until_its_allowance_is_spent(tmp_path: Path) -> None:
    # the supervisor does not take a peer's join for a membership restart while a local worker is exiting: the
    # failure torch's monitor is about to report is the restart's reason
    hangs = handler(tmp_path, Events(), exited=set())
    assert not hangs.exiting()
    slot = SlotWriter(slot_path(tmp_path / "board", 0), pid=os.getpid())
    slot.resumed(3)
    assert not hangs.exiting()
    slot.set_phase(Phase.EXITING)
    assert hangs.exiting()
    hangs.watchdog.startup_s = 0.01  # the exit allowance is capped by it
    time.sleep(0.05)
    assert not hangs.exiting()  # stuck in its exit: watched as a hang again, not waited for
    slot.close()
