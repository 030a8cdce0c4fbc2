"""Memory across in-place recoveries: a surviving worker's RSS through kill / join cycles, and how the run ends.

examples/train.py's MLP (``--width`` x ``--depth``, default 2048 x 4: 12.6M parameters, AdamW: 151 MB of weights and
moments per worker; ``--width 4096`` is the 50M job, 604 MB) on 3 nodes of one worker (``elasticd start``, recovery
in place, an embedded etcd with the fast profile, loopback). Node ``m-0`` is never disturbed; per cycle, the oldest
other node is killed (kill -9, 3 -> 2, a recovery in place) and a new node started (2 -> 3, a join in place):
``--cycles 25`` is 50 recoveries in a row. After the baseline and after each cycle, once the group trained
``SETTLE_STEPS`` steps at 3, ``m-0``'s worker's RSS is read (through psutil) every 20 ms for 2 s, and the least
value kept (what it holds between steps). The run then ends by ``elasticd stop``: each node's exit status, and
whether any worker ended without its interpreter's teardown (the exit guard's ``teardown_skipped_at_exit``).

The baseline is taken once the job has made its first two saves (the checkpoint writer keeps one snapshot's worth of
host memory for the next one: the job's, not a recovery's). Growth is judged against the state size (issue 24:
"grows by less than 5 % of the state size"), from the sample after the first cycle (the first recovery allocates
what every later one reuses: the heal's buffers, the next group's), and shown from the baseline too. The worker's
pid is checked to be the same in every sample (in place: no restart). Nothing is asserted (a benchmark, not a test).

    python bench/recovery_memory.py [--cycles 25] [--width 2048] [--depth 4] [--workdir DIR] [--json OUT]

Raw results: ``bench/results/recovery-memory-<short commit>[-dirty].json``; docs/benchmarks.md's figures are
generated from it (``python bench/report.py``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/recovery_memory.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psutil

from bench.common import code_revision, report_header, results_path, snapshot_code, wait_until, write_results
from bench.recovery import (
    CHECKPOINT_EVERY_STEPS,
    ElasticdJob,
    first_step_at,
    start_job,
    steps_at,
    wait_steady,
    worker_pids,
)
from bench.workloads import Workload, mlp_parameters

OBSERVED = "m-0"
SETTLE_STEPS = 3  # steps at 3 after a join before a sample: the heal's and the old group's memory had its chance
# A sample is the least RSS read every SAMPLE_EVERY_S over SAMPLE_S (more than a step): what the worker holds between
# steps, without the activations and gradients of the step it is in (tens of MB here, more than the growth judged).
SAMPLE_S, SAMPLE_EVERY_S = 2.0, 0.02
STOP_TIMEOUT_S = 120.0
# The baseline is taken past this step: after the job's first two saves (every 10 steps, bench/recovery.py), since
# the checkpoint writer keeps one snapshot's worth of host memory for the next save (worker/saver.py: reused
# buffers), which is the job's and no recovery's.
BASELINE_STEP = 2 * CHECKPOINT_EVERY_STEPS + SETTLE_STEPS


def workload(width: int, depth: int) -> Workload:
    return Workload(
        "memory",
        (
            "--width",
            str(width),
            "--depth",
            str(depth),
            "--lr",
            "1e-4",
            "--global-batch",
            "6",
            "--micro-batch",
            "1",
            "--epochs",
            "1000",
        ),
        mlp_parameters(width, depth),
        steady_steps=SETTLE_STEPS,
        timeout_scale=2.0,
    )


def rss_bytes(pid: int) -> tuple[int, int]:
    """The least and the most RSS of ``pid`` read over SAMPLE_S."""
    process = psutil.Process(pid)
    seen = []
    deadline = time.monotonic() + SAMPLE_S
    while time.monotonic() < deadline:
        seen.append(int(process.memory_info().rss))
        time.sleep(SAMPLE_EVERY_S)
    return min(seen), max(seen)


def sample(cycle: int, pid: int) -> dict[str, Any]:
    least, most = rss_bytes(pid)
    return {"cycle": cycle, "pid": pid, "rss_bytes": least, "rss_max_bytes": most, "t": time.time()}


def settle(job: ElasticdJob, after: float) -> None:
    """Wait until the group trained SETTLE_STEPS steps at 3 after ``after``."""
    wait_steady(job, 3, after)


def _past(job: ElasticdJob, step: int) -> bool:
    job.launcher.refresh()
    return any(s["step"] >= step for s in steps_at(job, 3, 0.0))


def run(cycles: int, width: int, depth: int, workdir: Path) -> dict[str, Any]:
    with ExitStack() as stack:
        code = snapshot_code(workdir / "code")
        job = start_job(stack, "elasticd", workdir / "run", "memory", code, workload(width, depth))
        assert isinstance(job, ElasticdJob)
        observed = job.start_node(OBSERVED)
        others = [job.start_node("m-1"), job.start_node("m-2")]
        settle(job, 0.0)
        wait_until(lambda: _past(job, BASELINE_STEP), 300, f"step {BASELINE_STEP}")
        pid = worker_pids(observed)[0]
        samples = [sample(0, pid)]
        print(f"baseline: {samples[0]['rss_bytes'] / 2**20:.1f} MiB", file=sys.stderr)
        for cycle in range(1, cycles + 1):
            victim = others.pop(0)
            killed_at = victim.kill()
            if first_step_at(job, 2, killed_at) is None:
                raise RuntimeError(f"cycle {cycle}: no step at 2 after the kill\n{observed.tail()}")
            joined_at = time.time()
            others.append(job.start_node(f"m-{cycle + 2}"))
            if first_step_at(job, 3, joined_at) is None:
                raise RuntimeError(f"cycle {cycle}: no step at 3 after the join\n{observed.tail()}")
            settle(job, steps_at(job, 3, joined_at)[0]["t"])
            samples.append(sample(cycle, worker_pids(observed)[0]))
            print(f"cycle {cycle}: {samples[-1]['rss_bytes'] / 2**20:.1f} MiB", file=sys.stderr)
        stop = [sys.executable, "-m", "elasticd", "stop", "--etcd", job.etcd, "--run-id", job.run_id]
        subprocess.run(stop, check=True, timeout=60, env={**os.environ, **job.launcher.env}, capture_output=True)
        live = [observed, *others]
        codes: dict[str, int | None] = {}
        for node in live:
            try:
                codes[node.name] = node.proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                codes[node.name] = None
        job.launcher.refresh()
        skipped = {n.name: len(n.events("teardown_skipped_at_exit")) for n in job.launcher.nodes.values()}
        restarts = {n.name: len(n.events("restart")) for n in live}
        recoveries = [e for e in observed.events("reconfigured") if "node_id" not in e]
    return {
        "samples": samples,
        "exit_codes": codes,
        "teardown_skipped": skipped,
        "restarts": restarts,
        "recoveries": [{"reason": e.get("reason"), "seconds": e.get("seconds")} for e in recoveries],
    }


def summarise(result: dict[str, Any], state_bytes: int) -> dict[str, Any]:
    rss = [s["rss_bytes"] for s in result["samples"]]
    after_first = rss[1] if len(rss) > 1 else rss[0]
    return {
        "state_bytes": state_bytes,
        "recoveries_in_place": len(result["recoveries"]),
        "same_worker": len({s["pid"] for s in result["samples"]}) == 1,
        "rss_baseline_bytes": rss[0],
        "rss_after_first_cycle_bytes": after_first,
        "rss_last_bytes": rss[-1],
        "growth_from_first_cycle_bytes": rss[-1] - after_first,
        "growth_from_first_cycle_of_state": (rss[-1] - after_first) / state_bytes,
        "growth_from_baseline_of_state": (rss[-1] - rss[0]) / state_bytes,
        "all_exited_0": all(code == 0 for code in result["exit_codes"].values()),
        "teardown_skipped_total": sum(result["teardown_skipped"].values()),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=25, help="kill / join cycles (2 recoveries each)")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--workdir", type=Path, default=None, help="keep the nodes' logs here (default: a temp dir)")
    args = parser.parse_args(argv)
    revision = code_revision()
    job_workload = workload(args.width, args.depth)
    if args.workdir is not None:  # kept: the nodes' logs
        result = run(args.cycles, args.width, args.depth, args.workdir)
    else:
        with tempfile.TemporaryDirectory(prefix="elasticd-memory-") as tmp:
            result = run(args.cycles, args.width, args.depth, Path(tmp))
    report = {
        **report_header("recovery_memory.py", argv, revision),
        "config": {
            "cycles": args.cycles,
            "width": args.width,
            "depth": args.depth,
            "parameters": job_workload.parameters,
            "nodes": 3,
            "network": "loopback (127.0.0.1), one host",
            "settle_steps": SETTLE_STEPS,
        },
        **result,
        "summary": summarise(result, job_workload.state_bytes),
    }
    write_results(args.json or results_path("recovery-memory", revision), report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
