"""promtool on the generated alert rules: the file checks, and grafana/alerts.test.yaml's cases pass (Debian's
prometheus package is installed when promtool is missing; see tests/prometheus_tools.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from grafana import alerts
from tests.prometheus_tools import INSTALL_TIMEOUT_S, require_prometheus

GRAFANA = Path(__file__).resolve().parents[2] / "grafana"


@pytest.mark.timeout(2 * INSTALL_TIMEOUT_S + 60)  # may install Debian's prometheus first
def test_promtool_check_rules_passes() -> None:
    tools = require_prometheus()
    done = subprocess.run(
        [str(tools.promtool), "check", "rules", str(GRAFANA / "alerts.yaml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(alerts.ALERTS)} rules found" in done.stdout


@pytest.mark.timeout(2 * INSTALL_TIMEOUT_S + 60)  # may install Debian's prometheus first
def test_promtool_test_rules_passes() -> None:
    tools = require_prometheus()
    done = subprocess.run(
        [str(tools.promtool), "test", "rules", "alerts.test.yaml"],
        cwd=GRAFANA,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
