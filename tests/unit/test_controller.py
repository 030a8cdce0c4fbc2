"""The supervisor's loop, stepped over a small fake per port and a fake clock: no process, no etcd, no rendezvous.

Each test sets what the node observes, calls :meth:`Controller.step` and checks what the controller did, in order
(the fakes share one record), and the :class:`Outcome` a terminal step returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from elasticd.agent.controller import Controller, NodeState, Signals
from elasticd.agent.policy import Decision, GroupState, HangReport
from elasticd.agent.reports import Fatal
from elasticd.board import Phase
from elasticd.errors import EXIT_GAVE_UP, EXIT_OK, EXIT_REJOIN


def failed(*exitcodes: int) -> RunResult:
    failures = {rank: ProcessFailure(rank, 1000 + rank, code, "") for rank, code in enumerate(exitcodes)}
    return RunResult(state=WorkerState.FAILED, failures=failures)


class Script:
    """What the fakes were asked, in order: ``calls`` (acts and diagnoses) and ``reads`` (polled observations)."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.reads: list[str] = []

    def actions(self) -> list[tuple[Any, ...]]:
        """The calls that change something (not the straggler checks, which run on their own clock)."""
        return [c for c in self.calls if c[0] != "stragglers"]


class FakeWorkers:
    """The local worker group: ``results`` is what monitor() returns, in turn (then the last one again)."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.results: list[RunResult] = []
        self.restarts = 3
        self.leaves_in_place = False

    def monitor(self) -> RunResult:
        self.script.reads.append("monitor")
        if len(self.results) > 1:
            return self.results.pop(0)
        return self.results[0] if self.results else RunResult(state=WorkerState.HEALTHY)

    def restarts_left(self) -> int:
        return self.restarts

    def log_failures(self, result: RunResult) -> None:
        self.script.calls.append(("log_failures",))

    def checkpoint_first(self, reason: str) -> None:
        self.script.calls.append(("checkpoint_first", reason))

    def leave_in_place(self) -> bool:
        self.script.calls.append(("leave_in_place",))
        return self.leaves_in_place

    def kill(self) -> None:
        self.script.calls.append(("kill",))

    def restart(self, decision: Decision, nodes_waiting: int) -> None:
        self.script.calls.append(("restart", decision.reason, decision.counts_as_restart))
        if decision.counts_as_restart:
            self.restarts -= 1

    def finish(self) -> None:
        self.script.calls.append(("finish",))

    def drain(self, *, leave: bool) -> RunResult:
        self.script.calls.append(("drain", leave))
        return RunResult(state=WorkerState.SUCCEEDED)

    def give_up(self, decision: Decision, result: RunResult) -> RunResult:
        self.script.calls.append(("give_up", decision.reason))
        return RunResult(state=WorkerState.FAILED, failures=result.failures)


class FakeReports:
    def __init__(self) -> None:
        self.fatal: Fatal | None = None
        self.saved = False
        self.in_place = True

    def all_saved(self) -> bool:
        return self.saved

    def all_in_place(self) -> bool:
        return self.in_place


class FakeRun:
    node_id = "n0"

    def __init__(self, script: Script) -> None:
        self.script = script
        self.drain_wanted = False
        self.lost = False
        self.joining = False
        self.waiting = 0
        self.resize = False

    def drain_requested(self) -> bool:
        self.script.reads.append("drain")
        return self.drain_wanted

    def lineage_lost(self) -> bool:
        return self.lost

    def waiting_to_join(self) -> bool:
        return self.joining

    def nodes_waiting(self) -> int:
        self.script.reads.append("waiting")
        return self.waiting

    def resize_needed(self, state: GroupState, failures: dict[int, Any]) -> bool:
        return self.resize

    def check_stragglers(self, now: float) -> None:
        self.script.calls.append(("stragglers", now))

    def publish_state(self, state: NodeState) -> None:
        self.script.calls.append(("state", state))


class FakeHangs:
    def __init__(self, script: Script) -> None:
        self.script = script
        self.silent: Any = None  # the watchdog's suspicion
        self.claim: str | None = None
        self.report: HangReport | None = None
        self.exits = False
        self.slots: list[Phase] = [Phase.TRAINING]

    def suspicion(self) -> Any | None:
        return self.silent

    def peer_claim(self) -> str | None:
        self.script.reads.append("claim")
        return self.claim

    def diagnose(self, suspicion: Any | None) -> HangReport | None:
        self.script.calls.append(("diagnose", suspicion))
        return self.report

    def exiting(self) -> bool:
        return self.exits

    def phases(self) -> Sequence[Phase]:
        return self.slots

    def leave_to_culprits(self, hang: HangReport) -> None:
        self.script.calls.append(("left_to_culprits", hang.culprit_nodes))

    def tell_group(self, hang: HangReport) -> None:
        self.script.calls.append(("tell_group", hang.culprit_nodes))


class Node:
    """One scripted node: a fake per port, sharing one record of what was asked."""

    def __init__(self) -> None:
        self.script = Script()
        self.workers = FakeWorkers(self.script)
        self.reports = FakeReports()
        self.run = FakeRun(self.script)
        self.hangs = FakeHangs(self.script)
        self.signals = Signals()

    def actions(self) -> list[tuple[Any, ...]]:
        return self.script.actions()


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def node() -> Node:
    return Node()


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def controller(node: Node, clock: Clock) -> Controller:
    return Controller(
        workers=node.workers,
        reports=node.reports,
        run=node.run,
        hangs=node.hangs,
        signals=node.signals,
        clock=clock,
    )


def test_a_healthy_step_does_nothing_and_goes_on(node: Node, controller: Controller) -> None:
    assert controller.step() is None
    assert node.actions() == []
    assert controller.state is NodeState.RUNNING
    assert node.signals.graceful  # a signal may wait for a clean leave while the workers train


def test_a_failed_worker_restarts_the_group_while_restarts_last_then_gives_up(
    node: Node, controller: Controller
) -> None:
    node.workers.results = [failed(1)]
    node.workers.restarts = 1
    assert controller.step() is None
    assert node.actions() == [
        ("log_failures",),
        ("state", NodeState.RESTARTING),
        ("restart", "failure", True),
    ]
    assert controller.state is NodeState.RUNNING  # the new round publishes its own states
    assert not node.signals.graceful  # unplanned: a signal while the group restarts ends the daemon at once
    node.script.calls.clear()
    outcome = controller.step()
    assert outcome is not None and outcome.state is WorkerState.FAILED
    assert (outcome.node_state, outcome.exit_code, outcome.leaves) == (NodeState.FAILED, EXIT_GAVE_UP, True)
    assert outcome.message and outcome.node_state.terminal
    assert node.actions() == [("log_failures",), ("state", NodeState.FAILED), ("give_up", "failure")]


def test_a_fatal_report_stops_the_node_with_the_workers_exit_code(node: Node, controller: Controller) -> None:
    node.reports.fatal = Fatal("nan", "non-finite loss beyond --on-nan", 3)
    outcome = controller.step()
    assert outcome is not None and outcome.state is WorkerState.FAILED
    assert (outcome.node_state, outcome.exit_code) == (NodeState.FAILED, 3)
    assert outcome.message == "non-finite loss beyond --on-nan"
    assert node.actions()[-1] == ("give_up", "fatal")


def test_a_join_takes_a_checkpoint_first_and_costs_no_restart(node: Node, controller: Controller) -> None:
    node.run.waiting = 1
    assert controller.step() is None
    assert node.actions() == [
        ("checkpoint_first", "membership"),
        ("state", NodeState.RESTARTING),
        ("restart", "membership", False),
    ]
    assert node.signals.graceful  # planned: a signal meanwhile still waits for a clean leave
    node.run.waiting = 0
    node.script.calls.clear()
    controller.step()
    assert node.actions() == []  # nothing more once the node joined


def test_a_worker_on_its_way_out_is_not_joined_first(node: Node, controller: Controller) -> None:
    node.hangs.exits, node.run.waiting = True, 1
    controller.step()
    assert "waiting" not in node.script.reads  # the join waits for the failure about to be reported
    assert node.actions() == []


def test_a_drain_request_is_read_once_per_control_interval(node: Node, clock: Clock, controller: Controller) -> None:
    controller.step()
    node.run.drain_wanted = True
    clock.now += 0.5
    assert controller.step() is None
    assert node.script.reads.count("drain") == 1 and node.actions() == []  # not read again before the interval
    clock.now += 0.5
    outcome = controller.step()
    assert outcome is not None and outcome.state is WorkerState.SUCCEEDED
    assert (outcome.node_state, outcome.exit_code, outcome.leaves) == (NodeState.DRAINING, EXIT_OK, False)
    assert node.actions() == [("checkpoint_first", "drain"), ("state", NodeState.DRAINING), ("drain", False)]


def test_a_checkpoint_a_peer_asked_for_reads_the_drain_at_once_and_drains(
    node: Node, clock: Clock, controller: Controller
) -> None:
    controller.step()
    # `elasticd stop`: a peer saw the request first and asked for the drain's checkpoint, which every local worker
    # saved before this node's next control poll
    node.run.drain_wanted, node.reports.saved = True, True
    clock.now += 0.1
    outcome = controller.step()
    assert outcome is not None and (outcome.node_state, outcome.exit_code) == (NodeState.DRAINING, EXIT_OK)
    assert node.actions() == [("checkpoint_first", "drain"), ("state", NodeState.DRAINING), ("drain", False)]


def test_a_checkpoint_a_peer_asked_for_without_a_drain_is_a_join(
    node: Node, clock: Clock, controller: Controller
) -> None:
    controller.step()
    node.reports.saved = True
    clock.now += 0.1
    assert controller.step() is None
    assert node.actions() == [
        ("checkpoint_first", "membership"),
        ("state", NodeState.RESTARTING),
        ("restart", "membership", False),
    ]


def test_sigterm_leaves_in_place_without_a_checkpoint_when_the_workers_can(node: Node, controller: Controller) -> None:
    node.signals.leave_requested, node.workers.leaves_in_place = True, True
    outcome = controller.step()
    assert outcome is not None and (outcome.node_state, outcome.exit_code) == (NodeState.DRAINING, EXIT_OK)
    assert outcome.leaves  # this node alone: the others go on
    assert node.actions() == [("leave_in_place",), ("state", NodeState.DRAINING), ("drain", True)]


def test_sigterm_takes_a_checkpoint_first_when_leaving_in_place_did_not_work(
    node: Node, controller: Controller
) -> None:
    node.signals.leave_requested = True
    controller.step()
    assert node.actions() == [
        ("leave_in_place",),
        ("checkpoint_first", "drain"),
        ("state", NodeState.DRAINING),
        ("drain", True),
    ]


def test_a_hang_whose_culprit_is_here_tells_the_group_kills_and_restarts(node: Node, controller: Controller) -> None:
    node.hangs.silent = "rank 0 silent"
    node.hangs.report = HangReport(step=7, attempt=1, path="/d/20261130-hang", culprits=(0,), culprit_nodes=("n0",))
    controller.step()
    assert node.actions() == [
        ("diagnose", "rank 0 silent"),
        ("tell_group", ("n0",)),
        ("kill",),
        ("state", NodeState.RESTARTING),
        ("restart", "hang", True),
    ]


def test_a_hang_whose_culprits_are_elsewhere_is_left_to_them_in_place(node: Node, controller: Controller) -> None:
    node.hangs.silent = "rank 0 silent"
    node.hangs.report = HangReport(step=7, attempt=1, path="/d/h", culprits=(2,), culprit_nodes=("n1",))
    assert controller.step() is None
    assert node.actions() == [("diagnose", "rank 0 silent"), ("left_to_culprits", ("n1",))]
    node.reports.in_place = False  # cold workers cannot re-form: the whole group restarts
    node.script.calls.clear()
    controller.step()
    assert ("restart", "hang", True) in node.actions() and ("kill",) in node.actions()


def test_a_peer_s_hang_claim_is_acted_on_once(node: Node, clock: Clock, controller: Controller) -> None:
    node.hangs.claim = "20261130-hang"
    node.hangs.report = HangReport(step=7, attempt=1, path=f"/d/{node.hangs.claim}", culprit_nodes=("n1",))
    controller.step()
    assert ("diagnose", None) in node.actions()
    node.script.calls.clear()
    clock.now += 1.0
    controller.step()
    assert node.script.reads.count("claim") == 2  # read again, and known
    assert node.actions() == []


def test_a_node_waiting_to_join_in_place_takes_no_part_in_the_group_s_hangs(node: Node, controller: Controller) -> None:
    node.run.joining, node.hangs.claim = True, "20261130-hang"
    controller.step()
    assert "claim" not in node.script.reads and node.actions() == []


def test_a_worker_that_exited_during_an_uncounted_hang_is_a_failure_not_a_hang(
    node: Node, controller: Controller
) -> None:
    node.workers.results = [RunResult(state=WorkerState.HEALTHY), failed(1)]
    node.hangs.silent = "rank 0 silent"
    node.hangs.report = HangReport(step=7, attempt=0, path="", culprit_nodes=("n0",))  # a lost node: not counted
    controller.step()
    actions = node.actions()
    assert ("restart", "failure", True) in actions
    assert ("kill",) not in actions and not any(a[0] == "tell_group" for a in actions)


def test_a_lost_lineage_restarts_without_a_checkpoint_or_a_counted_restart(node: Node, controller: Controller) -> None:
    node.run.lost = True
    controller.step()
    assert node.actions() == [("state", NodeState.RESTARTING), ("restart", "membership", False)]


def test_workers_that_could_not_join_in_place_go_through_the_rendezvous_for_free(
    node: Node, controller: Controller
) -> None:
    node.workers.results = [failed(EXIT_REJOIN)]
    controller.step()
    assert node.actions() == [("log_failures",), ("state", NodeState.RESTARTING), ("restart", "membership", False)]
    node.workers.results = [failed(EXIT_REJOIN, 1)]  # one of them failed for real: counted
    node.script.calls.clear()
    controller.step()
    assert ("restart", "failure", True) in node.actions()


def test_finished_workers_finish_the_node(node: Node, controller: Controller) -> None:
    done = RunResult(state=WorkerState.SUCCEEDED, return_values={0: None, 1: None})
    node.workers.results = [done]
    outcome = controller.step()
    assert outcome is not None and (outcome.state, outcome.return_values) == (done.state, done.return_values)
    assert (outcome.node_state, outcome.exit_code, outcome.leaves) == (NodeState.FINISHED, EXIT_OK, False)
    assert node.actions() == [("state", NodeState.FINISHED), ("finish",)]


def test_the_node_s_state_follows_its_workers_in_place(node: Node, controller: Controller) -> None:
    seen = []
    for phases, in_place in (
        ([Phase.JOINING], True),
        ([Phase.LOADING], True),
        ([Phase.TRAINING], True),
        ([Phase.LOADING], False),  # a cold worker resuming from its checkpoint: running
    ):
        node.hangs.slots, node.reports.in_place = phases, in_place
        controller.step()
        seen.append(controller.state)
    assert seen == [NodeState.JOINING, NodeState.REFORMING, NodeState.RUNNING, NodeState.RUNNING]
    assert [c[1] for c in node.actions() if c[0] == "state"] == [
        NodeState.JOINING,
        NodeState.REFORMING,
        NodeState.RUNNING,
    ]  # published on change only


def test_stragglers_are_checked_on_their_own_interval_while_healthy(
    node: Node, clock: Clock, controller: Controller
) -> None:
    for _ in range(5):
        controller.step()
        clock.now += 0.5
    assert [c for c in node.script.calls if c[0] == "stragglers"] == [("stragglers", 100.0), ("stragglers", 102.0)]
    node.workers.results = [failed(1)]
    clock.now += 5
    node.script.calls.clear()
    controller.step()
    assert not any(c[0] == "stragglers" for c in node.script.calls)


def test_only_the_ends_of_the_loop_are_terminal() -> None:
    ends = {state for state in NodeState if state.terminal}
    assert ends == {NodeState.FINISHED, NodeState.DRAINING, NodeState.FAILED}
