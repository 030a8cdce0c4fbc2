"""docs/operations.md lists every structlog event the code logs, with its fields.

Events are found in the source: a call ``<logger>.<level>("event_name", field=...)`` with a string literal first
argument, anywhere under elasticd/. A new event, or a new field of one, fails here until it is documented.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OPERATIONS = ROOT / "docs" / "operations.md"
LEVELS = {"debug", "info", "warning", "error", "exception", "critical"}


def logged_events() -> dict[str, set[str]]:
    """Event name -> the keyword fields of every call that logs it, from elasticd/'s source."""
    events: dict[str, set[str]] = {}
    for path in sorted((ROOT / "elasticd").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            if node.func.attr not in LEVELS or not node.args:
                continue
            first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                events.setdefault(first.value, set()).update(k.arg for k in node.keywords if k.arg)
    return events


def documented_events() -> dict[str, set[str]]:
    """Event name -> fields, from the rows of the tables under "## Events": | `name` | level | fields | when |."""
    section = OPERATIONS.read_text().split("\n## Events\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([a-z_]+)` \|[^|]*\|([^|]*)\|", section, flags=re.MULTILINE)
    return {name: {f.strip() for f in fields.split(",") if f.strip()} for name, fields in rows}


def test_the_scan_finds_the_lifecycle_events() -> None:
    events = logged_events()
    assert {"rendezvous_done", "workers_started", "restart", "worker_failed", "recovered", "resumed"} <= set(events)
    assert events["restart"] >= {"reason", "restarts_left"}


def test_every_logged_event_is_in_docs_operations_with_its_fields() -> None:
    documented = documented_events()
    missing = sorted(set(logged_events()) - set(documented))
    assert not missing, f"docs/operations.md has no row for these events: {missing}"
    for name, fields in logged_events().items():
        undocumented = fields - documented[name]
        assert not undocumented, f"docs/operations.md, event {name}: fields {sorted(undocumented)} missing"
