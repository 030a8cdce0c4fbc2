"""A join's pause at 1.2 GB, split: what the joiner's own start costs the running group on a shared host, and the rest.

On this benchmark's one host (2 cores) a joining node starts on the cores the running workers train on: its
daemon's and its worker's interpreter, torch, accelerate and a ~100M-parameter model take CPU the running group's
steps would have had. On separate hosts, as in production, that cost does not exist. ``bench/recovery.py
--scenarios join_large`` reports the running group's pause in total (``stall_total``) with it included.

This benchmark measures it on its own, then the real join, in one job (bench/recovery.py's 1.2 GB elasticd job, 2
nodes of one worker, loopback, embedded etcd):

1. **stand-in**: once the job has trained :data:`BASELINE_STEPS` steps, a third ``elasticd start`` of the same
   command line, but of a run of its own (another run id, ``--min-nodes 1 --max-nodes 1``) and ``--epochs 0``: its
   daemon starts, rendezvouses alone, starts its worker, which imports the same libraries, builds and prepares the
   same model and optimizer and ends before a first step. It joins nothing: the pause it causes, from its spawn to
   its exit, is contention alone (``stall_total``, with bench/recovery.py's arithmetic: every step interval's excess
   over the median of the intervals before, ``step_before``). It does less than a joiner (no AdamW moments
   allocated, no heal), so it is a lower bound of the joiner's own start;
2. **join**: once the job has trained :data:`BASELINE_STEPS` more steps, a real third node of the job: the running
   group's ``stall_total`` and longest pause (``stall``), against the intervals after the stand-in's end; rank 0's
   ``ready_to_step`` (its ``reconfigured`` figure: from the members' decision to admit to the end of the first step
   at 3, a whole step of 3 workers on 2 cores included); and the joiner's ``ready_to_member``, from its warm worker's
   bid (``join_requested``) to its being a healed member (``regrouped``): the wait for the step boundary the members
   agree on, then the admission.

The difference between the two totals is what the join costs beyond the joiner's start on shared cores: re-forming,
the heal and the joiner's extra work. Nothing is asserted (a benchmark, not a test).

    python bench/join_contention.py [--trials 3] [--workload large|small] [--cpus GROUP:JOINER] [--json OUT]
                                    [--logs DIR]

``--workload small`` runs the same on bench/recovery.py's 8 kB job (its baselines: :data:`SMALL_BASELINE_STEPS`
steps of ~0.06 s). ``--cpus 0:1`` gives the joiner a core of its own, as a host of its own would: the benchmark, etcd
and the two running nodes (their daemons and workers) on CPU 0, the stand-in and the joiner on CPU 1 (``taskset``).
The running workers then share one core (their steps take about twice as long) before and after the join alike, and
the stand-in's pause shows what contention is left.

Raw results: ``bench/results/join-contention-<short commit>[-small][pinned][-dirty].json``; docs/benchmarks.md's
table is generated from it (``python bench/report.py``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/join_contention.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (
    code_revision,
    report_header,
    results_path,
    snapshot_code,
    wait_until,
    write_results,
)
from bench.recovery import (
    MAX_NODES,
    MIN_NODES,
    STARTUP_TIMEOUT_S,
    ElasticdJob,
    _exited,
    _stamp,
    first_step_at,
    join_figures,
    pauses,
    quiet_moment,
    recovery_timeout_s,
    start_job,
    step_lines,
    wait_steady,
)
from bench.workloads import LARGE, SMALL, Workload

STANDIN = "standin"
# The stand-in ends on its own: a daemon start, a world of one, a model built, no step (~20 s here).
STANDIN_TIMEOUT_S = 240.0
# Step intervals each pause is judged against: the stand-in's before it, the join's after the stand-in's effect
# (the job's first steps run at 2.8 s here, its steps under a starting process's contention at over 4 s).
BASELINE_STEPS = 8
# The 8 kB job's steps take ~0.06 s: its baselines are this many steps (a few seconds).
SMALL_BASELINE_STEPS = 40
WORKLOADS = {"large": LARGE, "small": SMALL}
# A step of the 1.2 GB job takes seconds; one may take this long (seconds) before the benchmark gives up.
STEP_TIMEOUT_S = 60.0


def standin_command(job: ElasticdJob) -> list[str]:
    """The joiner's command line, as a run of its own that ends before its first step."""
    cmd = job.command(STANDIN)
    cmd[cmd.index("--run-id") + 1] = f"{job.run_id}-standin"
    cmd[cmd.index("--min-nodes") + 1] = "1"
    cmd[cmd.index("--max-nodes") + 1] = "1"
    cmd[cmd.index("--checkpoint-dir") + 1] = str(job.checkpoint_dir.parent / "standin-checkpoints")
    return [*cmd, "--epochs", "0"]  # the script's last --epochs wins (argparse)


def pinned(cmd: list[str], cpus: str | None) -> list[str]:
    """``cmd`` run on ``cpus`` only (``taskset -c``), or as it is without them."""
    return ["taskset", "-c", cpus, *cmd] if cpus else cmd


def measure_standin(job: ElasticdJob, cpus: str | None = None) -> tuple[dict[str, Any], float]:
    """The stand-in's life and the running group's pauses during it (against the steps before it); and when the
    group's steps were calm again after it (unix s)."""
    quiet_moment()
    node = job.launcher.start(STANDIN, pinned(standin_command(job), cpus))
    t0 = node.started_at
    wait_until(lambda: _exited(node) or None, STANDIN_TIMEOUT_S, "the stand-in's end", 0.1)
    t1 = time.time()
    calm_from = wait_steps_after(job, t1, 1)  # the step running at its end is counted, as a join's would be
    figures = {"seconds": round(t1 - t0, 3), "exit": node.proc.returncode, **pauses(job, t0, t1)}
    return figures, calm_from


