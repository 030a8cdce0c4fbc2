"""The elasticd dashboard (grafana/elasticd.json), built with grafana-foundation-sdk (the Grafana 11.6 schema).

:mod:`grafana.panels` says what the rows and panels show; this module turns them into Grafana's JSON model: panel
kinds and their options, the layout, and the variables ``datasource`` (a Prometheus), ``job`` (the run: one scrape
job per run) and ``node`` (multi-select, from elasticd_info).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from grafana_foundation_sdk.builders import common as common_b
from grafana_foundation_sdk.builders import dashboard as dash_b
from grafana_foundation_sdk.builders import heatmap, stat, timeseries
from grafana_foundation_sdk.builders.prometheus import Dataquery
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as dash_m
from grafana_foundation_sdk.models import heatmap as heatmap_m
from grafana_foundation_sdk.models import prometheus as prom_m

from grafana.panels import PanelSpec, panels
from grafana.promql import JOB_VAR

UID = "elasticd"
TITLE = "elasticd"
_DATASOURCE = dash_m.DataSourceRef(type_val="prometheus", uid="${datasource}")
# Grid rows: a stat is short, a graph is tall enough to read six series.
_STAT_H, _GRAPH_H = 4, 8


def _thresholds(steps: Sequence[tuple[float | None, str]]) -> dash_b.ThresholdsConfig:
    return (
        dash_b.ThresholdsConfig()
        .mode(dash_m.ThresholdsMode.ABSOLUTE)
        .steps([dash_m.Threshold(value=v, color=c) for v, c in steps])
    )


def _targets(spec: PanelSpec) -> list[Dataquery]:
    targets = []
    for i, query in enumerate(spec.queries):
        q = Dataquery().ref_id(chr(ord("A") + i)).expr(query.expr).legend_format(query.legend).datasource(_DATASOURCE)
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
        .targets(_targets(spec))
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
