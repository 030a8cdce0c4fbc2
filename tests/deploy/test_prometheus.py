"""The dashboard and the alert rules work on a real Prometheus scraping a real 2-node run with one worker failure.

One module-scoped run: etcd, two ``elasticd start`` daemons (each with its own metrics port), examples/train.py with
rank 1 killed at step 20 (``ELASTICD_FAULT``), and Prometheus on 127.0.0.1 scraping both every second and
evaluating grafana/alerts.yaml. Once both nodes have recovered and Prometheus has scraped that, every PromQL
expression of grafana/elasticd.json and every alert signal must return data, and every alert rule must evaluate
without error. A metric renamed in elasticd/metrics.py but not in the dashboard fails here. The same daemons give
``promtool check metrics`` a live scrape.
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass

import pytest
import yaml

from elasticd.etcd.server import EmbeddedEtcd
from grafana import alerts, dashboard
from tests.helpers import ETCD_READY_TIMEOUT_S, free_port
from tests.integration.cluster import ROOT, Cluster, train_args, wait_until
from tests.prometheus_tools import INSTALL_TIMEOUT_S, PrometheusServer, PrometheusTools, require_prometheus

# Seconds: the run itself takes ~20 s; on a fresh machine the first test also installs Debian's prometheus.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(2 * INSTALL_TIMEOUT_S + 120)]

JOB = "elasticd"
# What Grafana would put in for the dashboard's variables: the run's scrape job, every node, and a rate window of
# 30 scrapes (each window holds samples whatever happened when).
VARIABLES = {"$__rate_interval": "30s", "$job": JOB, "$node": ".*"}
FAULT_STEP = 20
# 400 steps of at least 0.1 s: the run is still training when the queries run, well after the recovery.
SCRIPT_ARGS = train_args(400, 0.1)
DASHBOARD = ROOT / "grafana" / "elasticd.json"
RULES = ROOT / "grafana" / "alerts.yaml"


@dataclass(frozen=True)
class LiveRun:
    cluster: Cluster
    prometheus: PrometheusServer
    tools: PrometheusTools
    metrics_urls: list[str]


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveRun]:
    tools = require_prometheus()
    workdir = tmp_path_factory.mktemp("prometheus-run")
    with ExitStack() as stack:
        etcd = EmbeddedEtcd(data_dir=workdir / "etcd", unsafe_no_fsync=True)
        etcd.start(ready_timeout_s=ETCD_READY_TIMEOUT_S)
        stack.callback(etcd.stop)
        cluster = stack.enter_context(
            Cluster(
                etcd.endpoint,
                workdir,
                run_id="prom",
                min_nodes=2,
                max_nodes=2,
                script_args=SCRIPT_ARGS,
                env={"ELASTICD_FAULT": f"kill@step={FAULT_STEP},rank=1,round=0"},
            )
        )
        ports = {"pm-a": free_port(), "pm-b": free_port()}
        prometheus = stack.enter_context(
            PrometheusServer(
                tools.prometheus,
                workdir / "prometheus",
                [f"127.0.0.1:{port}" for port in ports.values()],
                job=JOB,
                rule_files=(RULES,),
            )
        )
        for name, port in ports.items():
            # a later --metrics-port wins over the harness's "--metrics-port 0" (off)
            cluster.start(name, "--metrics-port", str(port))
        for name in ports:
            cluster.nodes[name].wait_event("recovered", timeout_s=120)
        # Both daemons' recoveries have reached Prometheus: the failure's series are in the TSDB.
        wait_until(
            lambda: _values(prometheus, f'elasticd_recovery_duration_seconds_count{{job="{JOB}"}} > 0') == 2,
            30,
            "Prometheus to scrape both recoveries",
            poll_s=0.5,
        )
        yield LiveRun(cluster, prometheus, tools, [f"http://127.0.0.1:{port}/metrics" for port in ports.values()])


def _values(prometheus: PrometheusServer, expr: str) -> int:
    body = prometheus.query(expr)
    return len(body.get("data", {}).get("result", [])) if body.get("status") == "success" else 0


def _interpolate(expr: str) -> str:
    # longest first: $__rate_interval must not be read as $__rate...
    for name in sorted(VARIABLES, key=len, reverse=True):
        expr = expr.replace(name, VARIABLES[name])
    return expr


def _diagnose(live: LiveRun, failures: list[str]) -> str:
    return "\n".join(failures) + f"\n\n{live.cluster.diagnostics()}\n--- prometheus\n{live.prometheus.log_tail()}"


def test_every_dashboard_expression_parses_and_returns_data_from_a_live_run(live: LiveRun) -> None:
    board = json.loads(DASHBOARD.read_text())
    exprs = dashboard.expressions(board)
    assert len(exprs) >= 20, "the dashboard lost its queries"
    failures = []
    for title, ref_id, expr in exprs:
        body = live.prometheus.query(_interpolate(expr))
        if body.get("status") != "success":
            failures.append(f"{title} {ref_id}: {body.get('errorType')}: {body.get('error')}\n    {expr}")
        elif not body["data"]["result"]:
            failures.append(f"{title} {ref_id}: no data\n    {expr}")
    assert not failures, _diagnose(live, failures)


def test_dashboard_variables_list_the_run_and_both_nodes(live: LiveRun) -> None:
    board = json.loads(DASHBOARD.read_text())
    queries = {v["name"]: v.get("query") for v in board["templating"]["list"]}
    # label_values(<selector>, <label>) is Grafana's; Prometheus answers it through the label values API.
    expected = {"job": {JOB}, "node": {"pm-a", "pm-b"}}
    for name, values in expected.items():
        selector, _, label = _interpolate(queries[name]).removeprefix("label_values(").removesuffix(")").rpartition(",")
        body = live.prometheus.api(f"label/{label.strip()}/values", **{"match[]": selector.strip()})
        assert body["status"] == "success", body
        assert values <= set(body["data"]), f"variable {name}: {body['data']}"


def test_every_alert_signal_returns_data_and_every_rule_evaluates(live: LiveRun) -> None:
    failures = []
    for alert in alerts.ALERTS:
        body = live.prometheus.query(alert.signal)
        if body.get("status") != "success" or not body["data"]["result"]:
            failures.append(f"{alert.name} signal: {body.get('error') or 'no data'}\n    {alert.signal}")
    rules = [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]
    assert {rule["alert"] for rule in rules} == {alert.name for alert in alerts.ALERTS}
    for rule in rules:
        body = live.prometheus.query(rule["expr"])
        if body.get("status") != "success":
            failures.append(f"{rule['alert']} expr: {body.get('errorType')}: {body.get('error')}\n    {rule['expr']}")
    assert not failures, _diagnose(live, failures)


def test_prometheus_loads_the_rule_file_and_evaluates_every_rule_healthy(live: LiveRun) -> None:
    def evaluated() -> list[dict[str, object]] | None:
        body = live.prometheus.api("rules")
        loaded = [rule for group in body["data"]["groups"] for rule in group["rules"]]
        return loaded if loaded and all(rule.get("health") != "unknown" for rule in loaded) else None

    loaded = wait_until(evaluated, 15, "every rule evaluated once", poll_s=0.5)
    assert {rule["name"] for rule in loaded} == {alert.name for alert in alerts.ALERTS}
    unhealthy = [f"{rule['name']}: {rule.get('health')} {rule.get('lastError')}" for rule in loaded]
    assert all(rule["health"] == "ok" for rule in loaded), "\n".join(unhealthy)


def test_promtool_check_metrics_passes_on_a_live_scrape_of_each_daemon(live: LiveRun) -> None:
    for url in live.metrics_urls:
        with urllib.request.urlopen(url, timeout=10) as response:
            exposition = response.read()
        assert b"elasticd_worker_restarts_total" in exposition
        started = time.monotonic()
        done = subprocess.run(
            [str(live.tools.promtool), "check", "metrics"], input=exposition, capture_output=True, timeout=60
        )
        output = (done.stdout + done.stderr).decode(errors="replace")
        assert done.returncode == 0, f"promtool check metrics on {url} ({time.monotonic() - started:.1f}s):\n{output}"
        assert not output.strip(), output


def test_the_failure_shows_in_the_restart_and_recovery_series(live: LiveRun) -> None:
    restarts = live.prometheus.query(f'sum(elasticd_worker_restarts_total{{job="{JOB}", reason!="drain"}})')
    assert float(restarts["data"]["result"][0]["value"][1]) >= 2  # both nodes restarted their workers
    recoveries = live.prometheus.query(f'sum(elasticd_recovery_duration_seconds_count{{job="{JOB}"}})')
    assert float(recoveries["data"]["result"][0]["value"][1]) >= 2
