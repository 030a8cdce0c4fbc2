"""The benchmarks' tables and verdicts for sharded jobs in place (issue 26): bench/recovery.py --sharded's 100M rows
against elasticd's cold restart, and bench/shard_mirror.py's mirror cost per K."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from bench import recovery, shard_mirror, workloads
from bench.table_kinds import KINDS
from bench.tables import recovery_table
from elasticd import options

_K = options.SHARD_MIRROR_EVERY.default  # the mirror interval the bench's elasticd nodes run (its default)

CODE = {"commit": "abc1234", "uncommitted_changes": False}
MACHINE = {"cpus": 2, "python": "3.11.7", "torch": "2.13.0+cpu"}


def test_sharded_runs_the_large_scenarios_on_the_100m_sharded_job_and_elasticd_cold_runs_them_when_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    jobs: list[tuple[str, str, list[str]]] = []

    def run_job(
        system: str,
        trial: int,
        trial_dir: Path,
        code: Path,
        workload: workloads.Workload,
        scenarios: Any,
        netns: bool = False,
        etcd_members: int = 1,
    ) -> list[recovery.Sample]:
        jobs.append((system, workload.name, [sc.value for sc in scenarios]))
        return []

    monkeypatch.setattr(recovery, "_run_job", run_job)
    asked = [recovery.Scenario(sc) for sc in ("join", "node_loss", "join_large", "node_loss_large")]
    for system in ("elasticd", "elasticd-cold"):
        recovery.run_system_trial(system, 1, tmp_path, tmp_path, asked, sharded=True)
    assert jobs == [
        ("elasticd", "sharded", ["join", "node_loss"]),
        ("elasticd", "sharded_large", ["join_large", "node_loss_large"]),
        ("elasticd-cold", "sharded", ["join", "node_loss"]),
        ("elasticd-cold", "sharded_large", ["join_large", "node_loss_large"]),
    ]
    large = workloads.SHARDED_LARGE
    assert large.script_args == workloads.LARGE.script_args and large.env == workloads.FSDP2_ENV
    assert (large.steady_steps, large.timeout_scale) == (workloads.LARGE.steady_steps, workloads.LARGE.timeout_scale)
    # not by default: a cold restart at ~100M parameters is minutes
    assert recovery.Scenario.NODE_LOSS_LARGE not in recovery.scenarios_for("elasticd-cold", False)


def _sharded_sample(system: str, scenario: str, trial: int, seconds: float, **fields: Any) -> recovery.Sample:
    sample = recovery.Sample(system, scenario, trial, seconds, **fields)
    figure = {"stall_total": 1.5} if "join" in scenario else {"beyond_step": 1.0}
    sample.milestones = {"first_step": seconds, **figure}
    return sample


def test_the_sharded_large_rows_are_judged_on_issue_26_and_the_loss_against_elasticds_cold_restart() -> None:
    hot = {"lost_steps": 0, "survivor_workers_restarted": False}
    samples = [
        _sharded_sample("elasticd", "node_loss_large", t, 1.5 + t / 10, resumed_step=40 + t, **hot) for t in (1, 2, 3)
    ]
    samples += [
        _sharded_sample("elasticd-cold", "node_loss_large", t, 40.0 + t, survivor_workers_restarted=True)
        for t in (1, 2, 3)
    ]
    samples += [_sharded_sample("elasticd", "join_large", t, 20.0) for t in (1, 2, 3)]
    rows = {row["scenario"]: row for row in json.loads(json.dumps(recovery.summarize(samples, sharded=True)))}
    loss = rows["node_loss_large"]
    assert loss["ratio_cold_over_elasticd"] == pytest.approx(42.0 / 1.7)
    assert loss["target"] == (
        f"first step at 2 <= 2 s: met; steps redone <= {_K - 1}: met; no survivor restarted: met;"
        " >= 5x cold (24.7x): met"
    )
    assert loss["elasticd"]["lost_steps"] == [0, 0, 0] and "lost_steps" not in loss["elasticd-cold"]
    assert rows["join_large"]["target"] == "pause in total <= 2 s: met"
    # the replicated job's 1.2 GB rows keep issue 24's targets
    replicated = {row["scenario"]: row["target"] for row in recovery.summarize(samples)}
    assert replicated["node_loss_large"].startswith("beyond one step <= 0.5 s: MISSED")

    config: dict[str, Any] = {"trials": 3, "max_restarts": 20}
    config["workloads"] = {
        w.name: {"script_args": list(w.script_args), "parameters": w.parameters, "state_bytes": w.state_bytes}
        for w in (workloads.SHARDED, workloads.SHARDED_LARGE)
    }
    config["sharded"] = {"env": dict(workloads.FSDP2_ENV), "in_place": True, "shard_mirror_every": 1}
    results = {"code": CODE, "machine": MACHINE, "config": config, "summary": list(rows.values())}
    results["samples"] = [asdict(s) for s in samples]
    table = recovery_table(results)
    first = table.splitlines()[0]
    assert "sharded_large job: `--width 4096 --depth 7" in first and "sharded job:" not in first
    assert "in place from shard mirrors in peers' memory (--shard-mirror-every 1)" in first
    assert "| tuned / elasticd | cold / elasticd | target |" in table
    row = "| **1.70** (1.60, 1.70, 1.80) | **42.00** (41.00, 42.00, 43.00) | - | 24.7x | first step at 2 <= 2 s: met;"
    assert row in table
    label = "- node loss (kill -9, 3 -> 2), 1.2 GB state"
    assert f"{label}, elasticd: steps redone 0, 0, 0; survivors' workers restarted no, no, no" in table
    assert f"{label}, elasticd-cold: survivors' workers restarted yes, yes, yes" in table
    assert "| pause in total <= 2 s: met |" in table  # issue 26's 2 s, not the 7 kB job's 0.5 s
    missed = [_sharded_sample("elasticd", "node_loss", 1, 2.5, lost_steps=_K, survivor_workers_restarted=True)]
    assert recovery.summarize(missed, sharded=True)[0]["target"] == (
        f"first step at 2 <= 2 s: MISSED; steps redone <= {_K - 1}: MISSED; no survivor restarted: MISSED"
    )


def _mirror_block(round_: int, every: int, steps_s: list[float], generations: int) -> dict[str, Any]:
    """One block of bench/shard_mirror.py's ranks: 400 MB, 0.1 s blocking and 0.5 s in all per generation."""
    per = {"blocking_s": 0.1, "total_s": 0.5, "bytes": 400_000_000}
    block = {"round": round_, "position": 0, "every": every, "steps_s": steps_s, "settle_s": 0.0}
    return {**block, "generations": generations, **{k: v * generations for k, v in per.items()}}


