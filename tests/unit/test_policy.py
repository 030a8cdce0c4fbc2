"""Every branch of the supervisor's decision rules, without processes."""

from __future__ import annotations

from elasticd.agent.policy import Action, GroupState, Observation, SupervisorPolicy

policy = SupervisorPolicy()


def test_healthy_group_continues() -> None:
    assert policy.decide(Observation(GroupState.HEALTHY)).action is Action.CONTINUE


def test_failure_restarts_and_consumes_a_restart() -> None:
    d = policy.decide(Observation(GroupState.FAILED, restarts_left=2))
    assert (d.action, d.reason, d.counts_as_restart) == (Action.RESTART, "failure", True)


def test_failure_without_restarts_left_stops_with_a_reason() -> None:
    d = policy.decide(Observation(GroupState.FAILED, restarts_left=0))
    assert d.action is Action.STOP and d.action.terminal and "--max-restarts" in d.message


def test_waiting_node_restarts_for_free() -> None:
    d = policy.decide(Observation(GroupState.HEALTHY, nodes_waiting=1, restarts_left=0))
    assert (d.action, d.reason, d.counts_as_restart) == (Action.RESTART, "membership", False)


def test_drain_wins_over_failure_and_join() -> None:
    for state in (GroupState.HEALTHY, GroupState.FAILED):
        d = policy.decide(Observation(state, nodes_waiting=2, drain_requested=True))
        assert d.action is Action.DRAIN


def test_success_finishes_even_when_a_drain_was_asked() -> None:
    assert policy.decide(Observation(GroupState.SUCCEEDED, drain_requested=True)).action is Action.FINISH
