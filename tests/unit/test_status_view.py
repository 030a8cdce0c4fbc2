"""``elasticd status --watch``'s frames, drawn from status dicts into a recorded console (no etcd, no terminal)."""

from __future__ import annotations

import io
from typing import Any

import pytest
from rich.console import Console

from elasticd.status_snapshot import summarize
from elasticd.status_watch import Watch, run_watch, view


def node(node_id: str, **fields: Any) -> dict[str, Any]:
    base = {"node_id": node_id, "state": "running", "round": 0, "workers": 1, "world_size": 2, "age_s": 0.4}
    return base | {"health": "ok", "last_step": 10, "loss": 0.25, "goodput": 0.97, "step_s": 0.061} | fields


def text(renderable: Any) -> str:
    out = io.StringIO()
    Console(file=out, width=200, color_system=None).print(renderable)
    return out.getvalue()


def test_a_frame_shows_every_node_the_step_rate_loss_goodput_and_the_checkpoint_age() -> None:
    watch = Watch()
    first = summarize("r", [node("a", last_step=10), node("b", last_step=10)], {"step": 10, "committed_at": 1000.0})
    watch.observe(first, 1000.0)
    second = summarize("r", [node("a", last_step=30), node("b", last_step=29)], {"step": 30, "committed_at": 1001.0})
    watch.observe(second, 1002.0)
    frame = text(view(second, watch, 1002.0))
    assert "step 30" in frame and "rate 10.00 steps/s" in frame  # 20 steps in 2 s
    assert "loss 0.25" in frame and "goodput 97.0 %" in frame and "checkpoint step 30 (1 s ago)" in frame
    rows = [line for line in frame.splitlines() if line.startswith("│")]
    assert [row.split("│")[1].strip() for row in rows] == ["a", "b"]


def test_recent_changes_show_restarts_re_formations_and_nodes_that_vanished_in_time_order() -> None:
    watch = Watch()
    before = summarize("r", [node("a"), node("b"), node("c")], None)
    watch.observe(before, 1000.0)
    reformed = {"at": 1001.0, "kind": "reformed", "reason": "failure", "lost_nodes": ["c"], "seconds": 0.14}
    restart = {"at": 990.0, "kind": "restart", "reason": "hang"}
    after = summarize("r", [node("a", recent=[restart, reformed]), node("b", recent=[reformed])], None)
    watch.observe(after, 1003.0)
    frame = text(view(after, watch, 1003.0))
    lines = frame.splitlines()
    recent = lines[lines.index("recent changes") + 1 : -1]
    assert [line.split("  ", 2)[1:] for line in recent] == [
        ["a", "restarted its workers (hang)"],
        ["a", "re-formed in place (failure): lost c in 0.14 s"],
        ["b", "re-formed in place (failure): lost c in 0.14 s"],
        ["c", "gone (its record expired)"],
    ]


def test_the_watch_redraws_every_second_and_a_keyboard_interrupt_ends_it_with_status_0() -> None:
    out = io.StringIO()
    console = Console(file=out, width=200, force_terminal=True, color_system=None)
    steps = iter([5, 7, 9])
    clock = iter([100.0, 101.0, 102.0])
    slept: list[float] = []

    def collect() -> dict[str, Any]:
        step = next(steps, None)
        if step is None:
            raise KeyboardInterrupt
        return summarize("r", [node("a", last_step=step)], None)

    assert run_watch(collect, console, clock=lambda: next(clock), sleep=slept.append) == 0
    assert sum(slept) == pytest.approx(3.0) and max(slept) <= 0.1  # a second a frame, in slices a Ctrl-C cuts short
    assert "rate 2.00 steps/s" in out.getvalue()


def test_a_node_s_record_keeps_its_newest_changes_for_the_view() -> None:
    from elasticd.agent.registry import RECENT_KEPT, NodeRegistry
    from elasticd.keys import RunKeys

    registry = NodeRegistry(None, RunKeys("r"), "n1")  # type: ignore[arg-type]  # not claimed: nothing is written
    for attempt in range(RECENT_KEPT + 2):
        registry.note("restart", reason=f"failure {attempt}", lost_nodes=None)
    recent = registry.record["recent"]
    assert [e["reason"] for e in recent] == [f"failure {a}" for a in range(2, RECENT_KEPT + 2)]
    assert all(e["kind"] == "restart" and "lost_nodes" not in e and e["at"] > 0 for e in recent)


def test_ctrl_c_stops_the_watch_after_the_frame_it_interrupts_not_inside_it() -> None:
    import os
    import signal

    console = Console(file=io.StringIO(), width=200, color_system=None)
    collected: list[int] = []
    before = signal.getsignal(signal.SIGINT)  # SIG_IGN in a pytest-xdist worker, Python's default elsewhere

    def collect() -> dict[str, Any]:
        collected.append(1)
        if len(collected) == 2:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while a frame is read (an etcd call, in real life)
            completed.append(2)  # a KeyboardInterrupt raised here would never reach this line
        return summarize("r", [node("a")], None)

    completed: list[int] = []
    assert run_watch(collect, console, sleep=lambda _s: None) == 0
    assert len(collected) == 2 and completed == [2]  # the interrupted frame completed, and no other began
    assert signal.getsignal(signal.SIGINT) == before  # the handler is given back
