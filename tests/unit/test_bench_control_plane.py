"""bench/control_plane.py's figures: medians per N from its trials, the growth fitted on them, issue 28's verdict, and
a design that did not form said so (with what it cost) rather than dropped."""

from __future__ import annotations

import pytest

from bench import control_plane
from bench.tables_control_plane import control_plane_table, fitted_exponent


def test_the_fitted_exponent_is_the_power_n_is_raised_to() -> None:
    assert fitted_exponent([(n, 3.0 * n**2) for n in (8, 64, 256, 1024)]) == pytest.approx(2.0)
    assert fitted_exponent([(n, 5.0) for n in (8, 64)]) == pytest.approx(0.0)
    assert fitted_exponent([(8, 1.0)]) is None


def _trial(nodes: int, index: int, form_s: float | None, steady_bytes: float = 0.0) -> dict:
    trial: dict = {"design": "today", "nodes": nodes, "trial": index, "formed_nodes": nodes if form_s else 3}
    trial["forming"] = {"seconds": 60.0, "requests": 1000.0, "bytes_in": 2e6, "bytes_out": 0.0, "sim_cores": 1.5,
                        "etcd_cores": 0.4}  # fmt: skip
    if form_s is None:
        trial["form_errors"] = ["RendezvousTimeoutError: ..."]
        return trial
    trial.update(form_s=form_s, loss_s=0.5, join_s=0.7, db_size=1e6)
    spent = {"seconds": 10.0, "requests": 100.0, "bytes_in": steady_bytes * 10, "bytes_out": 0.0, "sim_cores": 0.1,
             "etcd_cores": 0.05}  # fmt: skip
    trial.update(steady=spent, loss=spent, join=spent)
    return trial


def test_medians_per_n_and_a_design_that_did_not_form_is_reported_with_its_cost() -> None:
    trials = [_trial(8, i, s, 800.0) for i, s in enumerate((1.0, 3.0, 2.0))] + [_trial(64, 0, None)]
    rows = control_plane.summarize(trials)
    assert [r["nodes"] for r in rows] == [8, 64]
    assert rows[0]["form_s"] == {"median": 2.0, "samples": [1.0, 3.0, 2.0]}
    assert rows[0]["steady"]["bytes_per_node_per_s"] == pytest.approx(100.0)  # 800 B/s over 8 nodes
    assert "not_formed" not in rows[0]
    assert rows[1]["form_s"]["median"] is None
    assert rows[1]["not_formed"]["formed_nodes"] == 3
    table = control_plane_table(
        {"config": {"trials": 3, "form_timeout": 60.0}, "designs": {"today": {"summary": rows}}}
    )
    assert "| today | 8 | **2.00** (1.00, 3.00, 2.00)" in table
    assert "today, N = 64: not formed within 60 s (3 of 64 nodes had a rank)" in table
    assert "issue 28's targets at 1,024 nodes: not measured" in table


def test_both_designs_of_one_run_are_compared_as_ratios_at_every_n_both_reached() -> None:
    today = control_plane.summarize([_trial(8, 0, 2.0, 1600.0), _trial(64, 0, None)])
    lease = control_plane.summarize([_trial(8, 0, 0.5, 400.0), _trial(64, 0, 1.0, 3200.0)])
    table = control_plane_table(
        {
            "config": {"trials": 1, "form_timeout": 60.0},
            "designs": {"today": {"summary": today}, "lease": {"summary": lease}},
        }
    )
    ratios = next(line for line in table.splitlines() if line.startswith("- today over lease"))
    assert "first round formed (N = 8: 4.0x, N = 64: today x, lease 1.00)" in ratios
    assert "steady bytes per node (N = 8: 4.0x, N = 64: today x, lease 50.00)" in ratios
