"""The elasticd dashboard (grafana/elasticd.json), built with grafana-foundation-sdk (the Grafana 11.6 schema).

Rows, top to bottom: run health at a glance, failures, checkpoints, step time, rendezvous and etcd. Every query is
PromQL on the metrics of DESIGN.md §3 (elasticd/metrics.py). Variables: ``datasource`` (a Prometheus), ``job``
(the run: one scrape job per run) and ``node`` (multi-select, from elasticd_info). docs/operations.md describes
each panel; its title here and there must match.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from grafana_foundation_sdk.builders import common as common_b
from grafana_foundation_sdk.builders import dashboard as dash_b
from grafana_foundation_sdk.builders import heatmap, stat, timeseries
from grafana_foundation_sdk.builders.prometheus import Dataquery
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as dash_m
from grafana_foundation_sdk.models import heatmap as heatmap_m
from grafana_foundation_sdk.models import prometheus as prom_m

from grafana.promql import JOB_VAR, per_node, rate, run

UID = "elasticd"
TITLE = "elasticd"
_DATASOURCE = dash_m.DataSourceRef(type_val="prometheus", uid="${datasource}")
# Grid units (24 columns wide); a stat row is short, a graph is tall enough to read six series.
_STAT_H, _GRAPH_H = 4, 8


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
    width: int = 12
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
            width=4,
        ),
        PanelSpec(
            "World size",
            "Workers (ranks) in the current round.",
            [Query(f"max({run('elasticd_world_size')})")],
            kind="stat",
            width=4,
        ),
        PanelSpec(
            "Step",
            "Last completed optimizer step.",
            [Query(f"max({run('elasticd_training_step')})")],
            kind="stat",
            width=4,
        ),
        PanelSpec(
            "Goodput",
            "Productive step time over wall time since the daemon started (best node); see docs/operations.md.",
            [Query(f"max({run('elasticd_goodput_ratio')})")],
            kind="stat",
            unit="percentunit",
            width=4,
            max_value=1,
            thresholds=[(None, "red"), (0.7, "orange"), (0.9, "green")],
        ),
        PanelSpec(
            "Since last step",
            "Seconds since any node last completed a step.",
            [Query(f"time() - max({run('elasticd_last_progress_timestamp_seconds')} > 0)")],
            kind="stat",
            unit="s",
            width=4,
            no_value="no step yet",
            thresholds=[(None, "green"), (300, "orange"), (900, "red")],
        ),
        PanelSpec(
            "Checkpoint age",
            "Seconds since the newest committed checkpoint (rank 0's node reports commits).",
            [Query(f"time() - max({run('elasticd_checkpoint_last_success_timestamp_seconds')} > 0)")],
            kind="stat",
            unit="s",
            width=4,
            no_value="none yet",
            thresholds=[(None, "green"), (1800, "orange"), (3600, "red")],
        ),
        PanelSpec(
            "Nodes and elastic range",
            "Nodes in the round as each daemon sees it, against --min-nodes and --max-nodes, and the number "
            "of daemons Prometheus scrapes.",
            [
                Query(per_node("elasticd_nodes"), "{{node}}"),
                Query(f"max({run('elasticd_min_nodes')})", "min nodes"),
                Query(f"max({run('elasticd_max_nodes')})", "max nodes"),
                Query(f"count({run('elasticd_info')})", "daemons up"),
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
            "Failed checkpoint saves reported by each node's workers.",
            [Query(per_node(rate("increase", "elasticd_checkpoint_failures_total")), "{{node}}")],
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


ROWS: tuple[tuple[str, Any], ...] = (
    ("Run health", _health),
    ("Failures", _failures),
    ("Checkpoints", _checkpoints),
    ("Step time", _step_time),
    ("Rendezvous and etcd", _rendezvous_etcd),
)


def panels() -> list[tuple[str, list[PanelSpec]]]:
    """The rows and their panels, in order."""
    return [(title, make()) for title, make in ROWS]


def _thresholds(steps: Sequence[tuple[float | None, str]]) -> dash_b.ThresholdsConfig:
    return (
        dash_b.ThresholdsConfig()
        .mode(dash_m.ThresholdsMode.ABSOLUTE)
        .steps([dash_m.Threshold(value=v, color=c) for v, c in steps])
    )


def _targets(spec: PanelSpec, instant: bool) -> list[Dataquery]:
    targets = []
    for i, query in enumerate(spec.queries):
        q = Dataquery().ref_id(chr(ord("A") + i)).expr(query.expr).legend_format(query.legend).datasource(_DATASOURCE)
        if instant:
            q = q.instant()
        if spec.kind == "heatmap":
            q = q.format(prom_m.PromQueryFormat.HEATMAP)
        targets.append(q)
    return targets


def _panel(spec: PanelSpec, panel_id: int) -> Any:
    builder: Any
    if spec.kind == "stat":
        builder = (
            stat.Panel()
            .graph_mode(common.BigValueGraphMode.AREA)
            .color_mode(common.BigValueColorMode.VALUE)
            .reduce_options(common_b.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
        )
    elif spec.kind == "heatmap":
        builder = (
            heatmap.Panel()
            .calculate(False)
            .y_axis(heatmap.YAxisConfig().unit("s"))
            .cell_values(heatmap.CellValues().unit("short"))
            .color(
                heatmap.HeatmapColorOptions()
                .mode(heatmap_m.HeatmapColorMode.SCHEME)
                .scheme("Oranges")
                .fill("dark-orange")
                .exponent(0.5)
                .steps(64)
            )
            .rows_frame(heatmap.RowsHeatmapOptions().layout(common.HeatmapCellLayout.LE))
        )
    else:
        builder = (
            timeseries.Panel()
            .line_width(1)
            .fill_opacity(60 if spec.bars else 10)
            .draw_style(common.GraphDrawStyle.BARS if spec.bars else common.GraphDrawStyle.LINE)
            .show_points(common.VisibilityMode.NEVER)
            .legend(
                common_b.VizLegendOptions()
                .display_mode(common.LegendDisplayMode.LIST)
                .placement(common.LegendPlacement.BOTTOM)
                .show_legend(True)
            )
            .tooltip(common_b.VizTooltipOptions().mode(common.TooltipDisplayMode.MULTI).sort(common.SortOrder.NONE))
        )
    builder = (
        builder.id(panel_id)
        .title(spec.title)
        .description(spec.description)
        .datasource(_DATASOURCE)
        .span(spec.width)
        .height(_STAT_H if spec.kind == "stat" else _GRAPH_H)
        .targets(_targets(spec, instant=False))
    )
    if spec.kind != "heatmap":
        builder = builder.unit(spec.unit)
    if spec.min_value is not None and spec.kind != "heatmap":
        builder = builder.min(spec.min_value)
    if spec.max_value is not None:
        builder = builder.max(spec.max_value)
    if spec.no_value:
        builder = builder.no_value(spec.no_value)
    if spec.thresholds:
        builder = builder.thresholds(_thresholds(spec.thresholds))
    return builder


def _variables() -> list[Any]:
    return [
        dash_b.DatasourceVariable("datasource").label("Data source").type("prometheus"),
        dash_b.QueryVariable("job")
        .label("Run (scrape job)")
        .datasource(_DATASOURCE)
        .query("label_values(elasticd_info, job)")
        .refresh(dash_m.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(dash_m.VariableSort.ALPHABETICAL_ASC),
        dash_b.QueryVariable("node")
        .label("Node")
        .datasource(_DATASOURCE)
        .query(f'label_values(elasticd_info{{job="{JOB_VAR}"}}, node)')
        .refresh(dash_m.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(dash_m.VariableSort.ALPHABETICAL_ASC)
        .multi(True)
        .include_all(True)
        .all_value(".*")
        .current(dash_m.VariableOption(selected=True, text="All", value="$__all")),
    ]


def build() -> dict[str, Any]:
    """The dashboard as Grafana's JSON model (a dict ready for ``json.dump``)."""
    board = (
        dash_b.Dashboard(TITLE)
        .uid(UID)
        .description(
            "Health, failures, checkpoints and step time of an elasticd run. Generated by grafana/generate.py; "
            "panels and alerts are described in docs/operations.md."
        )
        .tags(["elasticd", "training"])
        .editable()
        .tooltip(dash_m.DashboardCursorSync.CROSSHAIR)
        .time("now-3h", "now")
        .refresh("30s")
        .timezone("browser")
    )
    for variable in _variables():
        board = board.with_variable(variable)
    panel_id = 0
    for row_title, specs in panels():
        panel_id += 1
        board = board.with_row(dash_b.Row(row_title).id(panel_id))
        for spec in specs:
            panel_id += 1
            board = board.with_panel(_panel(spec, panel_id))
    return dict(json.loads(JSONEncoder(sort_keys=True).encode(board.build())))


def render() -> str:
    """The dashboard file's text: sorted keys, two-space indent, a final newline (stable diffs)."""
    return json.dumps(build(), indent=2, sort_keys=True) + "\n"


def expressions(board: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(panel title, refId, expr) of every query in a dashboard JSON model, rows included."""
    found = []
    for panel in board.get("panels", []):
        for inner in [panel, *panel.get("panels", [])]:
            for target in inner.get("targets", []):
                if target.get("expr"):
                    found.append((inner.get("title", ""), target.get("refId", ""), target["expr"]))
    return found
