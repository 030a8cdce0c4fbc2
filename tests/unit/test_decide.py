"""Who decides the next epoch and how the others wait (worker/hot/decide.py), over an in-memory membership.

The decision itself (``Membership.try_decide``: one compare-and-set in etcd) is tested against real etcd in
tests/integration/test_membership.py; here ``attempt`` stands for it, and what is checked is who calls it, how often,
and who waits.
"""

from __future__ import annotations

import threading
import time

import pytest

from elasticd.membership import Epoch
from elasticd.worker.hot.decide import DecideTimeout, decide, decider_of

MEMBERS = ("g.0", "g.1", "g.2", "g.3")


def _epoch(number: int, members: tuple[str, ...]) -> Epoch:
    return Epoch(number, members, members[0], 0, f"0.e{number}.x", "failure")


class Ledger:
    """The bids and the decision of one epoch, as ``Membership`` reads them (a change wakes every waiter)."""

    def __init__(self) -> None:
        self.bids: set[str] = set()
        self.decision: Epoch | None = None
        self.version = 0
        self.changed = threading.Condition()

    def bid(self, member: str) -> None:
        with self.changed:
            self.bids.add(member)
            self.version += 1
            self.changed.notify_all()

    def decide(self, decision: Epoch) -> None:
        with self.changed:
            self.decision = decision
            self.version += 1
            self.changed.notify_all()

    # -- what decide() asks of Membership
    def count_bids(self, epoch: int) -> tuple[int, int]:
        with self.changed:
            return len(self.bids), self.version

    def wait_for_bids(self, epoch: int, revision: int, timeout_s: float) -> bool:
        with self.changed:
            return self.changed.wait_for(lambda: self.version > revision, timeout_s)

    def wait(self, epoch: int, timeout_s: float) -> Epoch | None:
        with self.changed:
            self.changed.wait_for(lambda: self.decision is not None, timeout_s)
            return self.decision


def test_the_decider_is_the_first_member_not_dead_in_old_rank_order() -> None:
    dead = {"g.0"}
    assert decider_of(MEMBERS, "g.3", dead.__contains__) == "g.1"
    assert decider_of(MEMBERS, "g.1", dead.__contains__) == "g.1"
    assert decider_of(MEMBERS, "g.0", lambda m: True) == "g.0"  # a member never judges itself dead


def test_a_member_that_is_not_the_decider_waits_for_the_decision_and_never_reads_the_bids() -> None:
    ledger = Ledger()
    tries: list[str] = []
    decided = _epoch(1, MEMBERS)

    def attempt() -> Epoch | None:
        tries.append("g.3")
        return None

    threading.Timer(0.2, ledger.decide, args=(decided,)).start()
    found = decide(ledger, 1, MEMBERS, "g.3", lambda m: False, attempt, 5.0)  # type: ignore[arg-type]
    assert found == decided
    assert tries == []


def test_the_decider_reads_every_bid_a_few_times_not_once_per_bid() -> None:
    many = tuple(f"g.{r}" for r in range(200))
    ledger = Ledger()
    reads: list[int] = []

    def attempt() -> Epoch | None:
        reads.append(len(ledger.bids))
        if len(ledger.bids) == len(many):
            return _epoch(1, many)
        return None

    def bid_all() -> None:
        for member in many:
            ledger.bid(member)
            time.sleep(0.002)  # 200 bids over about half a second

    threading.Thread(target=bid_all, daemon=True).start()
    found = decide(ledger, 1, many, "g.0", lambda m: False, attempt, 10.0)  # type: ignore[arg-type]
    assert found.members == many
    assert len(reads) <= 15, reads  # about one read per 0.1 s while bids come in, and the last one at once


def test_when_the_decider_dies_the_next_member_in_line_decides() -> None:
    ledger = Ledger()
    dead: set[str] = set()
    tries: list[str] = []

    def attempt() -> Epoch | None:
        tries.append("g.1")
        return _epoch(1, MEMBERS[1:])

    threading.Timer(0.3, dead.add, args=("g.0",)).start()  # g.0 dies before it decided
    began = time.monotonic()
    found = decide(ledger, 1, MEMBERS, "g.1", dead.__contains__, attempt, 10.0)  # type: ignore[arg-type]
    assert found.members == MEMBERS[1:]
    assert tries == ["g.1"]
    assert time.monotonic() - began < 5.0  # within a wait slice or two of the death, not the decision timeout


def test_a_decision_that_never_comes_ends_in_decide_timeout() -> None:
    ledger = Ledger()
    with pytest.raises(DecideTimeout, match="epoch 1 was not decided"):
        decide(ledger, 1, MEMBERS, "g.2", lambda m: False, lambda: None, 0.3)  # type: ignore[arg-type]
    with pytest.raises(DecideTimeout):
        decide(ledger, 1, MEMBERS, "g.0", lambda m: False, lambda: None, 0.3)  # type: ignore[arg-type]
