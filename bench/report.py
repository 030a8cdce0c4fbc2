"""The tables of docs/benchmarks.md, generated from the raw results under bench/results/ (never typed by hand).

A table in the doc sits between two markers that name its kind and its source::

    <!-- bench:recovery bench/results/recovery-abc1234.json -->
    ... generated, do not edit ...
    <!-- /bench -->

    python bench/report.py            # rewrite every marked table from its file
    python bench/report.py --check    # exit 1 when a table differs from its file or a table lies outside a marked
                                      # block (tests/unit/test_bench_report.py runs it)

Kinds (bench/table_kinds.py names what renders each): ``recovery``, ``goodput``, ``checkpoint``, ``step_overhead``,
``hang``, ``heal``, ``collective_design``, ``recovery_memory``, ``join_contention``, ``shard_mirror``,
``control_plane``, one per
benchmark of that name. Each generated block starts with the commit its figures were measured on; a file that
predates recording the commit is named by the commit in its file name.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/report.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.table_kinds import KINDS

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
_BLOCK = re.compile(r"(<!-- bench:(\w+) (\S+) -->\n)(.*?)(<!-- /bench -->)", re.DOTALL)
# bench/results/<benchmark>[-<what>]-<short commit>[-<tag>][-dirty].json, as bench/common.py's results_path names
# them (e.g. recovery-abc1234-netns-dirty.json)
_COMMIT_IN_NAME = re.compile(r"-([0-9a-f]{7,40})(?:-[a-z]+)*\.json$")


def load(source: Path) -> dict[str, Any]:
    """A results file; one that does not record its commit gets the one its name gives (``from_file_name``)."""
    results: dict[str, Any] = json.loads(source.read_text())
    if not (results.get("code") or {}).get("commit"):
        match = _COMMIT_IN_NAME.search(source.name)
        results["code"] = {"commit": match.group(1) if match else None, "from_file_name": bool(match)}
    return results


def render(doc: str, root: Path = ROOT) -> str:
    """``doc`` with every marked table regenerated from its file."""

    def replace(match: re.Match[str]) -> str:
        start, kind, source, _, end = match.groups()
        if kind not in KINDS:
            raise ValueError(f"unknown table kind {kind!r} in a bench marker (known: {', '.join(KINDS)})")
        return start + KINDS[kind](load(root / source)) + end

    return _BLOCK.sub(replace, doc)


def tables_outside_blocks(doc: str) -> list[int]:
    """Line numbers (1-based) of table lines (starting with ``|``) that no generated block holds: typed by hand."""
    outside = _BLOCK.sub(lambda m: "\n" * m.group(0).count("\n"), doc)
    return [n for n, line in enumerate(outside.splitlines(), 1) if line.lstrip().startswith("|")]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 when a table differs from its results file")
    p.add_argument("--doc", type=Path, default=DOC)
    args = p.parse_args(argv)
    text = args.doc.read_text()
    try:
        generated = render(text)
    except (OSError, ValueError, KeyError) as exc:
        print(f"{args.doc}: cannot generate a benchmark table: {exc!r}", file=sys.stderr)
        return 2
    if args.check:
        if generated != text:
            print(f"{args.doc}: a benchmark table differs from its results file; run python bench/report.py")
            return 1
        if hand := tables_outside_blocks(text):
            print(
                f"{args.doc}: lines {', '.join(map(str, hand))} are a table outside a generated block (typed by hand)"
            )
            return 1
        return 0
    args.doc.write_text(generated)
    return 0


if __name__ == "__main__":
    sys.exit(main())
