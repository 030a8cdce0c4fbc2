"""PromQL building blocks shared by the dashboard and the alert rules.

A run is one Prometheus scrape job: elasticd exports no run id label (DESIGN.md §3, low cardinality), so ``job``
tells runs apart and ``instance`` tells the daemons of a run apart. Only ``elasticd_info`` carries the node id;
per-node panels join it in (``on (job, instance) group_left (node)``), which also applies the dashboard's node filter.
"""

from __future__ import annotations

# Dashboard variables (Grafana interpolates them before the query reaches Prometheus).
JOB_VAR = "$job"
NODE_VAR = "$node"
# Grafana's window for rate()/increase(): at least four scrape intervals, so every window holds two samples.
RATE_INTERVAL = "$__rate_interval"

_NODE_JOIN = f'on (job, instance) group_left (node) elasticd_info{{job="{JOB_VAR}", node=~"{NODE_VAR}"}}'


def run(metric: str, matchers: str = "") -> str:
    """``metric`` of the dashboard's run, e.g. ``elasticd_nodes{job="$job"}``."""
    extra = f", {matchers}" if matchers else ""
    return f'{metric}{{job="{JOB_VAR}"{extra}}}'


def per_node(expr: str) -> str:
    """``expr`` (series with job and instance labels) with a ``node`` label, limited to the selected nodes.

    elasticd_info is 1, so the product keeps the values of ``expr``.
    """
    return f"({expr}) * {_NODE_JOIN}"


def rate(fn: str, metric: str, matchers: str = "", window: str = RATE_INTERVAL) -> str:
    """``fn(metric{matchers}[window])``, e.g. ``increase(elasticd_hangs_total[$__rate_interval])``."""
    selector = f"{metric}{{{matchers}}}" if matchers else metric
    return f"{fn}({selector}[{window}])"
