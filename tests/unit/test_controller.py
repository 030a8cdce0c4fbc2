"""The supervisor's loop, stepped over a scripted node and a fake clock: no process, no etcd, no rendezvous.

Each test sets what the node observes, calls :meth:`Controller.step` and checks what the controller did, in order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from elasticd.agent.controller import Controller, NodeState
from elasticd.agent.policy import Decision, GroupState, HangReport
from elasticd.board import Phase
from elasticd.errors import EXIT_REJOIN


def failed(*exitcodes: int) -> RunResult:
    failures = {rank: ProcessFailure(rank, 1000 + rank, code, "") for rank, code in enumerate(exitcodes)}
    return RunResult(state=WorkerState.FAILED, failures=failures)


class ScriptedNode:
    """A node whose observations the test sets; every action is recorded in ``calls``."""

    def __init__(self) -> None:
        self.results: list[RunResult] = []  # what monitor() returns, in turn (then the last one again)
        self.suspicion: Any = None
        self.drain_wanted = False
        self.lost = False
        self.joining = False
        self.claim: str | None = None
        self.report: HangReport | None = None
        self.exiting = False
        self.waiting = 0
        self.fatal_report: tuple[str, int] | None = None
        self.restarts = 3
        self.saved = False
        self.in_place = True
        self.resize = False
        self.phases: list[Phase] = [Phase.TRAINING]
        self.leaves_in_place = False
        self.leave_requested = False
        self.calls: list[tuple[Any, ...]] = []
        self.reads: list[str] = []

    node_id = "n0"

    # observe
    def monitor(self) -> RunResult:
        self.reads.append("monitor")
        if len(self.results) > 1:
            return self.results.pop(0)
        return self.results[0] if self.results else RunResult(state=WorkerState.HEALTHY)

    def hang_suspicion(self) -> Any | None:
        return self.suspicion

    def drain_requested(self) -> bool:
        self.reads.append("drain")
        return self.drain_wanted

    def lineage_lost(self) -> bool:
        return self.lost

    def waiting_to_join(self) -> bool:
        return self.joining

    def peer_hang_claim(self) -> str | None:
        self.reads.append("claim")
        return self.claim

    def diagnose_hang(self, suspicion: Any | None) -> HangReport | None:
        self.calls.append(("diagnose", suspicion))
        return self.report

    def workers_exiting(self) -> bool:
        return self.exiting

    def nodes_waiting(self) -> int:
        self.reads.append("waiting")
        return self.waiting

    def fatal(self) -> tuple[str, int] | None:
        return self.fatal_report

    def restarts_left(self) -> int:
        return self.restarts

    def all_saved(self) -> bool:
        return self.saved

    def all_in_place(self) -> bool:
        return self.in_place

    def resize_needed(self, state: GroupState, failures: dict[int, Any]) -> bool:
        return self.resize

    def worker_phases(self) -> Sequence[Phase]:
        return self.phases

    # act
    def set_graceful(self, graceful: bool) -> None:
        self.graceful = graceful

    def publish_state(self, state: NodeState) -> None:
        self.calls.append(("state", state))

    def check_stragglers(self, now: float) -> None:
        self.calls.append(("stragglers", now))

    def leave_hang_to_culprits(self, hang: HangReport) -> None:
        self.calls.append(("left_to_culprits", hang.culprit_nodes))

    def log_failures(self, result: RunResult) -> None:
        self.calls.append(("log_failures",))

    def leave_in_place(self) -> bool:
        self.calls.append(("leave_in_place",))
        return self.leaves_in_place

    def checkpoint_first(self, reason: str) -> None:
        self.calls.append(("checkpoint_first", reason))

    def tell_group_of_hang(self, hang: HangReport) -> None:
        self.calls.append(("tell_group", hang.culprit_nodes))

    def kill_workers(self) -> None:
        self.calls.append(("kill",))

    def restart(self, decision: Decision, nodes_waiting: int) -> None:
        self.calls.append(("restart", decision.reason, decision.counts_as_restart))
        if decision.counts_as_restart:
            self.restarts -= 1

    def finish(self) -> None:
        self.calls.append(("finish",))

    def drain(self, *, leave: bool) -> RunResult:
        self.calls.append(("drain", leave))
        return RunResult(state=WorkerState.SUCCEEDED)

    def give_up(self, decision: Decision, exit_code: int, result: RunResult) -> RunResult:
        self.calls.append(("give_up", decision.reason, exit_code))
        return RunResult(state=WorkerState.FAILED, failures=result.failures)

    def actions(self) -> list[tuple[Any, ...]]:
        """The calls that change something (not the straggler checks, which run on their own clock)."""
        return [c for c in self.calls if c[0] != "stragglers"]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def node() -> ScriptedNode:
    return ScriptedNode()


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def controller(node: ScriptedNode, clock: Clock) -> Controller:
    return Controller(node, clock=clock)


def test_a_healthy_step_does_nothing_and_goes_on(node: ScriptedNode, controller: Controller) -> None:
    assert controller.step() is None
    assert node.actions() == []
    assert controller.state is NodeState.RUNNING
    assert node.graceful  # a signal may wait for a clean leave while the workers train


def test_a_failed_worker_restarts_the_group_while_restarts_last_then_gives_up(
    node: ScriptedNode, controller: Controller
) -> None:
    node.results = [failed(1)]
    node.restarts = 1
    assert controller.step() is None
    assert node.actions() == [
        ("log_failures",),
        ("state", NodeState.RESTARTING),
        ("restart", "failure", True),
    ]
    assert controller.state is NodeState.RUNNING  # the new round publishes its own states
    assert not node.graceful  # unplanned: a signal while the group restarts ends the daemon at once
    node.calls.clear()
    result = controller.step()
    assert result is not None and result.state is WorkerState.FAILED
    assert node.actions() == [("log_failures",), ("state", NodeState.FAILED), ("give_up", "failure", 1)]


def test_a_fatal_report_stops_the_node_with_the_workers_exit_code(node: ScriptedNode, controller: Controller) -> None:
    node.fatal_report = ("non-finite loss beyond --on-nan", 3)
    result = controller.step()
    assert result is not None and result.state is WorkerState.FAILED
    assert node.actions()[-1] == ("give_up", "fatal", 3)


def test_a_join_takes_a_checkpoint_first_and_costs_no_restart(node: ScriptedNode, controller: Controller) -> None:
    node.waiting = 1
    assert controller.step() is None
    assert node.actions() == [
        ("checkpoint_first", "membership"),
        ("state", NodeState.RESTARTING),
        ("restart", "membership", False),
    ]
    assert node.graceful  # planned: a signal meanwhile still waits for a clean leave
    node.waiting = 0
    node.calls.clear()
    controller.step()
    assert node.actions() == []  # nothing more once the node joined


def test_a_worker_on_its_way_out_is_not_joined_first(node: ScriptedNode, controller: Controller) -> None:
    node.exiting, node.waiting = True, 1
    controller.step()
    assert "waiting" not in node.reads  # the join waits for the failure about to be reported
    assert node.actions() == []


def test_a_drain_request_is_read_once_per_control_interval(
    node: ScriptedNode, clock: Clock, controller: Controller
) -> None:
    controller.step()
    node.drain_wanted = True
    clock.now += 0.5
    assert controller.step() is None
    assert node.reads.count("drain") == 1 and node.actions() == []  # not read again before the interval
    clock.now += 0.5
    result = controller.step()
    assert result is not None and result.state is WorkerState.SUCCEEDED
    assert node.actions() == [("checkpoint_first", "drain"), ("state", NodeState.DRAINING), ("drain", False)]


def test_sigterm_leaves_in_place_without_a_checkpoint_when_the_workers_can(
    node: ScriptedNode, controller: Controller
) -> None:
    node.leave_requested, node.leaves_in_place = True, True
    assert controller.step() is not None
    assert node.actions() == [("leave_in_place",), ("state", NodeState.DRAINING), ("drain", True)]


def test_sigterm_takes_a_checkpoint_first_when_leaving_in_place_did_not_work(
    node: ScriptedNode, controller: Controller
) -> None:
    node.leave_requested = True
    controller.step()
    assert node.actions() == [
        ("leave_in_place",),
        ("checkpoint_first", "drain"),
        ("state", NodeState.DRAINING),
        ("drain", True),
    ]


def test_a_hang_whose_culprit_is_here_tells_the_group_kills_and_restarts(
    node: ScriptedNode, controller: Controller
) -> None:
    node.suspicion = "rank 0 silent"
    node.report = HangReport(step=7, attempt=1, path="/d/20261130-hang", culprits=(0,), culprit_nodes=("n0",))
    controller.step()
    assert node.actions() == [
        ("diagnose", "rank 0 silent"),
        ("tell_group", ("n0",)),
        ("kill",),
        ("state", NodeState.RESTARTING),
        ("restart", "hang", True),
    ]


def test_a_hang_whose_culprits_are_elsewhere_is_left_to_them_in_place(
    node: ScriptedNode, controller: Controller
) -> None:
    node.suspicion = "rank 0 silent"
    node.report = HangReport(step=7, attempt=1, path="/d/h", culprits=(2,), culprit_nodes=("n1",))
    assert controller.step() is None
    assert node.actions() == [("diagnose", "rank 0 silent"), ("left_to_culprits", ("n1",))]
    node.in_place = False  # cold workers cannot re-form: the whole group restarts
    node.calls.clear()
    controller.step()
    assert ("restart", "hang", True) in node.actions() and ("kill",) in node.actions()


def test_a_peer_s_hang_claim_is_acted_on_once(node: ScriptedNode, clock: Clock, controller: Controller) -> None:
    node.claim = "20261130-hang"
    node.report = HangReport(step=7, attempt=1, path=f"/d/{node.claim}", culprit_nodes=("n1",))
    controller.step()
    assert ("diagnose", None) in node.actions()
    node.calls.clear()
    clock.now += 1.0
    controller.step()
    assert node.reads.count("claim") == 2  # read again, and known
    assert node.actions() == []


def test_a_node_waiting_to_join_in_place_takes_no_part_in_the_group_s_hangs(
    node: ScriptedNode, controller: Controller
) -> None:
    node.joining, node.claim = True, "20261130-hang"
    controller.step()
    assert "claim" not in node.reads and node.actions() == []


def test_a_worker_that_exited_during_an_uncounted_hang_is_a_failure_not_a_hang(
    node: ScriptedNode, controller: Controller
) -> None:
    node.results = [RunResult(state=WorkerState.HEALTHY), failed(1)]
    node.suspicion = "rank 0 silent"
    node.report = HangReport(step=7, attempt=0, path="", culprit_nodes=("n0",))  # a lost node: not counted
    controller.step()
    actions = node.actions()
    assert ("restart", "failure", True) in actions
    assert ("kill",) not in actions and not any(a[0] == "tell_group" for a in actions)


def test_a_lost_lineage_restarts_without_a_checkpoint_or_a_counted_restart(
    node: ScriptedNode, controller: Controller
) -> None:
    node.lost = True
    controller.step()
    assert node.actions() == [("state", NodeState.RESTARTING), ("restart", "membership", False)]


def test_workers_that_could_not_join_in_place_go_through_the_rendezvous_for_free(
    node: ScriptedNode, controller: Controller
) -> None:
    node.results = [failed(EXIT_REJOIN)]
    controller.step()
    assert node.actions() == [("log_failures",), ("state", NodeState.RESTARTING), ("restart", "membership", False)]
    node.results = [failed(EXIT_REJOIN, 1)]  # one of them failed for real: counted
    node.calls.clear()
    controller.step()
    assert ("restart", "failure", True) in node.actions()


def test_finished_workers_finish_the_node(node: ScriptedNode, controller: Controller) -> None:
    done = RunResult(state=WorkerState.SUCCEEDED)
    node.results = [done]
    assert controller.step() is done
    assert node.actions() == [("state", NodeState.FINISHED), ("finish",)]


def test_the_node_s_state_follows_its_workers_in_place(node: ScriptedNode, controller: Controller) -> None:
    seen = []
    for phases, in_place in (
        ([Phase.JOINING], True),
        ([Phase.LOADING], True),
        ([Phase.TRAINING], True),
        ([Phase.LOADING], False),  # a cold worker resuming from its checkpoint: running
    ):
        node.phases, node.in_place = phases, in_place
        controller.step()
        seen.append(controller.state)
    assert seen == [NodeState.JOINING, NodeState.REFORMING, NodeState.RUNNING, NodeState.RUNNING]
    assert [c[1] for c in node.actions() if c[0] == "state"] == [
        NodeState.JOINING,
        NodeState.REFORMING,
        NodeState.RUNNING,
    ]  # published on change only


def test_stragglers_are_checked_on_their_own_interval_while_healthy(
    node: ScriptedNode, clock: Clock, controller: Controller
) -> None:
    for _ in range(5):
        controller.step()
        clock.now += 0.5
    assert [c for c in node.calls if c[0] == "stragglers"] == [("stragglers", 100.0), ("stragglers", 102.0)]
    node.results = [failed(1)]
    clock.now += 5
    node.calls.clear()
    controller.step()
    assert not any(c[0] == "stragglers" for c in node.calls)
