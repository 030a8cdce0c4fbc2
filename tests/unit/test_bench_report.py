"""docs/benchmarks.md's tables are generated from the raw results they name (bench/report.py), never typed."""

from __future__ import annotations

import json
from pathlib import Path

from bench.report import DOC, ROOT, main, recovery_table, render


def test_every_table_in_the_benchmarks_doc_matches_its_results_file() -> None:
    text = DOC.read_text()
    assert "<!-- bench:recovery " in text, "docs/benchmarks.md has no generated recovery table"
    assert render(text) == text, "a benchmark table differs from its results file: run python bench/report.py"


def test_a_table_edited_by_hand_is_caught(tmp_path: Path) -> None:
    source = sorted((ROOT / "bench" / "results").glob("recovery-*.json"))[-1]
    doc = tmp_path / "doc.md"
    table = recovery_table(json.loads(source.read_text()))
    marker = f"<!-- bench:recovery {source.relative_to(ROOT)} -->\n"
    doc.write_text(marker + table + "<!-- /bench -->\n")
    assert main(["--check", "--doc", str(doc)]) == 0
    doc.write_text(marker + table.replace("|", "| 0.01 |", 1) + "<!-- /bench -->\n")
    assert main(["--check", "--doc", str(doc)]) == 1
