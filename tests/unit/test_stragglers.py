"""Straggler reports from per-rank own times: sustained, relative to the others, and worth a share of a step."""

from __future__ import annotations

from elasticd.agent.stragglers import StragglerDetector


def feed(d: StragglerDetector, own: dict[int, float], seconds: float, start: float = 0.0, step_s: float = 0.2) -> float:
    t = start
    while t < start + seconds:
        for rank, value in own.items():
            d.observe(rank, value, step_s, t)
        t += 0.25
    return t


def test_slow_rank_is_reported_once_after_the_window_then_recovers() -> None:
    d = StragglerDetector(factor=1.5, window_s=2.0)
    t = feed(d, {0: 0.01, 1: 0.15, 2: 0.01, 3: 0.012}, 1.0)
    assert d.check(t) == []  # slow, but not yet for a whole window
    t = feed(d, {0: 0.01, 1: 0.15, 2: 0.01, 3: 0.012}, 2.5, start=t)
    events = d.check(t)
    assert [(e.kind, e.rank) for e in events] == [("detected", 1)] and events[0].ratio > 10
    assert d.check(t) == []  # reported once
    t = feed(d, {0: 0.01, 1: 0.01, 2: 0.01, 3: 0.012}, 3.0, start=t)
    assert [(e.kind, e.rank) for e in d.check(t)] == [("recovered", 1)]


def test_uniformly_slow_group_has_no_straggler() -> None:
    d = StragglerDetector(factor=1.5, window_s=1.0)
    t = feed(d, {0: 0.15, 1: 0.16}, 1.0)
    d.check(t)
    t = feed(d, {0: 0.15, 1: 0.16}, 3.0, start=t)
    assert d.check(t) == []


def test_a_slow_rank_whose_excess_costs_little_of_a_step_is_not_reported() -> None:
    d = StragglerDetector(factor=1.5, window_s=1.0)
    t = feed(d, {0: 0.002, 1: 0.006}, 1.0, step_s=1.0)  # 3x, but 4 ms of a 1 s step
    d.check(t)
    t = feed(d, {0: 0.002, 1: 0.006}, 3.0, start=t, step_s=1.0)
    assert d.check(t) == []


def test_other_nodes_ranks_count_through_peers() -> None:
    d = StragglerDetector(factor=1.5, window_s=1.0)
    d.peers({2: 0.01, 3: 0.01})
    t = feed(d, {0: 0.2}, 1.0)
    d.check(t)
    t = feed(d, {0: 0.2}, 2.0, start=t)
    assert [(e.kind, e.rank) for e in d.check(t)] == [("detected", 0)]


def test_factor_zero_disables_reports() -> None:
    d = StragglerDetector(factor=0, window_s=1.0)
    t = feed(d, {0: 0.01, 1: 0.5}, 5.0)
    assert not d.enabled and d.check(t) == []
