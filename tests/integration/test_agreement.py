"""Two daemons' hang agreement on a real etcd: one owner, one summary, repeats counted across hangs."""

from __future__ import annotations

import json
import threading
from dataclasses import replace
from typing import Any

import pytest

from elasticd.agent.agreement import HangAgreement
from elasticd.agent.evidence import RankEvidence
from elasticd.etcd.client import EtcdClient
from elasticd.keys import RunKeys
from tests.helpers import etcd_value

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

EVIDENCE = RankEvidence(
    rank=0,
    local_rank=0,
    node="a",
    pid=10,
    process_state="sleeping",
    phase="training",
    entered_step=31,
    completed_step=30,
    silent_s=1.0,
    in_collective=True,
    where="graph.py:1 in backward",
    collectives=12,
    pending_collective="gloo:all_reduce",
    stacks=None,
    flight_recorder=None,
)


def test_first_claim_owns_the_hang_and_everyone_acts_on_its_summary(etcd_client: EtcdClient) -> None:
    keys = RunKeys("agree")
    a, b = HangAgreement(etcd_client, keys, "a"), HangAgreement(etcd_client, keys, "b")
    assert a.claimed(3) is None
    assert a.claim(3, "t1-hang") == ("t1-hang", True)
    assert b.claim(3, "t2-hang") == ("t1-hang", False)
    assert b.claimed(3) == "t1-hang"

    results: dict[str, dict[str, Any] | None] = {}

    def follower() -> None:
        b.report(3, [replace(EVIDENCE, rank=1, node="b", collectives=11, pending_collective="")])
        results["b"] = b.decide(3, ["a", "b"], owner=False, extra={"path": "/x/t1-hang"})

    thread = threading.Thread(target=follower)
    thread.start()
    a.report(3, [EVIDENCE])
    results["a"] = a.decide(3, ["a", "b"], owner=True, extra={"path": "/x/t1-hang"})
    thread.join(timeout=20)
    assert results["a"] is not None and results["a"] == results["b"]
    assert results["a"]["culprit_ranks"] == [1] and results["a"]["nodes_reported"] == ["a", "b"]
    assert results["a"]["attempt"] == 1


def test_repeats_at_the_same_step_are_counted_and_a_new_step_starts_over(etcd_client: EtcdClient) -> None:
    keys = RunKeys("repeat")
    agreement = HangAgreement(etcd_client, keys, "a")
    attempts = []
    for round_, step in ((1, 31), (2, 31), (3, 31), (4, 57)):
        agreement.claim(round_, f"h{round_}")
        agreement.report(round_, [replace(EVIDENCE, entered_step=step)])
        decided = agreement.decide(round_, ["a"], owner=True, extra={})
        assert decided is not None
        attempts.append(decided["attempt"])
    assert attempts == [1, 2, 3, 1]


def test_a_new_round_forgets_older_rounds_but_not_the_repeat_count(etcd_client: EtcdClient) -> None:
    keys = RunKeys("forget")
    agreement = HangAgreement(etcd_client, keys, "a")
    for round_ in (1, 2):
        agreement.claim(round_, f"h{round_}")
        agreement.report(round_, [EVIDENCE])
        agreement.decide(round_, ["a"], owner=True, extra={})
    agreement.forget_rounds_before(2)
    assert agreement.claimed(1) is None and agreement.claimed(2) == "h2"
    assert etcd_client.get(keys.hang_last) is not None


def test_owner_that_never_reports_leaves_the_others_to_diagnose_alone(etcd_client: EtcdClient) -> None:
    import elasticd.agent.agreement as module

    keys = RunKeys("lonely")
    now = [0.0]
    b = HangAgreement(etcd_client, keys, "b", clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s))
    b.report(5, [replace(EVIDENCE, node="b")])
    summary = b.decide(5, ["a", "b"], owner=False, extra={})
    assert summary is not None
    assert summary["nodes_reported"] == ["b"] and summary["nodes_missing"] == ["a"]
    # it waited for the owner's summary, then for a's report, each for its full time, and no longer
    waited = module.SUMMARY_WAIT_S + module.REPORT_WAIT_S
    assert waited <= now[0] <= waited + 2 * module._POLL_S


