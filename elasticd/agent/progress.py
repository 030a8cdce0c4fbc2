"""Beats into figures: metrics, the registry's last step, recovery time and lost steps.

:meth:`ProgressTracker.on_beat` runs on the beat receiver's thread for every beat of every local worker. The
supervisor tells it when a fault happened (:meth:`fault`) so that the first step after the restart closes a
recovery measurement, and how far training had got (``last_step``) so that the step the workers resume from tells
how many steps were lost.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Any

from elasticd.agent.registry import NodeRegistry
from elasticd.agent.reports import WorkerReports
from elasticd.agent.stragglers import StragglerDetector
from elasticd.messages import FatalReason, Kind, kind_of
from elasticd.metrics import Metrics

# Seconds between registry writes of the last step: status stays fresh without one etcd put per step.
REGISTRY_STEP_INTERVAL_S = 2.0


class ProgressTracker:
    def __init__(
        self,
        metrics: Metrics,
        registry: NodeRegistry,
        reports: WorkerReports,
        log: Callable[[], Any],
        clock: Callable[[], float] = time.monotonic,
        stragglers: StragglerDetector | None = None,
    ) -> None:
        self._metrics = metrics
        self._registry = registry
        self.reports = reports
        self._log = log
        self._clock = clock
        self._stragglers = stragglers
        self._lock = threading.Lock()
        self._fault_at: float | None = None
        self._step_before_fault: int | None = None
        self._registry_written = -REGISTRY_STEP_INTERVAL_S
        self._started = clock()
        self._productive_s = 0.0
        # productive time counts each step once: steps redone after a restart (below the high-water mark) are lost
        self._high_water = 0
        self._beat_step = 0  # local rank 0's step at its previous beat (or its resume)
        self._failed_step: int | None = None  # the last save reported failed: counted once, whichever ranks report

    def fault(self) -> None:
        """A restart begins: the recovery clock starts, and the last step reached is remembered."""
        with self._lock:
            if self._fault_at is None:
                self._fault_at = self._clock()
            self._step_before_fault = self.reports.last_step

    def on_beat(self, beat: dict[str, Any]) -> None:
        self.reports.on_beat(beat)
        kind = kind_of(beat)
        m = self._metrics
        if kind is Kind.STEP and isinstance(beat.get("step"), int):
            self._on_step(beat)
        elif kind is Kind.RESUMED and beat.get("local_rank", 0) == 0:
            with self._lock:
                before, self._step_before_fault = self._step_before_fault, None
                if isinstance(beat.get("step"), int):
                    self._beat_step = beat["step"]
            if before is not None and isinstance(beat.get("step"), int) and before > beat["step"]:
                m.lost_steps_total.inc(before - beat["step"])
        elif kind is Kind.NONFINITE and beat.get("local_rank", 0) == 0:
            action = str(beat.get("action"))
            if action in ("skip", "rollback", "stop"):
                m.nonfinite_steps_total.labels(action=action).inc()
        elif kind is Kind.FATAL and beat.get("reason") == FatalReason.NAN and beat.get("local_rank", 0) == 0:
            m.nonfinite_steps_total.labels(action="stop").inc()
        elif kind is Kind.CHECKPOINT_COMMITTED:
            m.checkpoint_last_step.set(int(beat.get("step", 0)))
            m.checkpoint_last_success_timestamp_seconds.set(float(beat.get("ts", time.time())))
            for phase, key in (("blocking", "blocking_s"), ("total", "total_s")):
                if isinstance(beat.get(key), int | float):
                    m.checkpoint_duration_seconds.labels(phase=phase).observe(beat[key])
        elif kind is Kind.CHECKPOINT_FAILED:
            self._checkpoint_failed(beat)
        elif kind is Kind.CHECKPOINT_FENCED:
            m.checkpoint_failures_total.labels(reason="fenced").inc()
            self._log().warning("checkpoint_fenced", step=beat.get("step"))
        elif kind is Kind.CHECKPOINT_DEFERRED:
            # not a failure (yet): it commits once etcd answers, or a checkpoint_fenced/failed says otherwise
            self._log().warning(str(Kind.CHECKPOINT_DEFERRED), step=beat.get("step"), error=beat.get("error"))

    def _goodput(self, now: float) -> float:
        """Productive step time over wall time since the start (the node's view; elasticd_goodput_ratio)."""
        return min(1.0, self._productive_s / max(now - self._started, 1e-9))

    def _checkpoint_failed(self, beat: dict[str, Any]) -> None:
        """A worker's save failed: the daemon's event log says which rank, why (the OS error: errno, path) and that
        training goes on; the failure counts once per save, however many local ranks report it."""
        step = beat.get("step")
        self._log().warning(
            "checkpoint_failed",
            rank=beat.get("rank"),
            step=step,
            error=beat.get("error"),
            errno=beat.get("errno"),
            path=beat.get("path"),
            os_error=beat.get("os_error"),
        )
        with self._lock:
            first, self._failed_step = step != self._failed_step, step if isinstance(step, int) else None
        if first:
            self._metrics.checkpoint_failures_total.labels(reason="error").inc()

    def _on_step(self, beat: dict[str, Any]) -> None:
        m = self._metrics
        step = beat["step"]
        m.training_step.set(step)
        m.last_progress_timestamp_seconds.set(float(beat.get("ts", time.time())))
        if isinstance(beat.get("loss"), int | float):
            m.training_loss.set(beat["loss"])
        if isinstance(beat.get("samples"), int) and beat["samples"] > 0:
            m.training_samples_total.inc(beat["samples"])
        now = self._clock()
        own_s, step_s = beat.get("own_s"), beat.get("step_time_s")
        if self._stragglers is not None and isinstance(own_s, int | float) and isinstance(step_s, int | float):
            with self._lock:
                self._stragglers.observe(int(beat.get("rank", 0)), float(own_s), float(step_s), now)
        # Every local rank times the same optimizer step; one sample per node keeps the histogram a node's view.
        if beat.get("local_rank", 0) == 0 and isinstance(beat.get("step_time_s"), int | float):
            # beats come at most every 250 ms: step times are sampled, the training time since the last beat is whole
            m.step_duration_seconds.observe(beat["step_time_s"])
            with self._lock:
                span = step - self._beat_step
                new = step - max(self._beat_step, self._high_water)
                if span > 0 and new > 0:
                    self._productive_s += float(beat.get("train_s", beat["step_time_s"])) * new / span
                self._beat_step, self._high_water = step, max(self._high_water, step)
                m.goodput_ratio.set(self._goodput(now))
        with self._lock:
            fault_at, self._fault_at = self._fault_at, None
            write = now - self._registry_written >= REGISTRY_STEP_INTERVAL_S
            if write:
                self._registry_written = now
        if fault_at is not None:
            recovery_s = now - fault_at
            m.recovery_duration_seconds.observe(recovery_s)
            self._log().info("recovered", step=step, recovery_s=round(recovery_s, 3))
        if write:
            fields: dict[str, Any] = {"last_step": step, "goodput": round(self._goodput(now), 4)}
            for key, field in (("loss", "loss"), ("step_time_s", "step_s")):
                if isinstance(beat.get(key), int | float) and math.isfinite(beat[key]):
                    fields[field] = round(float(beat[key]), 6)
            self._registry.update(**fields)
