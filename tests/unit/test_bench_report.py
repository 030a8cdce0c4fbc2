"""docs/benchmarks.md's tables are generated from the raw results they name (bench/report.py, bench/tables.py),
never typed: each starts with the commit it was measured on, and no table lies outside a generated block.

The renderers are fed what the benchmarks' own ``summarize`` functions produce from synthetic samples, so a change to
a benchmark's results that its renderer does not follow fails here, not in the doc a month later."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from bench import checkpoint, hang, step_overhead
from bench.report import _BLOCK, DOC, ROOT, load, main, render, tables_outside_blocks
from bench.tables import KINDS, checkpoint_table, hang_table, recovery_table, step_overhead_table

CODE = {"commit": "abc1234", "uncommitted_changes": False}
MACHINE = {"cpus": 2, "python": "3.11.7", "torch": "2.13.0+cpu"}


def test_every_table_in_the_benchmarks_doc_matches_its_results_file() -> None:
    text = DOC.read_text()
    assert "<!-- bench:recovery " in text, "docs/benchmarks.md has no generated recovery table"
    assert render(text) == text, "a benchmark table differs from its results file: run python bench/report.py"
    assert main(["--check"]) == 0


def test_every_table_in_the_benchmarks_doc_lies_inside_a_generated_block() -> None:
    hand = tables_outside_blocks(DOC.read_text())
    assert hand == [], f"docs/benchmarks.md lines {hand} are a table typed by hand: generate it from a results file"


def test_every_generated_block_in_the_doc_starts_with_the_commit_it_was_measured_on() -> None:
    blocks = _BLOCK.findall(DOC.read_text())
    assert {kind for _, kind, *_ in blocks} >= {"recovery", "goodput", "checkpoint", "step_overhead"}
    for _, kind, source, body, _ in blocks:
        first = body.splitlines()[0]
        assert re.match(r"Measured on commit [0-9a-f]{7}\b", first), f"{kind} {source}: {first!r}"


def test_a_table_edited_by_hand_is_caught(tmp_path: Path) -> None:
    source = sorted((ROOT / "bench" / "results").glob("recovery-*.json"))[-1]
    doc = tmp_path / "doc.md"
    table = recovery_table(load(source))
    marker = f"<!-- bench:recovery {source.relative_to(ROOT)} -->\n"
    doc.write_text(marker + table + "<!-- /bench -->\n")
    assert main(["--check", "--doc", str(doc)]) == 0
    doc.write_text(marker + table.replace("|", "| 0.01 |", 1) + "<!-- /bench -->\n")
    assert main(["--check", "--doc", str(doc)]) == 1


def test_a_table_typed_outside_a_generated_block_is_caught(tmp_path: Path) -> None:
    source = sorted((ROOT / "bench" / "results").glob("recovery-*.json"))[-1]
    marker = f"<!-- bench:recovery {source.relative_to(ROOT)} -->\n"
    block = marker + recovery_table(load(source)) + "<!-- /bench -->\n"
    doc = tmp_path / "doc.md"
    doc.write_text("# Results\n\n" + block)
    assert main(["--check", "--doc", str(doc)]) == 0
    doc.write_text("# Results\n\n| ranks | s |\n|---|---|\n| 1 | 0.1 |\n\n" + block)
    assert tables_outside_blocks(doc.read_text()) == [3, 4, 5]
    assert main(["--check", "--doc", str(doc)]) == 1


def test_a_marker_of_an_unknown_kind_or_a_missing_file_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = tmp_path / "doc.md"
    for marker in ("<!-- bench:nonsense x.json -->\n", "<!-- bench:hang bench/results/hang-0000000.json -->\n"):
        doc.write_text(marker + "<!-- /bench -->\n")
        assert main(["--check", "--doc", str(doc)]) == 2
        assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_a_results_file_that_predates_recording_its_commit_is_named_by_its_file_name(tmp_path: Path) -> None:
    source = tmp_path / "checkpoint-text-classifier-base-a796a38.json"
    source.write_text(json.dumps({"repeats": 1, "results": [_checkpoint_row(1, contended=False)]}))
    results = load(source)
    assert results["code"] == {"commit": "a796a38", "from_file_name": True}
    first = checkpoint_table(results).splitlines()[0]
    assert first.startswith("Measured on commit a796a38 (named by the results file's name")


def _checkpoint_row(ranks: int, contended: bool) -> dict[str, Any]:
    def saves(blocked: list[float]) -> list[dict[str, Any]]:
        return [{"blocking_s": b, "total_s": 1.5 + b, "step_s": [0.3, 0.4]} for b in blocked]

    sample: dict[str, Any] = {"ranks": ranks, "parameters": 50_000_000, "checkpoint_bytes": 600_000_000}
    sample.update(blocking=saves([1.6, 1.7, 1.8]), background=saves([0.2, 0.09, 0.1]))
    sample.update(foreign_cores_before=0.01, foreign_cores_during=0.6 if contended else 0.02)
    return checkpoint.summarize(sample)


def test_the_checkpoint_table_gives_every_save_the_ratio_and_the_others_load() -> None:
    results: dict[str, Any] = {"code": CODE, "machine": MACHINE, "config": {"model": "linear-stack", "repeats": 3}}
    results["results"] = [_checkpoint_row(1, contended=False), _checkpoint_row(2, contended=True)]
    table = checkpoint_table(results)
    assert table.splitlines()[0].startswith("Measured on commit abc1234, 2 CPUs, Python 3.11.7, torch 2.13.0+cpu;")
    assert "| 1 | blocking | **1.700** (1.600, 1.700, 1.800) | 3.200 | 0.350 |  | 0.01 / 0.02 |" in table
    assert (
        "| 1 | asynchronous | **0.100** (0.200, 0.090, 0.100) | 1.600 | 0.350 | **5.9 %** (met) | 0.01 / 0.02 |"
        in table
    )
    assert "| 2 | asynchronous |" in table and "0.01 / 0.60* |" in table


def _overhead_sample(compute: str, ranks: int) -> dict[str, Any]:
    loops = ["baseline", "elasticd", *(["hot"] if ranks > 1 else [])]
    step = {"baseline": 0.020, "elasticd": 0.0202, "hot": 0.0203}
    sample: dict[str, Any] = {"compute": compute, "ranks": ranks, "micro_batch": 32, "hidden": 64}
    sample.update(parameters=9473, sleep_s=0.02, sync_interval_steps=9, beats_received=100, wall_s=60.0)
    sample.update(foreign_cores_before=0.0, foreign_cores_during=0.01, etcd_cores=0.0, comm_hooks={}, hot=None)
    sample.update(measured_s=50.0, thread_cpu_s={}, pieces={})
    sample["samples"] = {loop: [[step[loop]] * 4, [step[loop] * 1.01] * 4] for loop in loops}
    return sample


def test_the_step_overhead_table_has_the_cold_library_and_the_hot_path_against_their_targets() -> None:
    rows = [step_overhead.summarize(_overhead_sample("sleep", ranks)) for ranks in (1, 2)]
    settings = {"blocks": 2, "steps": 4, "warmup": 1, "target": 0.01, "hot_target": 0.02}
    table = step_overhead_table({"code": CODE, "machine": MACHINE, "settings": settings, "results": rows})
    assert table.splitlines()[0].startswith("Measured on commit abc1234")
    assert "| sleep | 1 | 0.01M | 20.10 | 20.30 | **+1.00 %** | 201 | +1.00..+1.00 % | +1.00 % | 0.00 / 0.01 |" in table
    assert "target 2 %" in table
    assert "| sleep | 2 | 20.10 | 20.30 | 20.40 | **+0.50 %** |" in table  # hot over cold; the 1-rank row has none
    assert table.count("| sleep | 1 |") == 1


def _hang_results() -> dict[str, Any]:
    samples = []
    for trial, (detect, first, contended) in enumerate([(0.55, 3.69, False), (0.47, 3.37, True)], 1):
        for scenario, shift in (("fixed", 1.4), ("auto", 0.0)):
            s = hang.Sample(scenario, trial, detect_s=detect + shift, first_step_s=first + shift, timeout_s=0.6)
            s.phases = {"detected": detect + shift, "diagnosed": detect + shift + 0.3, "first_step": first + shift}
            s.foreign_cores_during = 0.5 if contended else 0.0
            samples.append(s)
    torchrun = hang.Sample("torchrun", 1, watched_s=60.1, launcher_alive=True, processes_alive=3)
    torchrun.note = "not detected within 60 s (no step, failure or restart; torchrun still waiting)"
    false = hang.Sample("false_hang", 1, steps=200, completed=True, exit_code=0, hangs_cleared=1, hangs_detected=1)
    false.step_s = {"min": 0.14, "median": 0.33, "max": 0.41, "max_over_min": 2.93}
    false.auto_timeout_s = {"first": 2.0, "last": 2.05, "min": 1.99, "max": 2.05}
    config = {"trials": 2, "fixed_timeout_s": 2.0, "jitter_fault": "jitter@seconds=0.3"}
    config.update(false_hang_checkpoint_every_steps=5, assumed_gloo_timeout_s=1800.0)
    summary = hang.summarize([*samples, torchrun, false])
    return {"code": CODE, "machine": MACHINE, "config": config, "summary": json.loads(json.dumps(summary))}


def test_the_hang_table_has_medians_samples_and_marks_and_shows_torchruns_timeout_as_assumed() -> None:
    table = hang_table(_hang_results())
    assert table.splitlines()[0].startswith("Measured on commit abc1234")
    assert "| elasticd, --hang-timeout auto | **0.51** (0.55, 0.47*) | 0.81 | **3.53** (3.69, 3.37*) |" in table
    assert "| elasticd, --hang-timeout 2 | **1.91** (1.95, 1.87*) |" in table
    assert "none within the 60 s watched" in table
    assert "gloo's collective timeout, 1800 s (assumed, not measured)" in table
    assert not re.search(r"\d+x / \d+x", table), "an assumed constant divided by a measurement"
    assert "| 1 | 200 | 0.14 / 0.33 / 0.41, 2.9x | 1.99..2.05 | 1 | 1 | 0 | 0 | True |" in table
    assert "No false hang acted on: met; no false suspicion either: MISSED." in table
    assert "- elasticd, --hang-timeout auto: detected 0.51, diagnosed 0.81, first_step 3.53" in table


def test_every_kind_names_its_commit_on_its_first_line() -> None:
    assert set(KINDS) == {"recovery", "goodput", "checkpoint", "step_overhead", "hang"}
    dirty = {**_hang_results(), "code": {"commit": "abc1234", "uncommitted_changes": True}}
    assert hang_table(dirty).splitlines()[0].startswith("Measured on commit abc1234 plus uncommitted changes")
