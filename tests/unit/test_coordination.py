"""Checkpoint decisions without processes: by step count, by wall time, on request; the sync interval."""

from __future__ import annotations

import itertools

from elasticd.worker.coordination import TARGET_SYNC_S, Coordinator


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_step_count_checkpoints_need_no_sync_point() -> None:
    c = Coordinator(rank=0, world_size=1, every_steps=10, collective=False)
    decisions = [c.at_step(step, 0.02).checkpoint for step in range(1, 31)]
    assert [i + 1 for i, d in enumerate(decisions) if d] == [10, 20, 30]


def test_time_checkpoints_fire_at_the_first_sync_point_after_the_interval() -> None:
    clock = Clock()
    c = Coordinator(rank=0, world_size=1, every_seconds=5.0, clock=clock, collective=False)
    fired = []
    for step in range(1, 200):
        clock.now += 0.1
        if c.at_step(step, 0.1).checkpoint:
            fired.append(step)
            c.checkpointed()
    assert fired and fired[0] in range(50, 50 + int(TARGET_SYNC_S / 0.1) + 2)
    assert all(b - a >= 50 for a, b in itertools.pairwise(fired))


def test_request_is_honoured_once_at_the_next_sync_point() -> None:
    c = Coordinator(rank=0, world_size=1, collective=False)
    c.requested = True
    outcomes = [c.at_step(step, 0.01) for step in range(1, 60)]
    hits = [o for o in outcomes if o.requested]
    assert len(hits) == 1 and hits[0].checkpoint


def test_sync_interval_targets_a_fixed_wall_time() -> None:
    c = Coordinator(rank=0, world_size=1, collective=False)
    for step in range(1, 100):
        c.at_step(step, 0.02)
    assert c.interval == int(TARGET_SYNC_S / 0.02)


def test_one_short_first_step_does_not_stretch_the_interval() -> None:
    c = Coordinator(rank=0, world_size=1, collective=False)
    c.at_step(1, 0.001)  # the first step is timed from resume(): it can look far shorter than the rest
    assert c.interval <= 2
    for step in range(2, 40):
        c.at_step(step, 0.1)
    assert c.interval == int(TARGET_SYNC_S / 0.1)


def test_a_wanted_change_is_agreed_at_a_sync_point_like_a_request() -> None:
    c = Coordinator(rank=0, world_size=1, collective=False)
    wanted = [False]
    c.wants_change = lambda: wanted[0]
    assert not any(c.at_step(step, 0.01).admit for step in range(1, 30))
    wanted[0] = True
    hits = [step for step in range(30, 120) if c.at_step(step, 0.01).admit]
    # at the next sync point (one interval of TARGET_SYNC_S away at most), and only at sync points: not every step
    assert hits and hits[0] <= 30 + int(TARGET_SYNC_S / 0.01)
    assert len(hits) < 90 / 4