def test_the_owner_never_waits_for_a_lost_node_and_names_it_without_counting_a_repeat(etcd_client: EtcdClient) -> None:
    keys = RunKeys("lost")
    sleeps: list[float] = []
    a = HangAgreement(etcd_client, keys, "a", sleep=sleeps.append)
    a.claim(4, "h")
    a.report(4, [EVIDENCE], "h")
    lost = {"c": "its daemon is stopped or dead (no rendezvous heartbeat for 2.3 s)"}
    summary = a.decide(4, ["a", "c"], owner=True, extra={"hang": "h"}, lost=lambda: lost)
    assert sleeps == []  # c will never report: not one poll spent waiting for it
    assert summary is not None and summary["culprit_nodes"] == ["c"] and summary["cause"] == "node_lost"
    assert summary["nodes_missing"] == ["c"] and summary["attempt"] == 0
    assert etcd_client.get(keys.hang_last) is None  # a lost node never counts toward --hang-attempts


def _attempt(decided: dict[str, Any] | None) -> int:
    assert decided is not None, "no diagnosis was decided"
    return int(decided["attempt"])


def test_one_hang_per_round_counts_and_a_late_report_of_an_older_round_never_does(etcd_client: EtcdClient) -> None:
    keys = RunKeys("late")
    a, c = HangAgreement(etcd_client, keys, "a"), HangAgreement(etcd_client, keys, "c")
    a.claim(5, "h5")
    a.report(5, [EVIDENCE], "h5")
    assert _attempt(a.decide(5, ["a"], owner=True, extra={"hang": "h5"})) == 1
    # a second diagnosis of the same round (a node that diagnosed alone) is the same hang
    a.report(5, [EVIDENCE], "h5")
    assert _attempt(a.decide(5, ["a"], owner=True, extra={"hang": "h5"})) == 1
    a.claim(6, "h6")
    a.report(6, [EVIDENCE], "h6")
    assert _attempt(a.decide(6, ["a"], owner=True, extra={"hang": "h6"})) == 2
    # node c was stopped in round 4, evicted, and wakes up: its report of round 4, same step, is not a repeat
    c.claim(4, "h4")
    c.report(4, [replace(EVIDENCE, node="c")], "h4")
    assert _attempt(c.decide(4, ["c"], owner=True, extra={"hang": "h4"})) == 0
    last = json.loads(etcd_value(etcd_client, keys.hang_last))
    assert last["attempts"] == 2 and last["round"] == 6


def test_an_abandoned_hang_releases_everyone_and_a_later_one_claims_afresh(etcd_client: EtcdClient) -> None:
    keys = RunKeys("abandon")
    a, b = HangAgreement(etcd_client, keys, "a"), HangAgreement(etcd_client, keys, "b")
    assert a.claim(2, "h1") == ("h1", True)
    assert b.claimed(2) == "h1"
    a.abandon(2, "h1", "a worker exited")
    assert b.claimed(2) is None  # nobody joins a hang that was given up
    assert b.decide(2, ["a", "b"], owner=False, extra={"hang": "h1"}) is None
    assert b.claim(2, "h2") == ("h2", True)  # a hang that outlives the abandoned one is a new one
    assert a.claimed(2) == "h2"


def test_a_node_whose_worker_exits_while_it_waits_gives_the_hang_up(etcd_client: EtcdClient) -> None:
    keys = RunKeys("exits")
    a = HangAgreement(etcd_client, keys, "a")
    a.claim(3, "h")
    a.report(3, [EVIDENCE], "h")
    assert a.decide(3, ["a", "b"], owner=True, extra={"hang": "h"}, abort=lambda: True) is None
    assert etcd_client.get(keys.hang_last) is None


def test_a_node_stops_waiting_for_the_summary_of_an_owner_whose_daemon_is_gone(etcd_client: EtcdClient) -> None:
    keys = RunKeys("owner-gone")
    sleeps: list[float] = []
    a, b = HangAgreement(etcd_client, keys, "a"), HangAgreement(etcd_client, keys, "b", sleep=sleeps.append)
    a.claim(7, "h")
    b.report(7, [replace(EVIDENCE, node="b")], "h")
    gone = {"a": "its daemon is gone (its registry record expired)"}
    summary = b.decide(7, ["a", "b"], owner=False, extra={"hang": "h"}, lost=lambda: gone)
    assert sleeps == [] and summary is not None
    assert summary["culprit_nodes"] == ["a"] and summary["cause"] == "node_lost"
