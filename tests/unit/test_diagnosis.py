"""Choosing the culprit of a hang from the evidence of every rank, rule by rule."""

from __future__ import annotations

from dataclasses import replace

from elasticd.agent.diagnosis import HANG, NODE_LOST, WORKER_EXITED, diagnose
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
    fields: dict[str, object] = {"local_rank": r % 2, "node": "a" if r < 2 else "b", "pid": 100 + r, **changes}
    return replace(WAITING, rank=r, **fields)  # type: ignore[arg-type]  # fields by name, of several types


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


def test_a_lost_node_is_the_culprit_not_the_nodes_whose_workers_died_of_it() -> None:
    # Why 13: node c was killed; b's worker exited when its all-reduce failed (a zombie by the time of the
    # diagnosis), a's waits. c sent nothing: its daemon is gone. c is named, b is not.
    evidence = [rank(0, node="a"), rank(1, node="b", process_state="zombie", in_collective=None, collectives=None)]
    d = diagnose(evidence, {"c": "its daemon is gone (its registry record expired)"})
    assert d.culprit_nodes == ["c"] and d.culprits == () and d.cause == NODE_LOST
    assert "node c" in d.reason and "registry" in d.reason
    assert not d.counted  # a lost node is not a hang of the training step: never toward --hang-attempts
    assert d.to_json()["culprits"] == [{"rank": None, "node": "c", "pid": None, "where": "", "state": "lost"}]


def test_a_frozen_node_is_named_not_the_ranks_that_waited_for_it() -> None:
    # Why 12: node c was SIGSTOPped (daemon and workers). a and b wait in the all-reduce; without c's evidence the
    # longest-silent rule would have named one of them.
    waiting = [rank(0, node="a", collectives=None), rank(1, node="b", collectives=None, silent_s=2.5)]
    assert diagnose(waiting).culprit_nodes == ["b"]  # the old verdict: a healthy node
    d = diagnose(waiting, {"c": "its daemon is stopped or dead (no rendezvous heartbeat for 2.4 s)"})
    assert d.culprit_nodes == ["c"] and "stopped or dead" in d.reason


def test_a_node_that_reported_is_judged_on_its_evidence_even_if_its_heartbeat_looked_stale() -> None:
    d = diagnose([rank(0), rank(2, collectives=39)], {"b": "its daemon is stopped or dead (no heartbeat for 2.1 s)"})
    assert d.cause == HANG and d.culprits == (2,)


def test_an_exited_worker_among_live_ones_is_a_failure_not_a_counted_hang() -> None:
    d = diagnose([rank(0), rank(1, process_state="zombie"), rank(2)])
    assert d.culprits == (1,) and d.cause == WORKER_EXITED and not d.counted and "exited" in d.reason


def test_a_stopped_worker_is_a_hang_that_counts() -> None:
    d = diagnose([rank(0), rank(1, process_state="stopped"), rank(2, process_state="zombie")])
    assert d.culprits == (1,) and d.counted  # frozen comes before exited: it is what the others wait for