def measure_join(job: ElasticdJob, calm_from: float, cpus: str | None = None) -> dict[str, Any]:
    """A real third node of the job: its pauses against the steps after ``calm_from``, its ready -> first step."""
    quiet_moment()
    name = f"n{len(job.launcher.nodes)}"
    joiner = job.launcher.start(name, pinned(job.node_command(name), cpus), job.env())
    t0 = joiner.started_at
    step = first_step_at(job, MAX_NODES, t0)
    if step is None:
        return {"note": f"did not join within {recovery_timeout_s(job):g} s"}
    t1 = float(step["t"])
    figures = {"seconds": round(t1 - t0, 3), **join_figures(job, t0, t1, baseline_from=calm_from)}
    # the joiner's own view: warm and asking (join_requested) until a member of the group, healed (regrouped)
    asked = [_stamp(e) for e in joiner.events("join_requested")]
    member = [_stamp(e) for e in joiner.events("regrouped")]
    if asked and member:
        figures["ready_to_member"] = round(member[0] - asked[0], 3)
    return figures


def wait_steps_after(job: ElasticdJob, t: float, count: int) -> float:
    """Wait for ``count`` step lines after ``t``; the time of the first of them."""

    def steps() -> list[float] | None:
        job.launcher.refresh()
        times = [float(r["t"]) for r in step_lines(job, t)]
        return times if len(times) >= count else None

    return wait_until(steps, STEP_TIMEOUT_S * count, f"{count} steps")[0]


def run_trial(
    trial: int, workdir: Path, code: Path, workload: Workload = LARGE, joiner_cpus: str | None = None
) -> dict[str, Any]:
    run_id = f"bench-contention-{trial}-{uuid.uuid4().hex[:6]}"
    print(f"[trial {trial}] starting the {workload.name} job", file=sys.stderr)
    with ExitStack() as stack:
        job = start_job(stack, "elasticd", workdir / f"trial-{trial}", run_id, code, workload)
        baseline = BASELINE_STEPS if workload is LARGE else SMALL_BASELINE_STEPS
        assert isinstance(job, ElasticdJob)
        job.start_initial()
        wait_steady(job, MIN_NODES, since=0.0, timeout_s=STARTUP_TIMEOUT_S)
        wait_steps_after(job, 0.0, baseline + 1)
        standin, calm_from = measure_standin(job, joiner_cpus)
        print(f"[trial {trial}] stand-in: {standin}", file=sys.stderr)
        wait_steps_after(job, calm_from, baseline + 1)  # a baseline of the join's own, without the stand-in
        join = measure_join(job, calm_from, joiner_cpus)
        print(f"[trial {trial}] join: {join}", file=sys.stderr)
        return {"trial": trial, "standin": standin, "join": join}


def summarise(trials: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the trials that measured both parts."""

    def median(part: str, key: str) -> float | None:
        values = [t[part][key] for t in trials if key in t[part]]
        return round(statistics.median(values), 3) if values else None

    both = [t for t in trials if "stall_total" in t["standin"] and "stall_total" in t["join"]]
    beyond = [t["join"]["stall_total"] - t["standin"]["stall_total"] for t in both]
    return {
        "trials": len(trials),
        "standin_seconds": median("standin", "seconds"),
        "standin_stall_total": median("standin", "stall_total"),
        "join_stall_total": median("join", "stall_total"),
        "join_stall": median("join", "stall"),
        "join_ready_to_step": median("join", "ready_to_step"),
        "join_ready_to_member": median("join", "ready_to_member"),
        "join_beyond_standin": round(statistics.median(beyond), 3) if beyond else None,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="large", help="the 1.2 GB job or the 8 kB one")
    parser.add_argument(
        "--cpus",
        default=None,
        metavar="GROUP:JOINER",
        help="e.g. 0:1: the benchmark, etcd and the running nodes on GROUP, the stand-in and the joiner on JOINER",
    )
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--logs", type=Path, default=None, help="keep the nodes' logs here (default: a temp dir)")
    args = parser.parse_args(argv)
    revision = code_revision()
    workload = WORKLOADS[args.workload]
    joiner_cpus = None
    if args.cpus:
        group, _, joiner_cpus = args.cpus.partition(":")
        if not group or not joiner_cpus:
            parser.error("--cpus takes GROUP:JOINER, e.g. 0:1")
        # every process started from here on (etcd, the running nodes) inherits it; the joiner's taskset widens
        os.sched_setaffinity(0, {int(c) for c in group.split(",")})
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="elasticd-contention-") as tmp:
        workdir = args.logs or Path(tmp)
        code = snapshot_code(Path(tmp) / "code")
        trials = [run_trial(trial, workdir, code, workload, joiner_cpus) for trial in range(1, args.trials + 1)]
    report = {
        **report_header("join_contention.py", argv, revision),
        "config": {
            "workload": workload.name,
            "parameters": workload.parameters,
            "state_bytes": workload.state_bytes,
            "nodes": "2 running, 1 stand-in or joiner; one worker each",
            "network": "loopback (127.0.0.1), one host",
            "cpus": args.cpus or "all, shared",
        },
        "duration_s": round(time.time() - started, 1),
        "trials": trials,
        "summary": summarise(trials),
    }
    tag = ("" if workload is LARGE else workload.name) + ("pinned" if joiner_cpus else "")
    write_results(args.json or results_path("join-contention", revision, tag), report)
    print(report["summary"], file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
