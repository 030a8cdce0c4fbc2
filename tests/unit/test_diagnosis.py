"""Choosing the culprit of a hang from the evidence of every rank, rule by rule."""

from __future__ import annotations

from dataclasses import replace

from elasticd.agent.diagnosis import diagnose
from elasticd.agent.evidence import RankEvidence

WAITING = RankEvidence(
    rank=0,
    local_rank=0,
    node="a",
    pid=100,
    process_state="sleeping",
    phase="training",
    entered_step=25,
    completed_step=24,
    silent_s=2.0,
    in_collective=True,
    where="torch/autograd/graph.py:979 in _engine_run_backward",
    collectives=40,
    pending_collective="gloo:all_reduce",
    stacks="node-a/rank-0.stacks.txt",
    flight_recorder="node-a/rank-0.flight-recorder.json",
)


def rank(r: int, **changes: object) -> RankEvidence:
    return replace(WAITING, rank=r, local_rank=r % 2, node="a" if r < 2 else "b", pid=100 + r, **changes)  # type: ignore[arg-type]


def test_stopped_process_is_the_culprit_whatever_else_it_shows() -> None:
    d = diagnose([rank(0), rank(1), rank(2, process_state="stopped", collectives=None, in_collective=None)])
    assert d.culprits == (2,) and "stopped" in d.reason and d.culprit_nodes == ["b"]


def test_rank_behind_in_collectives_is_the_one_the_others_wait_for() -> None:
    d = diagnose([rank(0), rank(1, collectives=39, pending_collective=""), rank(2)])
    assert d.culprits == (1,) and "39" in d.reason and "40" in d.reason
    assert d.step == 25


def test_without_a_flight_recorder_the_rank_that_did_not_start_the_step_is_named() -> None:
    d = diagnose([rank(0, collectives=None), rank(1, collectives=None, entered_step=24), rank(2, collectives=None)])
    assert d.culprits == (1,) and "step 25" in d.reason


def test_rank_outside_any_collective_while_the_others_wait_inside_one() -> None:
    outside = rank(1, collectives=None, in_collective=False, where="train.py:50 in load_batch")
    d = diagnose([rank(0, collectives=None), outside])
    assert d.culprits == (1,) and "outside" in d.reason
    named = {"rank": 1, "node": "a", "pid": 101, "where": outside.where, "state": "sleeping"}
    assert d.to_json()["culprits"] == [named]


def test_otherwise_the_rank_silent_longest_stopped_first() -> None:
    d = diagnose([rank(0, collectives=None, silent_s=3.0), rank(1, collectives=None, silent_s=5.0)])
    assert d.culprits == (1,) and "first" in d.reason


def test_every_rank_stopped_is_not_one_culprit_among_many() -> None:
    both = [rank(0, process_state="stopped", silent_s=4.0), rank(1, process_state="stopped", silent_s=2.0)]
    d = diagnose(both)
    assert "process" not in d.reason  # all alike: fall through to the next rules
    assert d.culprits == (0,) and d.reason == "stopped making progress first"


def test_evidence_round_trips_through_json() -> None:
    assert RankEvidence.from_json(WAITING.to_json()) == WAITING
