"""What the supervisor loop does to this node's worker group (the controller's :class:`~.controller.Workers` port).

Each act is what torch's own loop would do (monitor, restart, stop: through :class:`~.workers.LocalWorkers`) plus
what elasticd adds to it: a checkpoint asked of the workers before a planned change, a clean leave in place under
hot recovery, the restart's metric, registry note and event, and the ``RunResult`` torch's ``run()`` expects.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from typing import Any

from torch.distributed.elastic.agent.server.api import RunResult, WorkerState

from elasticd.agent.controller import group_state
from elasticd.agent.policy import Decision, GroupState
from elasticd.agent.polling import EtcdPoll
from elasticd.agent.progress import ProgressTracker
from elasticd.agent.registry import NodeRegistry
from elasticd.agent.reports import WorkerReports
from elasticd.agent.round import RoundState
from elasticd.agent.spares import Sizing
from elasticd.agent.workers import LocalWorkers
from elasticd.metrics import Metrics


class GroupActions:
    """The controller's hands on the local worker group."""

    def __init__(
        self,
        workers: LocalWorkers,
        *,
        node_id: str,
        round_state: RoundState,
        reports: WorkerReports,
        progress: ProgressTracker,
        sizing: Sizing,
        metrics: Metrics,
        registry: NodeRegistry,
        log: Callable[[], Any],
        poll: EtcdPoll,
        checkpoint_timeout_s: float,
        announce_leaving: Callable[[], None] | None = None,
        group_nodes: Callable[[], list[str] | None] | None = None,
    ) -> None:
        self._workers = workers
        self._node_id = node_id
        self._round = round_state
        self._reports = reports
        self._progress = progress
        self._sizing = sizing
        self._metrics = metrics
        self._registry = registry
        self._log = log
        self._poll = poll
        self._checkpoint_timeout_s = checkpoint_timeout_s
        self._announce_leaving = announce_leaving  # hot recovery: this node's workers leave their group in place
        self._group_nodes = group_nodes  # the nodes of the group that trains in place now (None: none does)

    def monitor(self) -> RunResult:
        return self._workers.monitor()

    def restarts_left(self) -> int:
        return self._workers.restarts_left

    def log_failures(self, result: RunResult) -> None:
        for global_rank, failure in sorted(result.failures.items()):
            self._log().warning(
                "worker_failed",
                rank=global_rank,
                local_rank=failure.local_rank,
                pid=failure.pid,
                exitcode=failure.exitcode,
                signal=failure.signal_name() if failure.exitcode < 0 else None,
            )

    def checkpoint_first(self, reason: str) -> None:
        """Before a planned change: ask the workers for a checkpoint and wait until every local one has saved it.

        Only workers that announced the protocol (``hello``) are asked; any others are stopped at once, as torch
        would. A peer node may have asked already (its request reaches every rank): then the answer is here.
        """
        reports, log = self._reports, self._log()
        if not reports.all_saved():
            if not reports.all_capable():
                return
            log.info("checkpoint_requested", reason=reason, pids=list(self._workers.pids().values()))
            self._workers.signal_all(signal.SIGUSR2)

            def saved_or_unhealthy() -> bool | None:
                if reports.all_saved():
                    return True
                return False if group_state(self._workers.poll()) is not GroupState.HEALTHY else None

            self._workers.wait_for(saved_or_unhealthy, self._checkpoint_timeout_s)
        step = reports.saved_step()
        fenced = reports.saved_but_fenced()
        if fenced is not None:
            # not a success: the restart resumes from the last committed checkpoint and redoes the steps since
            log.warning("checkpoint_request_fenced", reason=reason, step=fenced)
        elif step is None:
            log.warning("checkpoint_request_unanswered", reason=reason, timeout_s=self._checkpoint_timeout_s)
        else:
            log.info("checkpoint_saved", reason=reason, step=step)
        reports.clear_saved()

    def leave_in_place(self) -> bool:
        """SIGTERM under hot recovery: this node's workers leave the group at a step boundary it agrees on, and the
        others train on in place; no checkpoint first, nothing restarts. True when every local worker left (exit 0);
        False (nothing asked, or they did not leave in time) keeps today's path: checkpoint, stop, leave."""
        announce, group_nodes = self._announce_leaving, self._group_nodes
        if announce is None or group_nodes is None or not self._reports.all_in_place():
            return False
        nodes = self._poll(group_nodes, None)
        if not nodes or self._node_id not in nodes or len(nodes) - 1 < self._sizing.min_nodes:
            return False  # not a member, or the rest would be too few: the cold path stops the group
        if not self._poll(lambda: (announce(), True)[1], False):
            return False
        self._log().info("leaving_in_place", group_nodes=nodes)
        ended = {GroupState.SUCCEEDED: True, GroupState.FAILED: False}
        left = self._workers.wait_for(lambda: ended.get(group_state(self._workers.poll())), self._checkpoint_timeout_s)
        if left is None:
            self._log().warning("leave_in_place_unanswered", timeout_s=self._checkpoint_timeout_s)
            return False
        return left

    def kill(self) -> None:
        self._workers.kill()

    def restart(self, decision: Decision, nodes_waiting: int) -> None:
        self._round.restarting()
        self._progress.fault()
        if decision.counts_as_restart:
            self._workers.count_restart()
        self._metrics.worker_restarts_total.labels(reason=decision.reason).inc()
        self._registry.note("restart", reason=decision.reason)
        self._log().info(
            "restart",
            reason=decision.reason,
            restarts_left=self._workers.restarts_left,
            nodes_waiting=nodes_waiting,
        )
        self._workers.restart()

    def finish(self) -> None:
        self._log().info("workers_finished")
        self._workers.exit_barrier()

    def drain(self, *, leave: bool) -> RunResult:
        self._log().info("draining", scope="node" if leave else "run")
        self._metrics.worker_restarts_total.labels(reason="drain").inc()
        self._workers.stop(WorkerState.STOPPED)
        # torch's run() records an event per worker and expects each in the result.
        stopped = {w.global_rank: None for w in self._workers.workers}
        return RunResult(state=WorkerState.SUCCEEDED, return_values=stopped)

    def give_up(self, decision: Decision, result: RunResult) -> RunResult:
        self._log().error("gave_up", reason=decision.reason, message=decision.message)
        self._workers.stop(WorkerState.FAILED)
        # torch's run() records an event per worker: each must be a failure or a return value.
        others = {w.global_rank: None for w in self._workers.workers if w.global_rank not in result.failures}
        return RunResult(state=WorkerState.FAILED, failures=result.failures, return_values=others)
