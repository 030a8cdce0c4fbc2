"""The on-disk layout is written in one place (elasticd/layout.py) and is the one DESIGN.md §3 promises: each path
the layout builds is pinned here, the checkpoint layout is checked against DESIGN.md's, and no other module spells
one of its names."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from elasticd import layout
from elasticd.layout import RunLayout, RuntimeLayout
from tests.source_literals import package_literals

ROOT = Path(__file__).resolve().parents[2]
DESIGN = ROOT.parent / "shared" / "DESIGN.md"

# DESIGN.md §3, "Checkpoint layout", as written there (the last test compares it with the file).
DESIGN_LAYOUT = """\
<checkpoint-dir>/<run-id>/step-000000001200/          committed: accelerate save_state files + elasticd.json
<checkpoint-dir>/<run-id>/step-000000001300.partial/  being written; never loaded, removed on the next start
"""

# Names the layout module spells, and no other module. ("nccl" is not here: other modules name torch's backend.)
LAYOUT_NAMES = {
    layout.MANIFEST,
    layout.DIAGNOSTICS_DIR,
    layout.HANG_SUMMARY,
    layout.NODE_EVIDENCE,
    layout.RUNTIME_PREFIX,
    layout.HANG_SCRATCH_PREFIX,
    layout.PROBE_PREFIX,
    "trace-rank-",
    "beats.sock",
    "board",
    "torchelastic",
    "step-",
    ".partial",
    "-hang",
    "rank-",
    "node-",
    "stacks-",
    "fr-",
    ".stacks.txt",
    ".flight-recorder.json",
    ".done",
}
# Literals equal to one of them that name something else there (each still occurs: see the stale check below).
OTHER_MEANINGS = {
    ("etcd/server.py", ".partial"): "the password file's temporary name, in etcd's own data dir",
    ("demo/story.py", "node-"): "the demo's node ids (node-1, node-2, ...), not a directory",
}


def test_the_layout_builds_the_paths_outside_tools_read() -> None:
    run = RunLayout(Path("/ckpt"), "job")
    runtime = RuntimeLayout(Path("/tmp/elasticd-x"))
    assert {
        "run": run.dir,
        "committed": run.checkpoint(1200),
        "partial": run.partial(1300, "9f3a"),
        "manifest": run.checkpoint(1200) / layout.MANIFEST,
        "marker": run.partial(1300, "9f3a") / layout.done_marker(2),
        "hang": run.hang(layout.hang_name(time.struct_time((2025, 3, 4, 5, 6, 7, 0, 0, 0)))),
        "summary": run.hang("t-hang") / layout.HANG_SUMMARY,
        "evidence": run.hang("t-hang") / layout.node_evidence_dir("n1") / layout.NODE_EVIDENCE,
        "stacks evidence": run.hang("t-hang") / layout.stacks_evidence("n1", 3),
        "fr evidence": run.hang("t-hang") / layout.flight_recorder_evidence("n1", 3),
        "nccl": Path(run.nccl_trace_prefix + "0"),
        "socket": runtime.socket,
        "board": runtime.board,
        "torch logs": runtime.torchelastic_logs,
        "slot": layout.slot_path(runtime.board, 1),
        "stacks": layout.stacks_path(runtime.board, 1),
        "fr": layout.flight_recorder_path(runtime.board, 1),
    } == {
        "run": Path("/ckpt/job"),
        "committed": Path("/ckpt/job/step-000000001200"),
        "partial": Path("/ckpt/job/step-000000001300.9f3a.partial"),
        "manifest": Path("/ckpt/job/step-000000001200/elasticd.json"),
        "marker": Path("/ckpt/job/step-000000001300.9f3a.partial/.rank-2.done"),
        "hang": Path("/ckpt/job/diagnostics/20250304T050607Z-hang"),
        "summary": Path("/ckpt/job/diagnostics/t-hang/summary.json"),
        "evidence": Path("/ckpt/job/diagnostics/t-hang/node-n1/evidence.json"),
        "stacks evidence": Path("/ckpt/job/diagnostics/t-hang/node-n1/rank-3.stacks.txt"),
        "fr evidence": Path("/ckpt/job/diagnostics/t-hang/node-n1/rank-3.flight-recorder.json"),
        "nccl": Path("/ckpt/job/diagnostics/nccl/trace-rank-0"),
        "socket": Path("/tmp/elasticd-x/beats.sock"),
        "board": Path("/tmp/elasticd-x/board"),
        "torch logs": Path("/tmp/elasticd-x/torchelastic"),
        "slot": Path("/tmp/elasticd-x/board/rank-1"),
        "stacks": Path("/tmp/elasticd-x/board/stacks-1.txt"),
        "fr": Path("/tmp/elasticd-x/board/fr-1.json"),
    }


def test_names_are_read_back_as_the_layout_wrote_them() -> None:
    assert layout.committed_step(layout.checkpoint_name(1200)) == 1200
    assert layout.is_partial(layout.partial_name(1300, "9f3a")) and layout.is_partial("step-000000001300.partial")
    for other in (
        "step-000000001200",
        "step-12",
        "step-000000001200.tmp",
        "diagnostics",
        "step-000000001300.a.b.partial",
    ):
        assert not layout.is_partial(other)
    for other in ("step-12", "step-000000001200.partial", "diagnostics", "step-0000000012000"):
        assert layout.committed_step(other) is None


def test_a_runtime_dir_is_created_with_its_board(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    runtime = RuntimeLayout.create()
    assert runtime.dir.parent == tmp_path and runtime.dir.name.startswith(layout.RUNTIME_PREFIX)
    assert runtime.board.is_dir() and (runtime.dir.stat().st_mode & 0o777) == 0o700


def test_the_checkpoint_layout_is_design_md_s() -> None:
    run = RunLayout(Path("<checkpoint-dir>"), "<run-id>")
    (committed, committed_note), (partial, _) = (line.split(maxsplit=1) for line in DESIGN_LAYOUT.splitlines())
    assert Path(committed) == run.checkpoint(1200) and layout.MANIFEST in committed_note
    assert Path(partial).parent == run.dir and layout.is_partial(Path(partial).name)
    # ours name their writer between the two (elasticd/lineage.py); DESIGN.md's, with none, is still recognised
    ours = run.partial(1300, "w").name
    assert ours.startswith(layout.checkpoint_name(1300) + ".") and ours.endswith(".partial")


@pytest.mark.skipif(not DESIGN.exists(), reason=f"{DESIGN} (the team's design notes) is not next to this checkout")
def test_design_layout_here_is_design_md_section_3() -> None:
    section = DESIGN.read_text().split("### Checkpoint layout", 1)[1]
    block = re.search(r"```\n(.*?)```", section, flags=re.DOTALL)
    assert block is not None and block.group(1) == DESIGN_LAYOUT


def test_no_module_but_layout_spells_a_layout_name() -> None:
    offenders = [
        str(literal)
        for literal in package_literals(outside="layout.py")
        if literal.text in LAYOUT_NAMES and (literal.path, literal.text) not in OTHER_MEANINGS
    ]
    assert offenders == []


def test_each_other_meaning_allowed_above_still_occurs() -> None:
    present = {(literal.path, literal.text) for literal in package_literals(outside="layout.py")}
    assert set(OTHER_MEANINGS) <= present
