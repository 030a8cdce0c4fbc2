"""The rules that end a forming round's waits (``RoundWatch``) and the daemon's die-after-rendezvous fault, without
etcd (the fault killing a process for real: tests/integration/test_rendezvous_fault.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from elasticd import envvars
from elasticd.rendezvous import faults
from elasticd.rendezvous.liveness import RoundAbandonedError, RoundView, RoundWatch, phase_of

MEMBERS = {"a_1_0": 0, "b_2_0": 1, "c_3_0": 2}


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _watch(views: list[RoundView | None], clock: Clock) -> tuple[RoundWatch, list[int]]:
    reads: list[int] = []

    def read() -> RoundView | None:
        reads.append(1)
        return views[-1]

    return RoundWatch(7, MEMBERS, read, interval_s=1.0, clock=clock), reads


def test_an_intact_round_passes_and_the_state_is_read_at_most_once_per_interval() -> None:
    clock = Clock()
    watch, reads = _watch([RoundView(7, frozenset(MEMBERS))], clock)
    watch.check()
    assert reads == []  # the round was just decided: nothing to look at yet
    clock.now += 1.0
    watch.check()
    watch.check()
    assert len(reads) == 1
    assert watch.ranks == MEMBERS


def test_a_member_missing_from_the_state_is_lost_and_abandons_the_round() -> None:
    clock = Clock()
    watch, _ = _watch([RoundView(7, frozenset({"b_2_0", "c_3_0"}))], clock)
    clock.now += 3.5
    with pytest.raises(RoundAbandonedError) as caught:
        watch.check()
    error = caught.value
    assert (error.round, error.reason, error.lost, error.left) == (7, "member_lost", ("a_1_0",), ())
    assert error.waited_s == pytest.approx(3.5)
    assert "round 7" in str(error) and "a_1_0" in str(error)


def test_a_member_that_queued_for_the_next_round_left_rather_than_died() -> None:
    clock = Clock()
    view = RoundView(7, frozenset({"a_1_0", "c_3_0"}), waiting=frozenset({"b_2_0", "new_9_0"}))
    watch, _ = _watch([view], clock)
    clock.now += 1
    with pytest.raises(RoundAbandonedError) as caught:
        watch.check()
    assert (caught.value.reason, caught.value.lost, caught.value.left) == ("member_left", (), ("b_2_0",))
    assert watch.gone(view) == ([], ["b_2_0"])


def test_a_newer_round_supersedes_ours() -> None:
    clock = Clock()
    watch, _ = _watch([RoundView(8, frozenset({"x_1_0"}))], clock)
    clock.now += 1
    with pytest.raises(RoundAbandonedError, match="superseded"):
        watch.check()


def test_an_unreadable_state_or_an_ended_watch_never_abandons() -> None:
    clock = Clock()
    watch, reads = _watch([None], clock)
    clock.now += 1
    watch.check()  # etcd away: the store wait reports a lasting outage itself
    assert reads == [1]
    gone, _ = _watch([RoundView(7, frozenset())], clock)
    gone.end()
    clock.now += 5
    gone.check()
    assert not gone.active


def test_the_phase_is_named_by_the_key_waited_for_and_survives_with_keys() -> None:
    assert phase_of(["torch.rendezvous.r.3/MASTER_ADDR"]) == "store_address"
    assert phase_of(["torch.rendezvous.r.3/torchelastic/assigned_ranks/1"]) == "rank_assignment"
    assert phase_of(["torch.rendezvous.r.3/elasticd/node/0", "x"]) == "node_ids"
    assert phase_of(["something/else"]) == "unknown"
    error = RoundAbandonedError(3, "member_lost", ["a"], waited_s=2.0, left=["b"])
    keyed = error.with_keys(["p/MASTER_PORT"])
    assert (keyed.phase, keyed.lost, keyed.left, keyed.waited_s) == ("store_address", ("a",), ("b",), 2.0)
    clock = Clock()
    watch, _ = _watch([None], clock)
    clock.now += 300
    timed_out = watch.timed_out(["p/elasticd/node/2"])
    assert (timed_out.reason, timed_out.phase, timed_out.waited_s) == ("timeout", "node_ids", 300)


def test_the_fault_spec_names_a_phase_and_optional_conditions(tmp_path: Path) -> None:
    armed = tmp_path / "arm"
    fault = faults.parse(f"published@rank=0,round=4,armed={armed}")
    assert fault == faults.DieAfterRendezvous("published", rank=0, round=4, armed=armed)
    assert not fault.applies("published", 0, 4)  # not armed yet
    armed.touch()
    assert fault.applies("published", 0, 4)
    assert not fault.applies("joined", 0, 4) and not fault.applies("published", 1, 4)
    assert not fault.applies("published", 0, 5)
    assert faults.parse("joined") == faults.DieAfterRendezvous("joined")
    assert faults.DieAfterRendezvous.from_env({}) is None
    assert faults.DieAfterRendezvous.from_env({envvars.FAULT_DIE_AFTER_RDZV: "started"}) == faults.parse("started")
    with pytest.raises(ValueError, match="phase 'soon'"):
        faults.parse("soon")
    with pytest.raises(ValueError, match="unknown key"):
        faults.parse("joined@node=a")


def test_a_fault_that_does_not_apply_does_nothing() -> None:
    faults.maybe_die("joined", rank=1, round_=2, fault=faults.parse("joined@rank=0"))
    faults.maybe_die("joined", rank=0, round_=2, fault=None)  # and the environment has none
