"""The demo's figures come from the job's own lines: read as the files grow, measured as bench/recovery.py does."""

from __future__ import annotations

import json
from pathlib import Path

from elasticd.demo.journal import Journal, Step, change_figures


def _steps(spec: list[tuple[float, int, int]]) -> list[Step]:
    return [Step(t=t, step=s, world_size=w, loss=0.1, pid=1) for t, s, w in spec]


def test_a_kill_costs_the_pause_beyond_the_usual_step_and_the_steps_trained_again() -> None:
    # steady 0.1 s steps at world 3, a kill at t=1.05, step 10 trained again at world 2 from t=1.8
    before = [(0.1 * i, i, 3) for i in range(1, 11)]
    after = [(1.8, 10, 2), (1.9, 11, 2), (2.0, 12, 2)]
    steps = _steps(before + after)
    figures = change_figures(steps, at=1.05, first=steps[len(before)])
    assert figures.usual_step_s == 0.1
    assert figures.first_step_s == 0.75
    assert figures.stopped_s == 0.7  # the one interval 1.0 -> 1.8, less 0.1
    assert (figures.redone, figures.resumed_at) == (1, 10)


def test_a_join_counts_every_slow_interval_not_only_the_longest() -> None:
    # three intervals of 0.3 s while the joiner warms up, then the admission: 0.2 + 0.2 + 0.2 + 0.4 lost
    spec = [(0.1 * i, i, 2) for i in range(1, 11)]
    spec += [(1.3, 11, 2), (1.6, 12, 2), (1.9, 13, 2), (2.4, 14, 3)]
    steps = _steps(spec)
    figures = change_figures(steps, at=1.0, first=steps[-1])
    assert figures.stopped_s == 1.0 and figures.redone == 0 and figures.resumed_at == 14


def test_the_journal_reads_complete_lines_as_files_grow_and_skips_what_is_not_json(tmp_path: Path) -> None:
    out, err = tmp_path / "n.out", tmp_path / "n.err"
    journal = Journal()
    journal.follow("n", out, err)
    journal.read()  # nothing written yet: no error
    line = {"event": "step", "step": 1, "world_size": 2, "loss": 0.5, "pid": 7, "t": 10.0}
    out.write_text("torch says hello\n" + json.dumps(line) + "\n" + json.dumps({**line, "step": 2})[:20])
    err.write_text(json.dumps({"event": "reconfigured", "timestamp": "2026-01-01T00:00:00Z"}) + "\n")
    journal.read()
    assert [s.step for s in journal.steps] == [1]  # the half-written second line waits
    assert [e["event"] for _, e in journal.named("reconfigured")] == ["reconfigured"]
    with out.open("a") as f:
        f.write(json.dumps({**line, "step": 2, "t": 11.0})[20:] + "\n")
    journal.read()
    assert [s.step for s in journal.steps] == [1, 2] and journal.first_step_at(2, 10.5) == journal.steps[1]
