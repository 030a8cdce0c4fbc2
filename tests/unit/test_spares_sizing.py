"""The agent's side of sizes that fit: one training count per round, who is a spare, and when a round must re-form.

The round's store is torch's in-process ``HashStore`` (the same c10d interface the agents use over etcd); the record
of the constraint is an in-memory :class:`PlanStore`, so these run without a process or a network.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from torch.distributed import DistStoreError, HashStore

from elasticd.agent import spares
from elasticd.agent.policy import GroupState
from elasticd.agent.spares import Sizing
from elasticd.errors import EXIT_RESIZE
from elasticd.etcd.client import EtcdError
from elasticd.metrics import Metrics
from elasticd.worker.batching import BatchConstraint

FITS_2_AND_4 = BatchConstraint(global_batch_size=16, micro_batch_size=4, nproc_per_node=1)


class Plans:
    """The recorded constraint, in memory; ``fail`` makes the next writes raise as an unreachable etcd would."""

    def __init__(self, constraint: BatchConstraint | None = None) -> None:
        self.constraint = constraint
        self.fail = False
        self.writes = 0

    def read(self) -> BatchConstraint | None:
        return self.constraint

    def write(self, constraint: BatchConstraint) -> None:
        if self.fail:
            raise EtcdError("put", "127.0.0.1:2379", "UNAVAILABLE", "etcd is away")
        self.writes += 1
        self.constraint = constraint


class Log:
    def __init__(self) -> None:
        self.warnings: list[tuple[str, dict[str, Any]]] = []

    def warning(self, event: str, **fields: Any) -> None:
        self.warnings.append((event, fields))


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def beat(constraint: BatchConstraint, **extra: Any) -> dict[str, Any]:
    return {"kind": "batch_plan", "rank": 0, "local_rank": 0, **constraint.to_json(), **extra}


def round_of(
    nodes: int, plans: Plans, reported: BatchConstraint | None = None, min_nodes: int = 2, **kwargs: Any
) -> list[Sizing]:
    """Every agent of one round, rank 0 first, after the rank assignment of a rendezvous (range min_nodes..4)."""
    store = HashStore()
    agents = [Sizing(min_nodes=min_nodes, max_nodes=4, plans=plans, **kwargs) for _ in range(nodes)]
    if reported is not None:
        agents[0].on_beat(beat(reported))
    for rank, agent in enumerate(agents):
        agent.agree(store, rank, nodes, round_=7)
    return agents


def test_rank_0_decides_the_training_count_and_every_agent_of_the_round_acts_on_it() -> None:
    agents = round_of(3, Plans(FITS_2_AND_4))
    assert [a.training for a in agents] == [2, 2, 2]
    assert [a.spare for a in agents] == [False, False, True]
    assert agents[2].training_members(["a", "b", "c"]) == ["a", "b"]


def test_other_ranks_follow_rank_0_even_when_the_record_changes_under_them() -> None:
    plans = Plans()  # nothing recorded when rank 0 decides: everyone trains
    store = HashStore()
    agents = [Sizing(min_nodes=2, max_nodes=4, plans=plans) for _ in range(3)]
    agents[0].agree(store, 0, 3)
    plans.constraint = FITS_2_AND_4  # recorded a moment later, before the others read
    for rank in (1, 2):
        agents[rank].agree(store, rank, 3)
    assert {a.training for a in agents} == {3} and not any(a.spare for a in agents)


def test_the_constraint_this_node_reported_is_newer_than_the_record() -> None:
    agents = round_of(3, Plans(), reported=FITS_2_AND_4)
    assert [a.spare for a in agents] == [False, False, True]


def test_unknown_or_hopeless_constraints_let_every_node_train() -> None:
    assert {a.training for a in round_of(3, Plans())} == {3}
    fits_none = BatchConstraint(48, 5, 1)  # 48 is no multiple of 5 * n for any n: the workers stop the run (exit 2)
    assert {a.training for a in round_of(3, Plans(fits_none))} == {3}


def test_when_no_count_up_to_the_round_fits_every_node_waits() -> None:
    agents = round_of(3, Plans(BatchConstraint(32, 8, 1)), min_nodes=3)  # of 3..4, only 4 split 32 in micro 8
    assert [a.training for a in agents] == [0, 0, 0] and all(a.spare for a in agents)


def test_a_rank_whose_rank_0_never_decides_gives_up_within_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(spares, "AGREE_TIMEOUT_S", 0.2)
    store = HashStore()
    with pytest.raises(DistStoreError):
        Sizing().agree(store, 1, 3)
    assert store.timeout == timedelta(minutes=5)  # type: ignore[attr-defined]  # torch's stubs omit Store.timeout


def test_started_sets_the_spare_gauge_and_the_world_of_the_training_nodes_and_warns() -> None:
    registry = CollectorRegistry()
    metrics = Metrics.create(registry)
    log = Log()
    agents = round_of(3, Plans(FITS_2_AND_4), metrics=metrics)
    assert agents[2].started(log, local_world_size=2) is True
    assert registry.get_sample_value("elasticd_spare") == 1
    assert registry.get_sample_value("elasticd_world_size") == 4
    assert agents[0].started(log, local_world_size=2) is False
    assert registry.get_sample_value("elasticd_spare") == 0
    (event, fields), _ = log.warnings
    assert event == "batch_does_not_fit"
    assert (fields["nodes"], fields["training_nodes"], fields["spare"]) == (3, 2, True)
    assert "global batches that fit every node count in 2..4: 48, 96, 144" in fields["message"]


def test_a_round_that_fits_warns_nobody() -> None:
    log = Log()
    agents = round_of(4, Plans(FITS_2_AND_4))
    assert not any(a.started(log, 1) for a in agents) and not log.warnings


def test_workers_that_exit_to_be_resized_re_form_the_round_and_their_constraint_is_recorded() -> None:
    plans = Plans()
    agent = round_of(3, plans)[0]
    assert not agent.reform_needed(GroupState.FAILED, {0: _Failure(EXIT_RESIZE)})  # no constraint reported: a fault
    agent.on_beat(beat(FITS_2_AND_4))
    assert agent.reform_needed(GroupState.FAILED, {0: _Failure(EXIT_RESIZE)})
    assert plans.constraint == FITS_2_AND_4


def test_a_reported_constraint_that_changes_the_training_count_re_forms_a_healthy_round() -> None:
    agent = round_of(3, Plans())[0]  # nothing known: all three train
    assert not agent.reform_needed(GroupState.HEALTHY, {})
    agent.on_beat(beat(FITS_2_AND_4))  # the workers' beat may come before their exit
    assert agent.reform_needed(GroupState.HEALTHY, {})


def test_a_worker_failure_of_another_kind_is_no_resize() -> None:
    agent = round_of(3, Plans(FITS_2_AND_4), reported=FITS_2_AND_4)[0]
    assert not agent.reform_needed(GroupState.FAILED, {0: _Failure(1)})
    assert not agent.reform_needed(GroupState.FAILED, {0: _Failure(EXIT_RESIZE), 1: _Failure(-9)})


def test_a_record_that_cannot_be_written_now_is_written_on_a_later_tick() -> None:
    plans = Plans()
    plans.fail = True
    agent = round_of(4, plans, reported=FITS_2_AND_4)[0]
    assert not agent.reform_needed(GroupState.HEALTHY, {})
    assert plans.constraint is None
    plans.fail = False
    agent.reform_needed(GroupState.HEALTHY, {})
    agent.reform_needed(GroupState.HEALTHY, {})
    assert plans.constraint == FITS_2_AND_4 and plans.writes == 1


def test_a_spare_re_forms_when_a_member_leaves_the_round_looking_once_a_second() -> None:
    clock = Clock()
    members = {"count": 3}
    reads: list[float] = []

    def participants() -> int:
        reads.append(clock.now)
        return members["count"]

    spare = round_of(3, Plans(FITS_2_AND_4), participants=participants, clock=clock)[2]
    assert not spare.reform_needed(GroupState.HEALTHY, {})
    members["count"] = 2
    clock.now += 0.5
    assert not spare.reform_needed(GroupState.HEALTHY, {})  # not due yet
    clock.now += spares.WATCH_INTERVAL_S
    assert spare.reform_needed(GroupState.HEALTHY, {})
    assert len(reads) == 2


def test_a_spare_finishes_when_a_training_node_of_its_round_finished() -> None:
    clock = Clock()
    peers: list[dict[str, Any]] = [{"node_id": "a", "round": 6, "state": "finished"}]
    spare = round_of(3, Plans(FITS_2_AND_4), read_peers=lambda: peers, clock=clock)[2]
    assert not spare.run_finished()  # a previous round's record
    peers.append({"node_id": "b", "round": 7, "state": "finished"})
    assert not spare.run_finished()  # looked less than a second ago
    clock.now += spares.WATCH_INTERVAL_S
    assert spare.run_finished()


@pytest.mark.parametrize(
    "bad",
    [
        {"kind": "batch_plan"},
        {"kind": "batch_plan", "global_batch_size": "x", "micro_batch_size": 4, "nproc_per_node": 1},
        {"kind": "batch_plan", "global_batch_size": 1e309, "micro_batch_size": 4, "nproc_per_node": 1},
        {"kind": "step", **FITS_2_AND_4.to_json()},
    ],
)
def test_beats_that_are_not_a_constraint_change_nothing(bad: dict[str, Any]) -> None:
    agent = round_of(3, Plans())[0]
    agent.on_beat(bad)
    assert not agent.reform_needed(GroupState.HEALTHY, {})


class _Failure:
    """What the supervisor passes for a failed worker: torch's ``ProcessFailure`` carries its ``exitcode``."""

    def __init__(self, exitcode: int) -> None:
        self.exitcode = exitcode
