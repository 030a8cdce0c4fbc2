"""The tables of docs/benchmarks.md, generated from the raw results under bench/results/ (never typed by hand).

A table in the doc sits between two markers that name its source::

    <!-- bench:recovery bench/results/recovery-abc1234.json -->
    ... generated, do not edit ...
    <!-- /bench -->

    python bench/report.py            # rewrite every marked table from its file
    python bench/report.py --check    # exit 1 when a table differs from its file (tests/unit/test_bench_report.py)

Kinds: ``recovery`` (bench/recovery.py: per scenario, each system's median and samples, the ratios) and ``goodput``
(bench/goodput.py: per system, goodput and its parts).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
_BLOCK = re.compile(r"(<!-- bench:(\w+) (\S+) -->\n)(.*?)(<!-- /bench -->)", re.DOTALL)

_RECOVERY_SYSTEMS = ("elasticd", "elasticd-cold", "torchrun", "torchrun-tuned")
_RECOVERY_LABELS = {
    "join": "join (2 -> 3 nodes)",
    "node_loss": "node loss (kill -9, 3 -> 2)",
    "node_loss_rank0": "node loss, rank-0 node",
    "node_vanish": "vanished node (SIGSTOP)",
    "hang": "hung worker (SIGSTOP of one worker, --hang-timeout auto)",
}


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return "did not recover" if math.isinf(value) else f"{value:.2f}"


def _ratio(value: float | None) -> str:
    if value is None:
        return "-"
    return "inf" if math.isinf(value) else f"{value:.1f}x"


def _samples(data: dict[str, Any]) -> str:
    values = data.get("samples_s", [])
    contended = data.get("contended", [False] * len(values))
    text = ["x" if v is None else f"{v:.2f}" for v in values]
    return ", ".join(t + ("*" if c else "") for t, c in zip(text, contended, strict=True))


def recovery_table(results: dict[str, Any]) -> str:
    systems = [s for s in _RECOVERY_SYSTEMS if any(s in row for row in results["summary"])]
    head = ["scenario", *(f"{s} median s (samples)" for s in systems), "tuned / elasticd", "target"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in results["summary"]:
        cells = [_RECOVERY_LABELS.get(row["scenario"], row["scenario"])]
        for system in systems:
            data = row.get(system)
            cells.append(f"**{_seconds(data['median_s'])}** ({_samples(data)})" if data else "n/a")
        cells += [_ratio(row.get("ratio_tuned_over_elasticd")), row.get("target", "")]
        lines.append("| " + " | ".join(cells) + " |")
    code = results.get("code", {})
    trials = results.get("config", {}).get("trials")
    lines.append("")
    lines.append(
        f"Commit {code.get('commit', '?')}{' (with uncommitted changes)' if code.get('uncommitted_changes') else ''},"
        f" {trials} trial(s) per system, {results.get('duration_s', 0) / 60:.0f} min; *: other processes used more"
        " than 0.25 cores around that sample; x: did not recover within the timeout."
    )
    phases = []
    for row in results["summary"]:
        for system in systems:
            if data := row.get(system):
                parts = ", ".join(f"{k} {v:.2f}" for k, v in data.get("phase_medians_s", {}).items())
                phases.append(f"- {_RECOVERY_LABELS.get(row['scenario'], row['scenario'])}, {system}: {parts}")
    if phases:
        lines += [
            "",
            "Median phase ends, seconds after the fault (or the join's start); for a join also `stall` (the running"
            " group's longest pause between two steps, less a typical step), `stall_total` (every step's excess over a"
            " typical one summed) and `ready_to_step` (the joiner's workers imported and prepared -> their first step"
            " in the group), all in seconds:",
            "",
            *phases,
        ]
    return "\n".join(lines) + "\n"


def goodput_table(results: dict[str, Any]) -> str:
    head = ["system", "goodput", "distinct steps", "undisturbed step ms", "window s", "kills", "joins", "note"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for run in results["runs"]:
        goodput = run.get("goodput")
        cells = [
            str(run.get("system")),
            "-" if goodput is None else f"**{100 * goodput:.1f} %**",
            str(run.get("steps_after", 0) - run.get("steps_before", 0)),
            _float(None if run.get("step_time_s") is None else 1000 * run["step_time_s"], 0),
            _float(run.get("window_s"), 0),
            str(len(run.get("kills", []))),
            str(len(run.get("joins", []))),
            str(run.get("note", "")),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    code = results.get("code", {})
    config = results.get("config", {})
    lines += [
        "",
        f"Commit {code.get('commit', '?')}; {config.get('minutes')} min window, a kill every"
        f" {config.get('kill_every_s')} s, a join {config.get('join_after_s')} s after each kill.",
    ]
    return "\n".join(lines) + "\n"


def _float(value: Any, digits: int) -> str:
    return "-" if not isinstance(value, int | float) else f"{value:.{digits}f}"


KINDS: dict[str, Callable[[dict[str, Any]], str]] = {"recovery": recovery_table, "goodput": goodput_table}


def render(doc: str, root: Path = ROOT) -> str:
    """``doc`` with every marked table regenerated from its file."""

    def replace(match: re.Match[str]) -> str:
        start, kind, source, _, end = match.groups()
        if kind not in KINDS:
            raise ValueError(f"unknown table kind {kind!r} in a bench marker (known: {', '.join(KINDS)})")
        results = json.loads((root / source).read_text())
        return start + KINDS[kind](results) + end

    return _BLOCK.sub(replace, doc)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 when a table differs from its results file")
    p.add_argument("--doc", type=Path, default=DOC)
    args = p.parse_args(argv)
    text = args.doc.read_text()
    generated = render(text)
    if args.check:
        if generated != text:
            print(f"{args.doc}: a benchmark table differs from its results file; run python bench/report.py")
            return 1
        return 0
    args.doc.write_text(generated)
    return 0


if __name__ == "__main__":
    sys.exit(main())