def test_the_shard_mirror_table_judges_each_k_on_its_mean_step_against_the_baseline() -> None:
    assert [shard_mirror.round_order([0, 1, 8], i) for i in range(3)] == [[0, 1, 8], [1, 8, 0], [8, 0, 1]]
    assert shard_mirror.round_order([0, 1, 8], 3) == [8, 1, 0]  # the second pass, reversed
    blocks = [
        _mirror_block(0, 0, [1.0, 1.0], 0),
        _mirror_block(0, 1, [1.1, 1.1], 3),  # the lead-in step's generation too
        _mirror_block(0, 8, [1.0, 1.16], 1),
        _mirror_block(1, 0, [1.0, 1.0], 0),
        _mirror_block(1, 1, [1.1, 1.3], 3),
        _mirror_block(1, 8, [1.0, 1.0], 0),
    ]
    parameters = workloads.mlp_parameters(4096, 7)
    config: dict[str, Any] = {"width": 4096, "depth": 7, "parameters": parameters, "ranks": 3}
    config.update(state_bytes=12 * parameters)
    config.update(global_batch=6, micro_batch=1, blocks=2, steps=2, warmup=3, target=0.05)
    results = {"code": CODE, "machine": MACHINE, "config": config, "foreign_cores_before": 0.1}
    results.update(foreign_cores_during=0.4, summary=shard_mirror.summarize(blocks))
    table = KINDS["shard_mirror"](json.loads(json.dumps(results)))
    first = table.splitlines()[0]
    assert first.startswith("Measured on commit abc1234, 2 CPUs, Python 3.11.7, torch 2.13.0+cpu; 3 gloo ranks")
    assert "width 4096 and depth 7: 100,761,601 parameters, 1.2 GB of fp32 weights and AdamW moments" in first
    assert "2 rounds of one 2-step block per configuration" in first and "0.10 / 0.40*" in first
    assert "| no mirrors (baseline) | 1.000 | 1.000 | - | - | - | 0 | - | - | - |" in table
    assert "| mirror every 1 step | 1.100 | 1.150 | **+15.00 %** (MISSED) | +10.00 % | +10.00..+20.00 % | 6 |" in table
    assert "| mirror every 8 steps | 1.000 | 1.040 | **+4.00 %** (met) | +0.00 % | +0.00..+8.00 % | 1 |" in table
    assert table.count("| 0.100 | 0.500 | 400.0 |") == 2
