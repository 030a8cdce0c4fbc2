"""``elasticd status``: how node states add up to the run's health, spares included, and the epoch it shows."""

from __future__ import annotations

import io
import json
from typing import Any

from rich.console import Console

from elasticd.status import _render
from elasticd.status_snapshot import _health, _run_health, summarize


def nodes(*states: str) -> list[dict[str, Any]]:
    return [{"node_id": str(i), "state": state, "health": _health(state)} for i, state in enumerate(states)]


def test_a_spare_is_healthy_and_idle_and_the_run_stays_ok_while_others_train() -> None:
    assert _health("spare") == "spare"
    assert _run_health(nodes("running", "running", "spare")) == "ok"


def test_a_run_whose_nodes_are_all_spares_is_waiting() -> None:
    assert _run_health(nodes("spare", "spare", "spare")) == "waiting"


def test_a_node_waiting_to_join_in_place_keeps_the_run_ok_and_one_re_forming_is_a_change() -> None:
    assert _run_health(nodes("running", "running", "joining")) == "ok"
    assert _run_health(nodes("running", "reforming")) == "changing"


def test_a_failed_node_still_degrades_a_run_with_spares_and_a_restart_is_a_change() -> None:
    assert _run_health(nodes("running", "spare", "failed")) == "degraded"
    assert _run_health(nodes("restarting", "spare")) == "changing"


def record(node_id: str, **fields: Any) -> dict[str, Any]:
    base = {"node_id": node_id, "host": "h", "pid": 1, "state": "running", "round": 2, "workers": 2}
    return base | {"world_size": 4, "nodes": 2, "last_step": 10, "age_s": 0.5, "health": "ok"} | fields


def rendered(status: dict[str, Any]) -> tuple[str, list[dict[str, str]]]:
    """The summary line and the table's rows (column -> cell) as ``elasticd status`` prints them."""
    out = io.StringIO()
    _render(status, Console(file=out, width=200, color_system=None))
    lines = out.getvalue().splitlines()
    header, *rows = [
        [cell.strip() for cell in line.strip("┃│").split(line[0])] for line in lines[1:] if line[0] in "┃│"
    ]
    return lines[0], [dict(zip(header, row, strict=True)) for row in rows]


def test_status_shows_the_membership_epoch_in_force_per_node_and_for_the_run() -> None:
    # b was left out of epoch 5 (stopped, then resumed): it still shows the epoch it last re-formed into
    status = summarize("r", [record("a", epoch=5), record("b", epoch=4)], {"step": 8})
    assert status["epoch"] == 5 and [n["epoch"] for n in status["nodes"]] == [5, 4]
    assert json.loads(json.dumps(status))["epoch"] == 5  # the --json output carries it
    summary, rows = rendered(status)
    assert "round 2  epoch 5  world size 4  step 10  last checkpoint 8" in summary
    assert list(rows[0])[4:6] == ["round", "epoch"]
    assert [(row["node"], row["epoch"]) for row in rows] == [("a", "5"), ("b", "4")]


def test_a_run_that_never_re_formed_in_place_shows_no_epoch() -> None:
    status = summarize("r", [record("a"), record("b", epoch=None)], None)
    assert status["epoch"] is None
    summary, rows = rendered(status)
    assert "epoch -" in summary
    assert [(row["node"], row["epoch"]) for row in rows] == [("a", "-"), ("b", "-")]
