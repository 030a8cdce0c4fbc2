"""Every branch of the supervisor's decision rules, without processes."""

from __future__ import annotations

from elasticd.agent.policy import Action, GroupState, HangReport, Observation, SupervisorPolicy

policy = SupervisorPolicy()


def test_healthy_group_continues() -> None:
    assert policy.decide(Observation(GroupState.HEALTHY)).action is Action.CONTINUE


def test_failure_restarts_and_consumes_a_restart() -> None:
    d = policy.decide(Observation(GroupState.FAILED, restarts_left=2))
    assert (d.action, d.reason, d.counts_as_restart) == (Action.RESTART, "failure", True)


def test_failure_without_restarts_left_stops_with_a_reason() -> None:
    d = policy.decide(Observation(GroupState.FAILED, restarts_left=0))
    assert d.action is Action.STOP and d.action.terminal and "--max-restarts" in d.message


def test_waiting_node_restarts_for_free_after_a_checkpoint() -> None:
    d = policy.decide(Observation(GroupState.HEALTHY, nodes_waiting=1, restarts_left=0))
    assert (d.action, d.reason, d.counts_as_restart, d.planned) == (Action.RESTART, "membership", False, True)


def test_checkpoint_asked_by_a_peer_restarts_the_group_too() -> None:
    d = policy.decide(Observation(GroupState.HEALTHY, peer_checkpointed=True))
    assert (d.action, d.reason, d.planned) == (Action.RESTART, "membership", True)


def test_fatal_report_stops_without_restart_even_with_restarts_left() -> None:
    d = policy.decide(Observation(GroupState.FAILED, restarts_left=5, fatal_message="non-finite loss"))
    assert (d.action, d.message) == (Action.STOP, "non-finite loss")


def test_failure_is_not_planned() -> None:
    assert not policy.decide(Observation(GroupState.FAILED, restarts_left=1)).planned


def test_drain_wins_over_failure_and_join() -> None:
    for state in (GroupState.HEALTHY, GroupState.FAILED):
        d = policy.decide(Observation(state, nodes_waiting=2, drain_requested=True))
        assert d.action is Action.DRAIN and d.planned


def test_success_finishes_even_when_a_drain_was_asked() -> None:
    assert policy.decide(Observation(GroupState.SUCCEEDED, drain_requested=True)).action is Action.FINISH


def test_leave_request_is_planned_and_loses_to_a_run_wide_drain() -> None:
    d = policy.decide(Observation(GroupState.HEALTHY, leave_requested=True, nodes_waiting=1))
    assert (d.action, d.planned) == (Action.LEAVE, True)
    assert policy.decide(Observation(GroupState.HEALTHY, leave_requested=True, drain_requested=True)).action is (
        Action.DRAIN
    )


def test_hang_restarts_and_consumes_a_restart() -> None:
    hang = HangReport(step=30, attempt=1, path="/d/x-hang")
    d = policy.decide(Observation(GroupState.HEALTHY, restarts_left=3, hang=hang))
    assert (d.action, d.reason, d.counts_as_restart, d.planned) == (Action.RESTART, "hang", True, False)


def test_same_step_hanging_hang_attempts_times_stops_and_names_the_diagnostics() -> None:
    hang = HangReport(step=30, attempt=2, path="/d/x-hang")
    d = SupervisorPolicy(hang_attempts=2).decide(Observation(GroupState.HEALTHY, restarts_left=3, hang=hang))
    assert (d.action, d.reason) == (Action.STOP, "hang")
    assert "step 30" in d.message and "Diagnostics: /d/x-hang" in d.message and "--hang-attempts 2" in d.message


def test_hang_without_restarts_left_stops() -> None:
    hang = HangReport(step=30, attempt=1, path="/d/x-hang")
    d = policy.decide(Observation(GroupState.HEALTHY, restarts_left=0, hang=hang))
    assert d.action is Action.STOP and "/d/x-hang" in d.message


def test_drain_wins_over_a_hang_and_a_failure_over_a_hang() -> None:
    hang = HangReport(step=30, attempt=1, path="/d")
    assert policy.decide(Observation(GroupState.HEALTHY, drain_requested=True, hang=hang)).action is Action.DRAIN
    d = policy.decide(Observation(GroupState.FAILED, restarts_left=2, hang=hang))
    assert d.reason == "failure"


def test_a_resize_restarts_for_free_and_plans_a_checkpoint_only_while_workers_run() -> None:
    failed = policy.decide(Observation(GroupState.FAILED, restarts_left=0, resize=True))
    assert (failed.action, failed.reason, failed.counts_as_restart, failed.planned) == (
        Action.RESTART,
        "membership",
        False,
        False,
    )
    healthy = policy.decide(Observation(GroupState.HEALTHY, resize=True))
    assert (healthy.action, healthy.planned) == (Action.RESTART, True)


def test_a_drain_or_a_fatal_report_wins_over_a_resize() -> None:
    assert policy.decide(Observation(GroupState.HEALTHY, resize=True, drain_requested=True)).action is Action.DRAIN
    assert policy.decide(Observation(GroupState.FAILED, resize=True, fatal_message="x")).action is Action.STOP


def test_a_hang_whose_culprits_are_elsewhere_leaves_this_node_training_in_place() -> None:
    hang = HangReport(step=40, attempt=1, path="/d", culprits=(2,), culprit_nodes=("n2",))
    decision = SupervisorPolicy().decide(
        Observation(GroupState.HEALTHY, restarts_left=3, hang=hang, hang_elsewhere=True)
    )
    assert decision.action is Action.CONTINUE and decision.reason == "hang_in_place"
    # the culprit's own node (hang_elsewhere False) restarts as before, and a repeated hang stops everywhere
    assert SupervisorPolicy().decide(Observation(GroupState.HEALTHY, restarts_left=3, hang=hang)).reason == "hang"
    again = HangReport(step=40, attempt=3, path="/d", culprits=(2,), culprit_nodes=("n2",))
    stopped = SupervisorPolicy(hang_attempts=3).decide(Observation(GroupState.HEALTHY, hang=again, hang_elsewhere=True))
    assert stopped.action is Action.STOP


def test_workers_that_gave_up_joining_in_place_rejoin_through_the_rendezvous_for_free() -> None:
    decision = SupervisorPolicy().decide(Observation(GroupState.FAILED, restarts_left=0, rejoin=True))
    assert decision.action is Action.RESTART and decision.reason == "membership" and not decision.counts_as_restart
