"""Membership epochs on a real etcd: decided only when every member is accounted for, by one transaction that also
moves the checkpoint fence, so a member left out can neither be in the epoch nor commit."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from elasticd.endpoints import parse_endpoints
from elasticd.etcd.client import EtcdClient
from elasticd.etcd.server import EmbeddedEtcd
from elasticd.keys import RunKeys
from elasticd.lineage import CheckpointRecord, Lineage
from elasticd.membership import BelowMinimum, Bid, Epoch, Membership
from tests.helpers import ETCD_READY_TIMEOUT_S

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

KEYS = RunKeys("members")
A, B, C, D = "node-a", "node-b", "node-c", "node-d"


def _first_epoch(m: Membership) -> Epoch:
    for member in (A, B, C):
        m.bid(1, Bid(member, None, 0))
    decided = m.try_decide(1, (), lambda _: False, min_members=2, round_=1, reason="join")
    assert decided is not None and set(decided.members) == {A, B, C}
    return decided


def _record(step: int, token: str) -> CheckpointRecord:
    return CheckpointRecord(step, f"step-{step}", f"step-{step}.x.partial", "0" * 64, token, committed_at=0.0)


def test_an_epoch_waits_for_every_live_member_then_ranks_by_committed_steps(etcd_client: EtcdClient) -> None:
    m = Membership(etcd_client, KEYS)
    _first_epoch(m)
    dead = {C}
    m.bid(2, Bid(B, 1, 40))
    # A is alive and has not bid: no decision yet, whatever the time
    assert m.try_decide(2, (A, B, C), dead.__contains__, min_members=2, round_=1, reason="failure") is None
    m.bid(2, Bid(A, 0, 38))
    decided = m.try_decide(2, (A, B, C), dead.__contains__, min_members=2, round_=1, reason="failure")
    assert decided is not None
    assert decided.members == (B, A) and decided.source == B and decided.step == 40
    assert decided.rank_of(C) is None
    current = m.current()
    assert current is not None and current[0] == decided


def test_the_decision_moves_the_fence_so_a_member_left_out_cannot_commit(etcd_client: EtcdClient) -> None:
    m, lineage = Membership(etcd_client, KEYS), Lineage(etcd_client, KEYS)
    _first_epoch(m)
    current = m.current()
    assert current is not None
    old_token = current[0].token
    assert lineage.token() == old_token
    assert lineage.commit(old_token, _record(10, old_token))  # every member of epoch 1 may commit
    m.bid(2, Bid(A, 0, 20))
    m.bid(2, Bid(B, 1, 20))
    decided = m.try_decide(2, (A, B, C), {C}.__contains__, min_members=2, round_=1, reason="failure")
    assert decided is not None and decided.token != old_token
    assert lineage.token() == decided.token
    # C was stopped, not dead: it wakes up holding epoch 1's token and finds an epoch without itself
    assert not lineage.commit(old_token, _record(20, old_token))
    assert decided.rank_of(C) is None
    assert lineage.commit(decided.token, _record(20, decided.token))
    assert [r.step for r in lineage.records()] == [20, 10]  # newest first


def test_fewer_than_the_minimum_falls_back_to_the_cold_path(etcd_client: EtcdClient) -> None:
    m = Membership(etcd_client, KEYS)
    _first_epoch(m)
    m.bid(2, Bid(A, 0, 5))
    with pytest.raises(BelowMinimum) as error:
        m.try_decide(2, (A, B, C), {B, C}.__contains__, min_members=2, round_=1, reason="failure")
    assert error.value.members == (A,)
    current = m.current()
    assert current is not None and current[0].number == 1  # nothing was decided


def test_concurrent_deciders_agree_on_one_decision(etcd: EmbeddedEtcd) -> None:
    clients = [
        EtcdClient.connect(parse_endpoints(etcd.endpoint), connect_timeout_s=ETCD_READY_TIMEOUT_S) for _ in range(3)
    ]
    try:
        members = [Membership(c, KEYS) for c in clients]
        _first_epoch(members[0])
        for rank, name in enumerate((A, B, C)):
            members[rank].bid(2, Bid(name, rank, 30))
        members[0].bid(2, Bid(D, None, 0))  # a joiner is admitted in the same epoch

        def decide(m: Membership) -> Epoch | None:
            return m.try_decide(2, (A, B, C), lambda _: False, min_members=2, round_=1, reason="join")

        with ThreadPoolExecutor(3) as pool:
            decisions = list(pool.map(decide, members))
        decided = decisions[0]
        assert decided is not None and all(d == decided for d in decisions)
        assert decided.members == (A, B, C, D)
        assert Lineage(clients[0], KEYS).token() == decided.token
    finally:
        for c in clients:
            c.close()


def test_a_waiting_member_hears_the_decision(etcd_client: EtcdClient) -> None:
    m = Membership(etcd_client, KEYS)
    _first_epoch(m)
    assert m.wait(2, timeout_s=0.3) is None
    m.bid(2, Bid(A, 0, 1))
    m.bid(2, Bid(B, 1, 1))
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(m.wait, 2, 20.0)
        m.try_decide(2, (A, B, C), {C}.__contains__, min_members=2, round_=1, reason="failure")
        heard = waiting.result(timeout=30)
    assert heard is not None and heard.number == 2 and heard.members == (A, B)
    assert m.forget(2) == 2 and m.bids(2) == {}


def test_a_group_whose_fence_was_replaced_cannot_decide(etcd_client: EtcdClient) -> None:
    """A newer round (or epoch) wrote its own token: members of the old group may bid, never decide."""
    m = Membership(etcd_client, KEYS)
    first = _first_epoch(m)
    etcd_client.put(KEYS.lineage_token, "7.newer-round")
    m.bid(2, Bid(A, 0, 3))
    m.bid(2, Bid(B, 1, 3))
    stale = m.try_decide(2, (A, B, C), {C}.__contains__, min_members=2, round_=1, reason="failure", fence=first.token)
    assert stale is None
    assert Lineage(etcd_client, KEYS).token() == "7.newer-round"
    current = m.current()
    assert current is not None and current[0].number == 1
    # the group that holds the fence decides
    etcd_client.put(KEYS.lineage_token, first.token)
    decided = m.try_decide(2, (A, B, C), {C}.__contains__, min_members=2, round_=1, reason="failure", fence=first.token)
    assert decided is not None and decided.members == (A, B)


def test_a_bid_left_by_an_earlier_group_for_the_same_epoch_is_no_member(etcd_client: EtcdClient) -> None:
    """A round that fell back to a cold restart leaves its bids; the next round's group may reach the same epoch
    number, and must not take a dead member of the old group (with more steps: the heal source) into it."""
    m = Membership(etcd_client, KEYS)
    _first_epoch(m)
    m.bid(2, Bid("old-round.0", 0, 99))  # the earlier group's survivor, long gone
    m.bid(2, Bid(A, 0, 5))
    m.bid(2, Bid(B, 1, 5))
    decided = m.try_decide(2, (A, B, C), {C}.__contains__, min_members=2, round_=1, reason="failure")
    assert decided is not None and decided.members == (A, B) and decided.source == A


def test_joiners_are_admitted_all_together_only_when_the_batch_fits_and_never_when_dead(
    etcd_client: EtcdClient,
) -> None:
    m = Membership(etcd_client, KEYS)
    _first_epoch(m)  # A, B, C
    for member, rank in ((A, 0), (B, 1), (C, 2)):
        m.bid(2, Bid(member, rank, 30))
    m.bid(2, Bid(D, None, 0))
    m.bid(2, Bid("node-e", None, 0))
    # 5 workers do not split the batch: both joiners wait (warm) for a later epoch
    fits_even = lambda world: world % 2 == 0  # noqa: E731
    kept = m.try_decide(2, (A, B, C), lambda _: False, min_members=2, round_=1, reason="join", fits=lambda w: w == 3)
    assert kept is not None and set(kept.members) == {A, B, C}
    # a dead joiner is left out; the live one is admitted when the world it makes fits
    for member, rank in ((A, 0), (B, 1), (C, 2)):
        m.bid(3, Bid(member, rank, 31))
    m.bid(3, Bid(D, None, 0))
    m.bid(3, Bid("node-e", None, 0))
    grown = m.try_decide(3, (A, B, C), {"node-e"}.__contains__, min_members=2, round_=1, reason="join", fits=fits_even)
    assert grown is not None and grown.members == (A, B, C, D) and grown.source == A


def test_a_leaving_member_is_accounted_for_but_not_in_the_next_epoch(etcd_client: EtcdClient) -> None:
    m = Membership(etcd_client, KEYS)
    _first_epoch(m)
    m.bid(2, Bid(A, 0, 12))
    m.bid(2, Bid(C, 2, 12))
    # B is alive and has not answered: no decision
    assert m.try_decide(2, (A, B, C), lambda _: False, min_members=2, round_=1, reason="leave") is None
    m.bid(2, Bid(B, 1, 12, leaving=True))
    decided = m.try_decide(2, (A, B, C), lambda _: False, min_members=2, round_=1, reason="leave")
    assert decided is not None and decided.members == (A, C) and decided.reason == "leave"
    assert Bid.decode(Bid(B, 1, 12, leaving=True).encode()).leaving


def test_the_nodes_of_a_join_decided_after_the_workers_last_epoch_are_named_for_a_hang(
    etcd_client: EtcdClient,
) -> None:
    # a hang while a join is admitted must be diagnosed with the joiner in it (agent/node_hangs.py): the daemons still
    # hold the epoch their workers last reported, the decided one names the joiner
    m = Membership(etcd_client, KEYS)
    first = _first_epoch(m)  # round 1, epoch 1: members A, B, C
    for member, node in ((A, "host-a"), (B, "host-b"), (C, "host-c")):
        etcd_client.put(KEYS.membership_member(member), json.dumps({"node": node, "addr": "127.0.0.1:1"}))
    assert m.admitted_nodes(round_=1, epoch=0) == ["host-a", "host-b", "host-c"]
    assert m.admitted_nodes(round_=1, epoch=first.number) == []  # nothing newer than what the workers reported
    assert m.admitted_nodes(round_=2, epoch=0) == []  # an epoch of another round's group says nothing of this one
    etcd_client.delete(KEYS.membership_member(C))
    assert m.admitted_nodes(round_=1, epoch=0) == ["host-a", "host-b"]  # a member without a record is left out
