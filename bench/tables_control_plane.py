"""docs/benchmarks.md's control-plane table and picture, from ``bench/control_plane.py``'s raw results (issue 28)."""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.tables import provenance

# issue 28's targets at 1,024 nodes
TARGET_NODES = 1024
TARGET_FORM_S, TARGET_LOSS_S, TARGET_JOIN_S, TARGET_BYTES_PER_NODE_S = 10.0, 2.0, 2.0, 100.0


def fitted_exponent(points: Sequence[tuple[float, float]]) -> float | None:
    """The slope of log(y) against log(N) by least squares: y grows as N to this power (None: under 2 points)."""
    pts = [(math.log(n), math.log(y)) for n, y in points if n > 0 and y and y > 0]
    if len(pts) < 2:
        return None
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    var = sum((x - mx) ** 2 for x, _ in pts)
    return None if var == 0 else sum((x - mx) * (y - my) for x, y in pts) / var


def _median(row: dict[str, Any], key: str) -> float | None:
    value = (row.get(key) or {}).get("median")
    return None if value is None else float(value)


def _cell(row: dict[str, Any], key: str, cores: str) -> str:
    data = row.get(key) or {}
    if data.get("median") is None:
        return "x"
    samples = ", ".join(f"{s:.2f}" for s in data["samples"])
    spent = row.get(cores) or {}
    return f"**{data['median']:.2f}** ({samples}); cores {spent.get('sim', 0):.2f} / {spent.get('etcd', 0):.2f}"


def _bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def _series(summary: Sequence[dict[str, Any]], pick: Any) -> list[tuple[float, float]]:
    return [(row["nodes"], v) for row in summary if (v := pick(row)) is not None]


