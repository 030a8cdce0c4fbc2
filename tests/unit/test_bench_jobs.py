"""bench/recovery.py --job: the other scripts' jobs (an unchanged accelerate script, a Trainer script) run the files
they name, say their size truly, and are judged on issue 27's targets."""

from __future__ import annotations

import sys

import pytest

from bench import recovery
from bench.workloads import PLAIN, TRAINER, mlp_parameters
from tests.source_literals import PACKAGE

ROOT = PACKAGE.parent


@pytest.mark.parametrize("job", [PLAIN, TRAINER])
def test_each_job_runs_an_example_that_exists_and_prints_its_world_size(job: recovery.Workload) -> None:
    assert (ROOT / "examples" / job.script).is_file()
    assert recovery.JOBS[job.name] is job
    assert "world_size" in (ROOT / "examples" / job.script).read_text()  # the benchmark reads it from step lines


def test_the_jobs_state_their_parameters() -> None:
    assert PLAIN.parameters == mlp_parameters(32, 1)
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from text_classification import build_model, build_tokenizer
    finally:
        sys.path.remove(str(ROOT / "examples"))
    model = build_model(len(build_tokenizer()), 0)
    assert TRAINER.parameters == sum(p.numel() for p in model.parameters())


def test_issue_27s_targets_judge_the_plain_jobs_rows() -> None:
    assert recovery.plain_verdict(recovery.Scenario.NODE_LOSS, 3.1, 2.6) == "<= 4 s: met; >= 2.5x tuned: met"
    assert recovery.plain_verdict(recovery.Scenario.JOIN, 5.5, 1.9) == ""  # a join: plain_join_verdict
    assert recovery.plain_verdict(recovery.Scenario.HANG, 1.0, None) == ""
    rows = recovery.summarize(
        [recovery.Sample("elasticd", "node_loss", 1, 3.0), recovery.Sample("torchrun-tuned", "node_loss", 1, 9.0)],
        plain=True,
    )
    assert rows[0]["target"] == "<= 4 s: met; >= 2.5x tuned: met"


def test_a_plain_join_is_judged_on_the_running_groups_pause_in_total_against_tuned_torchruns() -> None:
    def row(mine: float, tuned: float) -> dict:
        return {
            "elasticd": {"median_s": 7.3, "phase_medians_s": {"first_step": 7.3, "stall_total": mine}},
            "torchrun-tuned": {"median_s": 7.5, "phase_medians_s": {"stall_total": tuned}},
        }

    assert recovery.plain_join_verdict(row(1.6, 6.0)) == (
        "pause in total <= 5 s: met; >= 2.5x tuned's pause (3.8x): met"
    )
    assert recovery.plain_join_verdict(row(5.5, 6.0)) == (
        "pause in total <= 5 s: MISSED; >= 2.5x tuned's pause (1.1x): MISSED"
    )
    assert recovery.plain_join_verdict({"elasticd": {"median_s": 7.3}}) == ""
