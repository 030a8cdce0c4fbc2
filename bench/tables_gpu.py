"""docs/benchmarks.md's table of a bench/gpu_check.py run: one row per scenario, its verdict and what it measured."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from bench.tables import _table, provenance

Row = Callable[[dict[str, Any]], str]


def _s(value: Any) -> str:
    return "-" if value is None else f"{value:.3f} s"


def _elastic(r: dict[str, Any]) -> str:
    if r["scenario"] == "elastic_join":
        return f"spawn of the 3rd node to the first step at 3 nodes: {_s(r.get('seconds'))}"
    restarted = "no survivor restarted" if r.get("survivor_workers_restarted") is False else "a survivor restarted"
    return (
        f"kill -9 to the first step at 2 nodes: {_s(r.get('seconds'))}, steps redone {r.get('lost_steps')}, {restarted}"
    )


def _checkpoint(r: dict[str, Any]) -> str:
    sync, run = r["sync"], r["async"]
    resume = r.get("resume", {})
    return (
        f"{r['state_bytes'] / 2**20:,.0f} MiB state: training blocked {_s(run['blocking_s'][0])} by the first "
        f"asynchronous save (then {', '.join(_s(v) for v in run['blocking_s'][1:])}), "
        f"{_s(statistics.median(sync['blocking_s']))} by a blocking one (median of {len(sync['blocking_s'])}); "
        f"asynchronous commit after {_s(statistics.median(run['total_s']))}; a join resumed both workers at step "
        f"{(resume.get('resumed_steps') or ['-'])[0]}, first step at 2 nodes {_s(resume.get('seconds'))} after "
        "the spawn"
    )


def _bf16(r: dict[str, Any]) -> str:
    guard = ", ".join(f"step {g['step']}: {g['action']}" for g in r.get("guard", [])) or "none"
    return (
        f"autocast {r.get('autocast')} on {r.get('device')}, {r.get('steps_per_s')} steps/s, guard: {guard}, "
        f"ended at step {r.get('final_step')} with loss {r.get('final_loss')}"
    )


def _device_error(r: dict[str, Any]) -> str:
    return (
        f"{(r.get('error') or '').split(':')[0] or 'error'} in rank {r['worker_failed'].get('rank')} (exit "
        f"{r['worker_failed'].get('exitcode')}); survivors {r.get('survivors')} (steps redone "
        f"{r.get('survivors_lost_steps')}), failed worker {r.get('failed_worker')}; next step "
        f"{_s(r.get('seconds_to_survivors_step'))}, whole group {_s(r.get('seconds_to_whole_group_step'))}"
    )


def _cycles(r: dict[str, Any]) -> str:
    cycles = r.get("cycles") or []
    if not cycles:
        return "-"
    replace = statistics.median(c["replace_s"] for c in cycles[1:] or cycles)
    reduce = statistics.median(c["all_reduce_s"] for c in cycles[1:] or cycles)
    return (
        f"{len(cycles)} cycles on {r.get('gpu', r.get('device'))}: replace (retire + form) {_s(replace)}, "
        f"4 MB all-reduce {_s(reduce)} (medians after the first); ncclCommShrink offered: "
        f"{any(c['can_shrink'] for c in cycles)}"
    )


def _nccl_multi(r: dict[str, Any]) -> str:
    if "not_run" in r:
        return f"not run: {r['not_run']}"
    return (
        f"{r.get('workers')} workers on {r.get('backend')}{' (one per GPU)' if r.get('backend') == 'nccl' else ''}"
        f"{', the hook polling every bucket' if r.get('poll') else ''}, re-formed by "
        f"{', '.join(r.get('methods') or ['-'])}: kill -9 of "
        f"rank 0 to the first step at {r['workers'] - 1}: {_s(r.get('node_loss_recovered_s'))}, SIGSTOP (declared "
        f"dead at once) {_s(r.get('hang_recovered_s'))}; a warm join stalled the members "
        f"{_s(r.get('join_members_stall_s'))}"
    )


def _row(record: dict[str, Any]) -> str:
    name = record["scenario"]
    for prefix, row in (
        ("elastic_", _elastic),
        ("checkpoint_", _checkpoint),
        ("bf16_", _bf16),
        ("device_error", _device_error),
        ("backend_cycles", _cycles),
        ("nccl_multi", _nccl_multi),
    ):
        if name.startswith(prefix):
            try:
                return row(record)
            except (KeyError, IndexError, TypeError, statistics.StatisticsError):
                return "-"
    return "-"


def gpu_check_table(report: dict[str, Any]) -> str:
    """Where it ran, then a row per scenario: its verdict and what it measured."""
    gpus = ", ".join(report.get("gpus") or []) or "no GPU: every worker on the CPU"
    head = (
        f"{provenance(report)}; `{' '.join(report['command'])}`, device {report['device']} ({gpus}), "
        f"{report['seconds']:.0f} s in all."
    )
    rows = [
        [r["scenario"], "ok" if r.get("problem") is None else f"FAILED: {r['problem']}", _row(r)]
        for r in report["records"]
    ]
    return "\n".join([head, "", *_table(["scenario", "verdict", "what it measured"], rows), ""])
