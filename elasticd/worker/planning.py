"""The global batch plan of a worker's loaders at the world size it trains in, and what a world that does not fit
means for the run: a resize through spares (exit :data:`~elasticd.errors.EXIT_RESIZE`) or a stop."""

from __future__ import annotations

from typing import Any, NoReturn

from elasticd.errors import EXIT_RESIZE, EXIT_USAGE, ConfigError
from elasticd.messages import FatalReason, Kind
from elasticd.worker.batching import BatchConstraint, BatchPlan, BatchPlanError, plan_batches
from elasticd.worker.beats import BeatClient
from elasticd.worker.settings import WorkerSettings


class TrainingStopped(SystemExit):
    """The run must stop (non-finite steps beyond the policy): exits the worker with code 1 and the message."""


class Planner:
    """Plans batches for this worker's node range (``settings``), and tells the daemon the run's constraint."""

    def __init__(self, settings: WorkerSettings, beats: BeatClient) -> None:
        self.settings = settings
        self.beats = beats

    def plan(self, global_batch_size: int, micro_batch_size: int, world_size: int, log: Any) -> BatchPlan:
        """The plan at ``world_size``; reported to the daemon, whose sizing decides from it which node counts train
        when a node comes or goes (``agent/spares.py``). A world that does not fit exits for a resize or stops."""
        try:
            plan = self.plan_for(global_batch_size, micro_batch_size, world_size)
        except BatchPlanError as exc:
            self._resize_or_stop(exc, world_size, log)
        except ConfigError as exc:
            # A restart would fail the same way: tell the daemon to stop the run with the usage exit code.
            self.beats.send(Kind.FATAL, reason=FatalReason.CONFIG, message=str(exc), exit_code=EXIT_USAGE)
            raise TrainingStopped(f"elasticd: error: {exc}") from None
        constraint = BatchConstraint(plan.global_batch_size, plan.micro_batch_size, self.settings.nproc_per_node)
        self.beats.send(Kind.BATCH_PLAN, **constraint.to_json())
        return plan

    def plan_for(self, global_batch_size: int, micro_batch_size: int, world_size: int) -> BatchPlan:
        """The plan at ``world_size`` (raises :class:`BatchPlanError` when no accumulation fits)."""
        s = self.settings
        return plan_batches(
            global_batch_size,
            micro_batch_size,
            world_size,
            nproc_per_node=s.nproc_per_node,
            min_nodes=s.min_nodes,
            max_nodes=s.max_nodes,
        )

    def _resize_or_stop(self, error: BatchPlanError, world_size: int, log: Any) -> NoReturn:
        """This world does not split the global batch. Under a daemon, when another node count of the range does,
        report the constraint and exit for the daemons to re-form with spares; otherwise the run cannot go on."""
        if error.fitting_nodes and self.beats.enabled:
            constraint = BatchConstraint(error.global_batch_size, error.micro_batch_size, self.settings.nproc_per_node)
            self.beats.send(Kind.BATCH_PLAN, **constraint.to_json())
            log.warning("resize_requested", world_size=world_size, fitting_nodes=list(error.fitting_nodes))
            raise SystemExit(EXIT_RESIZE)
        self.beats.send(Kind.FATAL, reason=FatalReason.CONFIG, message=str(error), exit_code=EXIT_USAGE)
        raise TrainingStopped(f"elasticd: error: {error}") from None
