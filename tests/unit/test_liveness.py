"""Who of a round is still there: the rules on registry records and rendezvous heartbeats, without processes."""

from __future__ import annotations

from elasticd.agent.liveness import RoundView, evicted, lost_members

MEMBERS = ["a", "b", "c"]  # by group rank
RECORDS = [{"node_id": n, "round": 4} for n in MEMBERS]


def view(ages: dict[int, float], *, round_: int = 4, complete: bool = True, mine: int | None = 0) -> RoundView:
    return RoundView(round=round_, complete=complete, heartbeat_age_s=ages, my_rank=mine, interval_s=1.0)


def test_everyone_beating_and_registered_is_alive() -> None:
    assert lost_members(4, MEMBERS, view({0: 0.3, 1: 0.9, 2: 1.4}), RECORDS) == {}


def test_a_stale_heartbeat_is_a_stopped_or_dead_daemon() -> None:
    lost = lost_members(4, MEMBERS, view({0: 0.3, 1: 0.9, 2: 2.6}), RECORDS)
    assert list(lost) == ["c"] and "2.6 s" in lost["c"]


def test_a_member_evicted_from_the_rendezvous_or_without_a_registry_record_is_gone() -> None:
    assert list(lost_members(4, MEMBERS, view({0: 0.3, 1: 0.9}), RECORDS)) == ["c"]
    lost = lost_members(4, MEMBERS, None, RECORDS[:2])
    assert list(lost) == ["c"] and "registry" in lost["c"]


def test_nothing_known_means_nobody_is_declared_lost() -> None:
    assert lost_members(4, MEMBERS, None, None) == {}
    # a rendezvous of another round says nothing about this round's members
    assert lost_members(4, MEMBERS, view({0: 0.1}, round_=5, complete=False), None) == {}


def test_a_node_left_behind_by_the_round_knows_it_was_evicted() -> None:
    # Why 12: node c woke up from SIGSTOP; the others left round 4 and formed round 5 without it
    assert evicted(4, "c", view({0: 0.2, 1: 0.2}, mine=None), None) is not None
    assert "round 5" in (evicted(4, "c", view({}, round_=5, complete=False, mine=None), None) or "")
    records = [{"node_id": "a", "round": 5}, {"node_id": "c", "round": 4}]
    assert "round 5" in (evicted(4, "c", None, records) or "")


def test_a_member_of_the_current_round_is_not_evicted() -> None:
    assert evicted(4, "a", view({0: 0.2, 1: 0.2, 2: 0.3}, mine=0), RECORDS) is None
    assert evicted(4, "a", None, None) is None
