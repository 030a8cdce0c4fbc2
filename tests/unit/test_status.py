"""``elasticd status``: how node states add up to the run's health, spares included."""

from __future__ import annotations

from typing import Any

from elasticd.status import _health, _run_health


def nodes(*states: str) -> list[dict[str, Any]]:
    return [{"node_id": str(i), "state": state, "health": _health(state)} for i, state in enumerate(states)]


def test_a_spare_is_healthy_and_idle_and_the_run_stays_ok_while_others_train() -> None:
    assert _health("spare") == "spare"
    assert _run_health(nodes("running", "running", "spare")) == "ok"


def test_a_run_whose_nodes_are_all_spares_is_waiting() -> None:
    assert _run_health(nodes("spare", "spare", "spare")) == "waiting"


def test_a_failed_node_still_degrades_a_run_with_spares_and_a_restart_is_a_change() -> None:
    assert _run_health(nodes("running", "spare", "failed")) == "degraded"
    assert _run_health(nodes("restarting", "spare")) == "changing"
