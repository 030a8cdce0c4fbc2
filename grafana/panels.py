"""What the elasticd dashboard shows: its rows and panels, each a title, a description and PromQL queries.

Every query is on the metrics of DESIGN.md §3 (elasticd/metrics.py). Per-node panels join ``elasticd_info`` for the
node id and the ``node`` filter; run-level panels aggregate the run's daemons. :mod:`grafana.dashboard` turns these
specs into Grafana's JSON model; docs/operations.md describes each panel under the same title.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from grafana.promql import per_node, rate, run

# Grid units (24 columns wide): a stat is 4 wide, a graph half the width unless it needs more.
STAT_WIDTH, GRAPH_WIDTH = 4, 12


@dataclass(frozen=True, slots=True)
class Query:
    expr: str
    legend: str = "__auto"


@dataclass(frozen=True, slots=True)
class PanelSpec:
    title: str
    description: str
    queries: Sequence[Query]
    kind: Literal["timeseries", "stat", "heatmap"] = "timeseries"
    unit: str = "short"
    width: int = GRAPH_WIDTH
    min_value: float | None = 0
    max_value: float | None = None
    bars: bool = False
    no_value: str = ""
    thresholds: Sequence[tuple[float | None, str]] = ()


def _quantile(q: float, bucket: str, by: str, node_filtered: bool = True) -> str:
    """``histogram_quantile`` over the bucket rates of the selected nodes (or of the whole run)."""
    rates = per_node(rate("rate", bucket)) if node_filtered else rate("rate", run(bucket))
    return f"histogram_quantile({q}, sum by ({by}) ({rates}))"


def _health() -> list[PanelSpec]:
    return [
        PanelSpec(
            "Nodes",
            "Nodes in the current rendezvous round (the largest view among the daemons).",
            [Query(f"max({run('elasticd_nodes')})")],
            kind="stat",
            width=STAT_WIDTH,
        ),
        PanelSpec(
            "World size",
            "Workers (ranks) in the current round.",
            [Query(f"max({run('elasticd_world_size')})")],
            kind="stat",
            width=STAT_WIDTH,
        ),
        PanelSpec(
            "Step",
            "Last completed optimizer step.",
            [Query(f"max({run('elasticd_training_step')})")],
            kind="stat",
            width=STAT_WIDTH,
        ),
        PanelSpec(
            "Goodput",
            "Productive step time over wall time since the daemon started (best node); see docs/operations.md.",
            [Query(f"max({run('elasticd_goodput_ratio')})")],
            kind="stat",
            unit="percentunit",
            width=STAT_WIDTH,
            max_value=1,
            thresholds=[(None, "red"), (0.7, "orange"), (0.9, "green")],
        ),
        PanelSpec(
            "Since last step",
            "Seconds since any node last completed a step.",
            [Query(f"time() - max({run('elasticd_last_progress_timestamp_seconds')} > 0)")],
            kind="stat",
            unit="s",
            width=STAT_WIDTH,
            no_value="no step yet",
            thresholds=[(None, "green"), (300, "orange"), (900, "red")],
        ),
        PanelSpec(
            "Checkpoint age",
            "Seconds since the newest committed checkpoint (rank 0's node reports commits).",
            [Query(f"time() - max({run('elasticd_checkpoint_last_success_timestamp_seconds')} > 0)")],
            kind="stat",
            unit="s",
            width=STAT_WIDTH,
            no_value="none yet",
            thresholds=[(None, "green"), (1800, "orange"), (3600, "red")],
        ),
        PanelSpec(
            "Nodes and elastic range",
            "Nodes in the round as each daemon sees it, against --min-nodes and --max-nodes, the number "
            "of daemons Prometheus scrapes, and the spares (nodes waiting because the round's node count does not "
            "split the global batch).",
            [
                Query(per_node("elasticd_nodes"), "{{node}}"),
                Query(f"max({run('elasticd_min_nodes')})", "min nodes"),
                Query(f"max({run('elasticd_max_nodes')})", "max nodes"),
                Query(f"count({run('elasticd_info')})", "daemons up"),
                Query(f"sum({run('elasticd_spare')})", "spares"),
            ],
        ),
        PanelSpec(
            "World size by node",
            "Workers in the current round as each daemon sees it.",
            [Query(per_node("elasticd_world_size"), "{{node}}")],
        ),
        PanelSpec(
            "Step rate",
            "Optimizer steps per second (a rollback shows as zero, not negative).",
            [Query(f"clamp_min({per_node(rate('deriv', 'elasticd_training_step'))}, 0)", "{{node}}")],
            unit="none",
        ),
        PanelSpec(
            "Throughput",
            "Samples per second trained by each node's workers.",
            [Query(per_node(rate("rate", "elasticd_training_samples_total")), "{{node}}")],
            unit="none",
        ),
        PanelSpec(
            "Loss",
            "Last loss reported by each node's local rank 0.",
            [Query(per_node("elasticd_training_loss"), "{{node}}")],
            min_value=None,
        ),
        PanelSpec(
            "Goodput by node",
            "Productive step time over wall time since each daemon started.",
            [Query(per_node("elasticd_goodput_ratio"), "{{node}}")],
            unit="percentunit",
            max_value=1,
        ),
        PanelSpec(
            "Progress age and hang timeout",
            "Seconds since each node's workers last completed a step, against the hang timeout in force "
            "(fixed by --hang-timeout or learned by auto). A line that climbs to its timeout is a hang.",
            [
                Query(per_node("time() - (elasticd_last_progress_timestamp_seconds > 0)"), "{{node}}"),
                Query(per_node("elasticd_hang_timeout_seconds"), "{{node}} hang timeout"),
            ],
            unit="s",
            width=24,
        ),
    ]


def _failures() -> list[PanelSpec]:
    return [
        PanelSpec(
            "Worker restarts by reason",
            "Worker-group restarts summed over the selected nodes: failure, hang, nan, membership, drain.",
            [Query(f"sum by (reason) ({per_node(rate('increase', 'elasticd_worker_restarts_total'))})", "{{reason}}")],
            bars=True,
        ),
        PanelSpec(
            "Hangs and stragglers",
            "Hangs detected (no progress within the hang timeout) and ranks reported as stragglers.",
            [
                Query(per_node(rate("increase", "elasticd_hangs_total")), "{{node}} hangs"),
                Query(per_node(rate("increase", "elasticd_stragglers_total")), "{{node}} stragglers"),
            ],
            bars=True,
        ),
        PanelSpec(
            "Non-finite steps by action",
            "Non-finite loss or gradient events by the action taken (skip, rollback, stop). Every node counts the "
            "same event, so the panel shows the largest count.",
            [
                Query(
                    f"max by (action) ({per_node(rate('increase', 'elasticd_nonfinite_steps_total'))})",
                    "{{action}}",
                )
            ],
            bars=True,
        ),
        PanelSpec(
            "Recovery time",
            "Fault detected to the first completed step after the restart (p50, p95 of recoveries in each window).",
            [
                Query(_quantile(0.5, "elasticd_recovery_duration_seconds_bucket", "le"), "p50"),
                Query(_quantile(0.95, "elasticd_recovery_duration_seconds_bucket", "le"), "p95"),
            ],
            unit="s",
        ),
    ]


def _checkpoints() -> list[PanelSpec]:
    return [
        PanelSpec(
            "Time since checkpoint",
            "Seconds since the newest committed checkpoint (rank 0's node reports commits).",
            [Query(f"time() - max({run('elasticd_checkpoint_last_success_timestamp_seconds')} > 0)", "age")],
            unit="s",
            width=8,
        ),
        PanelSpec(
            "Steps at risk",
            "Steps completed since the newest committed checkpoint: what a crash now would make the run redo.",
            [
                Query(
                    f"max({run('elasticd_training_step')}) - max({run('elasticd_checkpoint_last_step')})",
                    "steps since checkpoint",
                )
            ],
            width=8,
        ),
        PanelSpec(
            "Checkpoint duration by phase",
            "Save time: blocking (training waits) and total (until committed); p95 and mean in each window.",
            [
                Query(
                    _quantile(0.95, "elasticd_checkpoint_duration_seconds_bucket", "le, phase", node_filtered=False),
                    "p95 {{phase}}",
                ),
                Query(
                    f"sum by (phase) ({rate('rate', run('elasticd_checkpoint_duration_seconds_sum'))})"
                    f" / sum by (phase) ({rate('rate', run('elasticd_checkpoint_duration_seconds_count'))})",
                    "mean {{phase}}",
                ),
            ],
            unit="s",
            width=8,
        ),
        PanelSpec(
            "Checkpoint failures",
            "Saves that did not commit, by reason: fenced (a writer from a stale group was refused by the lineage)"
            " or error (an I/O error such as a full disk); and rounds whose fencing token could not be written.",
            [
                Query(per_node(rate("increase", "elasticd_checkpoint_failures_total")), "{{node}} {{reason}}"),
                Query(per_node(rate("increase", "elasticd_fence_token_failures_total")), "{{node}} token"),
            ],
            bars=True,
        ),
        PanelSpec(
            "Lost steps",
            "Steps redone after a restart (completed, then lost because the newest checkpoint was older).",
            [Query(per_node(rate("increase", "elasticd_lost_steps_total")), "{{node}}")],
            bars=True,
        ),
    ]


def _step_time() -> list[PanelSpec]:
    return [
        PanelSpec(
            "Step time distribution",
            "Optimizer step wall time of the selected nodes: steps per bucket in each window.",
            [
                Query(
                    f"sum by (le) ({per_node(rate('increase', 'elasticd_step_duration_seconds_bucket'))})",
                    "{{le}}",
                )
            ],
            kind="heatmap",
        ),
        PanelSpec(
            "Step time by node",
            "p50 and p99 of the optimizer step wall time; a node whose p99 stands apart hosts a straggler.",
            [
                Query(_quantile(0.5, "elasticd_step_duration_seconds_bucket", "le, node"), "p50 {{node}}"),
                Query(_quantile(0.99, "elasticd_step_duration_seconds_bucket", "le, node"), "p99 {{node}}"),
            ],
            unit="s",
        ),
    ]


def _rendezvous_etcd() -> list[PanelSpec]:
    return [
        PanelSpec(
            "etcd errors",
            "Failed etcd calls per second by node (rendezvous, registry, control and checkpoint records).",
            [Query(per_node(rate("rate", "elasticd_etcd_errors_total")), "{{node}}")],
            unit="none",
            width=8,
        ),
        PanelSpec(
            "Rendezvous rounds",
            "Rendezvous rounds each node completed in each window: one per start, restart or membership change.",
            [Query(per_node(rate("increase", "elasticd_rendezvous_total")), "{{node}}")],
            bars=True,
            width=8,
        ),
        PanelSpec(
            "Rendezvous duration",
            "Time to form a round (p50, p95 of the rounds in each window).",
            [
                Query(_quantile(0.5, "elasticd_rendezvous_duration_seconds_bucket", "le"), "p50"),
                Query(_quantile(0.95, "elasticd_rendezvous_duration_seconds_bucket", "le"), "p95"),
            ],
            unit="s",
            width=8,
        ),
    ]


def _hot_recovery() -> list[PanelSpec]:
    # Every node of the group counts the same in-place change: run-level views take the largest count, not the sum.
    return [
        PanelSpec(
            "Reconfigurations by reason",
            "In-place re-formations of the process group per window, by reason: failure, hang, join, leave (the "
            "largest count among the selected nodes; every node counts the same change).",
            [
                Query(
                    f"max by (reason) ({per_node(rate('increase', 'elasticd_reconfigurations_total'))})",
                    "{{reason}}",
                )
            ],
            bars=True,
            width=8,
        ),
        PanelSpec(
            "Reconfiguration time",
            "Fault detected to the first completed step at the new size, re-formed in place (p50, p90 of the "
            "re-formations in each window).",
            [
                Query(_quantile(0.5, "elasticd_reconfiguration_duration_seconds_bucket", "le"), "p50"),
                Query(_quantile(0.9, "elasticd_reconfiguration_duration_seconds_bucket", "le"), "p90"),
            ],
            unit="s",
            width=8,
        ),
        PanelSpec(
            "Heal bytes",
            "Bytes each node's workers sent or received to heal members in place (a joiner's state from a live "
            "peer) per window.",
            [Query(per_node(rate("increase", "elasticd_heal_bytes_total")), "{{node}}")],
            unit="bytes",
            bars=True,
            width=8,
        ),
        PanelSpec(
            "Membership epoch",
            "The membership epoch in force as each node last re-formed into it; a node behind the others was left "
            "out of the newer epochs (0 until its first re-formation in place).",
            [Query(per_node("elasticd_membership_epoch"), "{{node}}")],
        ),
        PanelSpec(
            "Hot fallbacks by reason",
            "Times the hot path gave up and the workers restarted cold from the newest checkpoint, by reason "
            "(below_minimum, reform_failed, heal_failed, unsupported, other; the largest count among nodes).",
            [
                Query(
                    f"max by (reason) ({per_node(rate('increase', 'elasticd_hot_fallbacks_total'))})",
                    "{{reason}}",
                )
            ],
            bars=True,
        ),
        PanelSpec(
            "Shard mirror time",
            "A sharded job's copy of each worker's shards into another node's memory, per generation (p90 over the "
            "workers): blocking, what a step waits; total, to the end of the exchange with the ring peers.",
            [Query(_quantile(0.9, "elasticd_shard_mirror_seconds_bucket", "le, phase"), "p90 {{phase}}")],
            unit="s",
            width=8,
        ),
        PanelSpec(
            "Shard mirror bytes",
            "Bytes each node's workers sent to their ring peers' mirrors, per window (sharded jobs, "
            "--shard-mirror-every).",
            [Query(per_node(rate("increase", "elasticd_shard_mirror_bytes_total")), "{{node}}")],
            unit="bytes",
            bars=True,
            width=8,
        ),
    ]


ROWS: tuple[tuple[str, Callable[[], list[PanelSpec]]], ...] = (
    ("Run health", _health),
    ("Failures", _failures),
    ("Checkpoints", _checkpoints),
    ("Step time", _step_time),
    ("Rendezvous and etcd", _rendezvous_etcd),
    ("Hot recovery", _hot_recovery),
)


def panels() -> list[tuple[str, list[PanelSpec]]]:
    """The rows and their panels, in order."""
    return [(title, make()) for title, make in ROWS]
