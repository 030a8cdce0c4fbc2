"""Every Prometheus metric elasticd exports (DESIGN.md §3), defined in this one place, and the HTTP endpoint.

The registry is injected: the daemon builds one :class:`Metrics` on a fresh ``CollectorRegistry`` and tests do the
same. Labels stay low-cardinality (no run id, no error text). Known label values are exported as zero at start-up
so that rates and alerts have a series from the first scrape.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from elasticd import options as o
from elasticd.errors import ConfigError

RESTART_REASONS = ("failure", "hang", "nan", "membership", "drain")
NONFINITE_ACTIONS = ("skip", "rollback", "stop")
CHECKPOINT_FAILURE_REASONS = ("fenced", "error")
CHECKPOINT_PHASES = ("blocking", "total")
# Hot recovery (beyond DESIGN.md §3's minimum set): why the group re-formed in place, and why a worker gave the hot
# path up for the cold restart ("unsupported:<what>" counts as unsupported; a reason not listed here, as other).
RECONFIGURATION_REASONS = ("failure", "hang", "join", "leave")
HOT_FALLBACK_REASONS = (
    "below_minimum",
    "reform_failed",
    "heal_failed",
    "batch_plan",
    "excluded",
    "decision_timeout",
    "etcd",
    "unsupported",
    "no_mirror",
    "other",
)

# Seconds; spans a rendezvous on one host (~0.1 s) to a slow cluster formation (minutes).
_RDZV_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 3, 5, 8, 13, 20, 30, 60, 120, 300)
# Seconds; a 10 ms CPU step to a 2 min step of a large model.
_STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_CKPT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_RECOVERY_BUCKETS = (1, 2, 3, 5, 8, 10, 15, 20, 30, 45, 60, 120, 300, 600)
# Seconds; an in-place re-formation takes 0.1-2 s (issue 11's targets: 0.5 s node loss, 1.5 s hang, 2 s vanished
# node are bucket edges, so quantiles near them are exact) and 30 s is far beyond what the hot path should need.
_RECONFIG_BUCKETS = (0.05, 0.1, 0.25, 0.5, 0.75, 1, 1.5, 2, 3, 5, 10, 20, 30)


@dataclass(frozen=True, slots=True)
class Metrics:
    """The daemon's metric objects, all on ``registry``."""

    registry: CollectorRegistry
    info: Gauge
    nodes: Gauge
    min_nodes: Gauge
    max_nodes: Gauge
    world_size: Gauge
    spare: Gauge
    rendezvous_total: Counter
    rendezvous_duration_seconds: Histogram
    worker_restarts_total: Counter
    training_step: Gauge
    training_loss: Gauge
    training_samples_total: Counter
    step_duration_seconds: Histogram
    last_progress_timestamp_seconds: Gauge
    hangs_total: Counter
    hang_timeout_seconds: Gauge
    stragglers_total: Counter
    nonfinite_steps_total: Counter
    checkpoint_duration_seconds: Histogram
    checkpoint_last_step: Gauge
    checkpoint_last_success_timestamp_seconds: Gauge
    checkpoint_failures_total: Counter
    fence_token_failures_total: Counter
    recovery_duration_seconds: Histogram
    lost_steps_total: Counter
    goodput_ratio: Gauge
    etcd_errors_total: Counter
    reconfigurations_total: Counter
    reconfiguration_duration_seconds: Histogram
    heal_bytes_total: Counter
    membership_epoch: Gauge
    hot_fallbacks_total: Counter
    shard_mirror_seconds: Histogram
    shard_mirror_bytes_total: Counter

    @classmethod
    def create(
        cls,
        registry: CollectorRegistry | None = None,
        *,
        version: str = "",
        node: str = "",
        min_nodes: int = 0,
        max_nodes: int = 0,
    ) -> Metrics:
        """All metrics on ``registry``; ``min_nodes``/``max_nodes`` are the configured elastic range (0: unknown)."""
        reg = registry if registry is not None else CollectorRegistry()
        kw: dict[str, Any] = {"registry": reg}
        m = cls(
            registry=reg,
            info=Gauge("elasticd_info", "Always 1; labels carry the version and node.", ["version", "node"], **kw),
            nodes=Gauge("elasticd_nodes", "Nodes in the current rendezvous round.", **kw),
            # The elastic range as configured, so that dashboards and alerts compare elasticd_nodes against it.
            min_nodes=Gauge("elasticd_min_nodes", "Fewest nodes the run trains with (--min-nodes).", **kw),
            max_nodes=Gauge("elasticd_max_nodes", "Most nodes the run grows to (--max-nodes).", **kw),
            world_size=Gauge("elasticd_world_size", "Workers in the current rendezvous round.", **kw),
            spare=Gauge(
                "elasticd_spare",
                "1 while this node waits as a spare (the round's node count does not split the global batch), else 0.",
                **kw,
            ),
            rendezvous_total=Counter("elasticd_rendezvous", "Completed rendezvous rounds.", **kw),
            rendezvous_duration_seconds=Histogram(
                "elasticd_rendezvous_duration_seconds", "Time to form a round.", buckets=_RDZV_BUCKETS, **kw
            ),
            worker_restarts_total=Counter(
                "elasticd_worker_restarts", "Worker group restarts by reason.", ["reason"], **kw
            ),
            training_step=Gauge("elasticd_training_step", "Last completed optimizer step.", **kw),
            training_loss=Gauge("elasticd_training_loss", "Last reported loss.", **kw),
            training_samples_total=Counter("elasticd_training_samples", "Samples processed by this node.", **kw),
            step_duration_seconds=Histogram(
                "elasticd_step_duration_seconds", "Optimizer step wall time.", buckets=_STEP_BUCKETS, **kw
            ),
            last_progress_timestamp_seconds=Gauge(
                "elasticd_last_progress_timestamp_seconds", "Unix time of the last completed step.", **kw
            ),
            hangs_total=Counter("elasticd_hangs", "Hangs detected.", **kw),
            hang_timeout_seconds=Gauge(
                "elasticd_hang_timeout_seconds", "No-progress timeout in force (fixed, or learned by auto).", **kw
            ),
            stragglers_total=Counter(
                "elasticd_stragglers", "Ranks reported slower than the group median for a sustained window.", **kw
            ),
            nonfinite_steps_total=Counter(
                "elasticd_nonfinite_steps", "Non-finite loss or gradient events by action.", ["action"], **kw
            ),
            checkpoint_duration_seconds=Histogram(
                "elasticd_checkpoint_duration_seconds",
                "Checkpoint save time.",
                ["phase"],
                buckets=_CKPT_BUCKETS,
                **kw,
            ),
            checkpoint_last_step=Gauge("elasticd_checkpoint_last_step", "Step of the last committed checkpoint.", **kw),
            checkpoint_last_success_timestamp_seconds=Gauge(
                "elasticd_checkpoint_last_success_timestamp_seconds",
                "Commit time of the last checkpoint.",
                **kw,
            ),
            checkpoint_failures_total=Counter(
                "elasticd_checkpoint_failures",
                "Checkpoint saves that did not commit: fenced (a stale writer refused) or error (an I/O error).",
                ["reason"],
                **kw,
            ),
            fence_token_failures_total=Counter(
                "elasticd_fence_token_failures",
                "Rounds whose fencing token could not be written (they start no workers and are formed again).",
                **kw,
            ),
            recovery_duration_seconds=Histogram(
                "elasticd_recovery_duration_seconds",
                "Fault detected to the first completed step after the restart.",
                buckets=_RECOVERY_BUCKETS,
                **kw,
            ),
            lost_steps_total=Counter("elasticd_lost_steps", "Steps redone after a restart.", **kw),
            goodput_ratio=Gauge(
                "elasticd_goodput_ratio", "Productive step time over wall time since the run started.", **kw
            ),
            etcd_errors_total=Counter("elasticd_etcd_errors", "Failed etcd calls.", **kw),
            reconfigurations_total=Counter(
                "elasticd_reconfigurations", "In-place re-formations of the process group by reason.", ["reason"], **kw
            ),
            reconfiguration_duration_seconds=Histogram(
                "elasticd_reconfiguration_duration_seconds",
                "Fault detected to the first completed step at the new size, re-formed in place.",
                buckets=_RECONFIG_BUCKETS,
                **kw,
            ),
            heal_bytes_total=Counter(
                "elasticd_heal_bytes", "Bytes this node's workers sent or received to heal members in place.", **kw
            ),
            membership_epoch=Gauge("elasticd_membership_epoch", "Membership epoch in force (hot recovery).", **kw),
            hot_fallbacks_total=Counter(
                "elasticd_hot_fallbacks",
                "Times the hot path gave up and the workers restarted cold, by reason.",
                ["reason"],
                **kw,
            ),
            shard_mirror_seconds=Histogram(
                "elasticd_shard_mirror_seconds",
                "A sharded job's shard mirror per generation and worker: blocking (the step waits: copy, and the"
                " previous generation still in flight) and total (to the end of the exchange with the ring peers).",
                ["phase"],
                buckets=_CKPT_BUCKETS,
                **kw,
            ),
            shard_mirror_bytes_total=Counter(
                "elasticd_shard_mirror_bytes", "Bytes this node's workers sent to their ring peers' mirrors.", **kw
            ),
        )
        m.info.labels(version=version, node=node).set(1)
        m.min_nodes.set(min_nodes)
        m.max_nodes.set(max_nodes)
        for reason in RESTART_REASONS:
            m.worker_restarts_total.labels(reason=reason)
        for action in NONFINITE_ACTIONS:
            m.nonfinite_steps_total.labels(action=action)
        for phase in CHECKPOINT_PHASES:
            m.checkpoint_duration_seconds.labels(phase=phase)
            m.shard_mirror_seconds.labels(phase=phase)
        for reason in CHECKPOINT_FAILURE_REASONS:
            m.checkpoint_failures_total.labels(reason=reason)
        for reason in RECONFIGURATION_REASONS:
            m.reconfigurations_total.labels(reason=reason)
        for reason in HOT_FALLBACK_REASONS:
            m.hot_fallbacks_total.labels(reason=reason)
        return m


class MetricsServer:
    """The HTTP endpoint serving one registry; ``port`` 0 in tests asks the OS for a free port."""

    def __init__(self, registry: CollectorRegistry, addr: str, port: int) -> None:
        try:
            self._server, self._thread = start_http_server(port, addr=addr, registry=registry)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ConfigError(o.METRICS_PORT.flag, f"port {port} on {addr} is already in use") from None
            raise ConfigError(o.METRICS_ADDR.flag, f"cannot serve metrics on {addr}:{port}: {exc.strerror}") from None
        self.addr = addr
        self.port: int = self._server.server_address[1]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
