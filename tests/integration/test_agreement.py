"""Two daemons' hang agreement on a real etcd: one owner, one summary, repeats counted across hangs."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest

from elasticd.agent.agreement import HangAgreement
from elasticd.agent.evidence import RankEvidence
from elasticd.etcd.client import EtcdClient
from elasticd.keys import RunKeys

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

    results: dict[str, dict] = {}  # type: ignore[type-arg]

    def follower() -> None:
        b.report(3, [replace(EVIDENCE, rank=1, node="b", collectives=11, pending_collective="")])
        results["b"] = b.decide(3, ["a", "b"], owner=False, extra={"path": "/x/t1-hang"})

    thread = threading.Thread(target=follower)
    thread.start()
    a.report(3, [EVIDENCE])
    results["a"] = a.decide(3, ["a", "b"], owner=True, extra={"path": "/x/t1-hang"})
    thread.join(timeout=20)
    assert results["a"] == results["b"]
    assert results["a"]["culprit_ranks"] == [1] and results["a"]["nodes_reported"] == ["a", "b"]
    assert results["a"]["attempt"] == 1


def test_repeats_at_the_same_step_are_counted_and_a_new_step_starts_over(etcd_client: EtcdClient) -> None:
    keys = RunKeys("repeat")
    agreement = HangAgreement(etcd_client, keys, "a")
    attempts = []
    for round_, step in ((1, 31), (2, 31), (3, 31), (4, 57)):
        agreement.claim(round_, f"h{round_}")
        agreement.report(round_, [replace(EVIDENCE, entered_step=step)])
        attempts.append(agreement.decide(round_, ["a"], owner=True, extra={})["attempt"])
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
    ticks = iter(range(0, 10_000))
    b = HangAgreement(etcd_client, keys, "b", clock=lambda: float(next(ticks)), sleep=lambda _s: None)
    b.report(5, [replace(EVIDENCE, node="b")])
    summary = b.decide(5, ["a", "b"], owner=False, extra={})
    assert summary["nodes_reported"] == ["b"] and summary["nodes_missing"] == ["a"]
    assert module.SUMMARY_WAIT_S > 0