def control_plane_table(results: dict[str, Any]) -> str:
    config = results.get("config", {})
    lines = [
        f"{provenance(results)}; etcd: {config.get('etcd')}; {config.get('trials')} trial(s) per N, "
        f"{results.get('duration_s', 0) / 60:.0f} min; simulated nodes in {config.get('processes')} processes, "
        f"{_clients(config.get('nodes_per_client'))}; a first round not formed within "
        f"{config.get('form_timeout'):g} s stops that design's larger N. Seconds, medians (samples); after each, the "
        "cores the simulation / etcd used meanwhile (CPU seconds over wall seconds; this host has 2); x: not reached.",
        "",
        "| design | N | first round formed s | re-formed in place after a node loss s | join admitted s "
        "| steady: requests/s | steady: bytes/s into etcd (per node) | steady: cores sim / etcd | etcd db |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    notes = []
    for design, data in results.get("designs", {}).items():
        for row in data["summary"]:
            steady = row.get("steady")
            if steady:
                traffic = [
                    f"{steady['requests_per_s']:.0f}",
                    f"{_bytes(steady['bytes_per_s'])}/s ({steady['bytes_per_node_per_s']:.0f} B)",
                    f"{steady['sim_cores']:.2f} / {steady['etcd_cores']:.2f}",
                ]
            else:
                traffic = ["x", "x", "x"]
            db = _median(row, "db_size")
            cells = [
                design,
                str(row["nodes"]),
                _cell(row, "form_s", "forming_cores"),
                _cell(row, "loss_s", "loss_cores"),
                _cell(row, "join_s", "join_cores"),
                *traffic,
                "x" if db is None else _bytes(db),
            ]
            lines.append("| " + " | ".join(cells) + " |")
            if unformed := row.get("not_formed"):
                notes.append(
                    f"- {design}, N = {row['nodes']}: not formed within {unformed.get('seconds') or 0:.0f} s "
                    f"({unformed.get('formed_nodes')} of {row['nodes']} nodes had a rank); meanwhile "
                    f"{unformed.get('requests') or 0:,.0f} requests and {_bytes(unformed.get('bytes_in') or 0)} into "
                    f"etcd" + (f"; errors: {'; '.join(unformed['errors'])}" if unformed.get("errors") else "")
                )
        summary = data["summary"]
        fits = []
        for label, pick in (
            ("first round formed", lambda r: _median(r, "form_s")),
            ("re-form after a loss", lambda r: _median(r, "loss_s")),
            ("join", lambda r: _median(r, "join_s")),
            ("steady bytes/s", lambda r: (r.get("steady") or {}).get("bytes_per_s")),
        ):
            points = _series(summary, pick)
            exponent = fitted_exponent(points)
            if exponent is not None:
                fits.append(f"{label} ~ N^{exponent:.2f} (N = {', '.join(str(int(n)) for n, _ in points)})")
        if fits:
            notes.append(f"- {design}, fitted growth: " + "; ".join(fits))
        at_target = next((r for r in summary if r["nodes"] == TARGET_NODES), None)
        asked = TARGET_NODES in (config.get("nodes") or [TARGET_NODES])
        notes.append(f"- {design}, issue 28's targets at {TARGET_NODES:,} nodes: {_verdict(at_target, asked)}")
    notes.extend(_ratios(results.get("designs", {})))
    return "\n".join([*lines, "", *notes]) + "\n"


def _ratios(designs: dict[str, Any], base: str = "today", new: str = "lease") -> list[str]:
    """Each figure of ``base`` over ``new``'s at every N both reached, from the one run: how many times better."""
    if base not in designs or new not in designs:
        return []
    rows = {design: {r["nodes"]: r for r in designs[design]["summary"]} for design in (base, new)}
    parts = []
    for label, pick in (
        ("first round formed", lambda r: _median(r, "form_s")),
        ("re-form after a loss", lambda r: _median(r, "loss_s")),
        ("join", lambda r: _median(r, "join_s")),
        ("steady bytes per node", lambda r: (r.get("steady") or {}).get("bytes_per_node_per_s")),
    ):
        each = []
        for nodes in sorted(set(rows[base]) & set(rows[new])):
            before, after = pick(rows[base][nodes]), pick(rows[new][nodes])
            if before and after:
                each.append(f"N = {nodes}: {before / after:.1f}x")
            elif after and not before:
                each.append(f"N = {nodes}: {base} x, {new} {after:.2f}")
        if each:
            parts.append(f"{label} ({', '.join(each)})")
    return [f"- {base} over {new}, in this one run: " + "; ".join(parts)] if parts else []


def _clients(per_client: Any) -> str:
    return "one etcd client per node" if per_client == 1 else f"one etcd client per {per_client} nodes"


def _verdict(row: dict[str, Any] | None, asked: bool = True) -> str:
    if row is None:
        return "not measured (the design did not reach that N)" if asked else "not measured (not run in this run)"
    parts = []
    for label, value, target in (
        ("formed", _median(row, "form_s"), TARGET_FORM_S),
        ("re-form", _median(row, "loss_s"), TARGET_LOSS_S),
        ("join", _median(row, "join_s"), TARGET_JOIN_S),
        ("B/node/s", (row.get("steady") or {}).get("bytes_per_node_per_s"), TARGET_BYTES_PER_NODE_S),
    ):
        met = "x" if value is None else "met" if value <= target else "MISSED"
        parts.append(f"{label} <= {target:g}: {met}")
    return "; ".join(parts)


def draw(results: dict[str, Any], png: Path) -> bool:
    """Time (formed, re-formed, join) and steady bytes/s against N, log-log, per design; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench/control_plane.py: no matplotlib, no picture (pip install 'elasticd[bench]')", file=sys.stderr)
        return False
    fig, (times, traffic) = plt.subplots(1, 2, figsize=(11, 4.2))
    for design, data in results.get("designs", {}).items():
        summary = data["summary"]
        for key, label, style in (("form_s", "formed", "o-"), ("loss_s", "re-formed", "s--"), ("join_s", "join", "^:")):
            points = _series(summary, lambda r, key=key: _median(r, key))
            if points:
                times.plot(*zip(*points, strict=True), style, label=f"{design}: {label}")
        points = _series(summary, lambda r: (r.get("steady") or {}).get("bytes_per_s"))
        if points:
            traffic.plot(*zip(*points, strict=True), "o-", label=f"{design}: bytes/s into etcd")
        for row in summary:
            if row.get("not_formed"):
                times.axvline(row["nodes"], color="red", alpha=0.3, lw=1)
    for ax, title, unit in (
        (times, "time against N (red: not formed)", "seconds"),
        (traffic, "steady state", "bytes/s"),
    ):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("simulated nodes N")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.legend(fontsize=8)
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return True
