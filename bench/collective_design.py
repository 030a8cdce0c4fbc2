"""What a collective given up on costs, in the two designs issue 24 asks to choose between, measured on this box.

**In process, bounded** (what elasticd does, ``elasticd/worker/hot/given_up.py``): gloo's group stays in the
trainer; a collective given up on is held until it has ended, its group until nothing given up on in it is pending,
then released. Four gloo ranks (one process each, ``OMP_NUM_THREADS=1``) all-reduce one DDP-sized bucket (25 MB of
float32); rank 3 is killed (``os._exit``) while it is in flight. In gloo's ring, rank 3's neighbours (0 and 2) see
a reset at once; rank 1 waits on them. Per trial, the neighbours release their group either at once when their own
collective ended (``release``) or only after holding it ``--hold`` seconds (``hold``: what keeping every old group
until its timeout does). Measured on each survivor: how long its collective stayed pending, how long dropping the
ended Work and then the group took.

**In a child process** (torchft's ``ProcessGroupBabyGloo``): the collectives run in a child the trainer can kill.
Its floor, without building it: ``spawn_ready`` is a child started (``spawn``, as CUDA requires) up to a gloo group
of one formed in it, the cost of replacing a killed child in every recovery unless a spare is kept warm;
``round_trip`` is one message each way over a ``multiprocessing`` pipe to a child that answers at once, the least a
bucket handed to the child pays (the tensor itself in shared memory, shared once); ``child_rss`` is what the child
holds once torch is imported in it.

    python bench/collective_design.py [--trials 3] [--hold 5] [--json OUT]

Raw results: ``bench/results/collective-design-<short commit>[-dirty].json``; docs/benchmarks.md's table is
generated from it (``python bench/report.py``). Nothing is asserted (a benchmark, not a test).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/collective_design.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.common import code_revision, free_port, report_header, results_path, write_results

WORLD = 4
VICTIM = 3
BUCKET_FLOATS = 25 * 2**20 // 4  # DDP's default bucket: 25 MiB
GROUP_TIMEOUT = timedelta(seconds=120)
ROUND_TRIPS = 2000


def _rank(rank: int, port: int, hold_s: float, results: Any) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    store = dist.TCPStore("127.0.0.1", port, WORLD, rank == 0, timeout=timedelta(seconds=60))
    group: Any = dist.ProcessGroupGloo(dist.PrefixStore("design", store), rank, WORLD, GROUP_TIMEOUT)
    bucket = torch.ones(BUCKET_FLOATS)
    group.allreduce([torch.ones(4)]).wait()  # connected: the timed collective is the only one in flight
    if rank == VICTIM:
        group.allreduce([bucket])
        time.sleep(0.02)
        os._exit(9)
    start = time.monotonic()
    work = group.allreduce([bucket])
    while not work.is_completed() and time.monotonic() - start < GROUP_TIMEOUT.total_seconds():
        time.sleep(0.001)
    pending_s = time.monotonic() - start
    if rank != 1:
        time.sleep(hold_s)  # a neighbour of the dead rank keeps the group (a survivor holding it to its timeout)
    began = time.monotonic()
    del work
    work_drop_s = time.monotonic() - began
    began = time.monotonic()
    del group
    group_drop_s = time.monotonic() - began
    results.put({"rank": rank, "pending_s": pending_s, "work_drop_s": work_drop_s, "group_drop_s": group_drop_s})
    store.set(f"done{rank}", "1")
    if rank == 0:  # the store's host outlives the others' last call to it
        store.wait([f"done{r}" for r in range(WORLD) if r != VICTIM], timedelta(seconds=60))


def _given_up_trial(hold_s: float) -> list[dict[str, Any]]:
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    procs = [context.Process(target=_rank, args=(r, port, hold_s, results)) for r in range(WORLD)]
    for proc in procs:
        proc.start()
    rows = [results.get(timeout=GROUP_TIMEOUT.total_seconds() + 60) for _ in range(WORLD - 1)]
    for proc in procs:
        proc.join(timeout=60)
    return sorted(rows, key=lambda row: row["rank"])


_CHILD = (
    "import sys, torch, torch.distributed as dist; "
    "dist.ProcessGroupGloo(dist.HashStore(), 0, 1); print('ready', flush=True); sys.stdin.readline()"
)


def _spawn_ready() -> tuple[float, float]:
    """Seconds from starting a child to its gloo group formed, and the child's RSS then (MiB)."""
    began = time.monotonic()
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_quiet_env()
    )
    assert child.stdout is not None and child.stdin is not None
    assert child.stdout.readline().strip() == "ready"
    seconds = time.monotonic() - began
    status = Path(f"/proc/{child.pid}/status").read_text().splitlines()
    rss_kib = int(next(line for line in status if line.startswith("VmRSS:")).split()[1])
    child.stdin.write("\n")
    child.stdin.close()
    child.wait(timeout=30)
    return seconds, rss_kib / 1024


def _quiet_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def _echo(conn: Any) -> None:
    while (message := conn.recv()) is not None:
        conn.send(message)


def _round_trip_us() -> list[float]:
    """One bucket's message each way to a child that answers at once (the tensor shared once, not per message)."""
    context = mp.get_context("spawn")
    ours, theirs = context.Pipe()
    child = context.Process(target=_echo, args=(theirs,))
    child.start()
    bucket = torch.zeros(BUCKET_FLOATS).share_memory_()
    ours.send(bucket)  # shared once: what the child then reduces in place
    ours.recv()
    samples = []
    for index in range(ROUND_TRIPS):
        began = time.perf_counter()
        ours.send(("allreduce", index))
        ours.recv()
        samples.append((time.perf_counter() - began) * 1e6)
    ours.send(None)
    child.join(timeout=30)
    return samples


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--hold", type=float, default=5.0, help="seconds the dead rank's neighbours keep the group")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    revision = code_revision()
    trials: list[dict[str, Any]] = []
    for trial in range(args.trials):
        for mode, hold_s in (("release", 0.0), ("hold", args.hold)):
            rows = _given_up_trial(hold_s)
            trials.append({"trial": trial, "mode": mode, "hold_s": hold_s, "ranks": rows})
            print(mode, [(r["rank"], round(r["pending_s"], 3)) for r in rows], file=sys.stderr)
    spawns = [_spawn_ready() for _ in range(args.trials)]
    trips = _round_trip_us()

    def pending(mode: str, across: bool) -> list[float]:
        return [r["pending_s"] for t in trials if t["mode"] == mode for r in t["ranks"] if (r["rank"] == 1) == across]

    drops = [r for t in trials for r in t["ranks"]]
    summary = {
        "pending_across_release_s": pending("release", True),
        "pending_across_hold_s": pending("hold", True),
        "pending_neighbours_s": pending("release", False) + pending("hold", False),
        "work_drop_s_max": max(r["work_drop_s"] for r in drops),
        "group_drop_s_max": max(r["group_drop_s"] for r in drops),
        "spawn_ready_s": [s for s, _ in spawns],
        "child_rss_mib": statistics.median(rss for _, rss in spawns),
        "round_trip_us_median": statistics.median(trips),
        "round_trip_us_p99": sorted(trips)[int(0.99 * len(trips))],
    }
    report = {
        **report_header("collective_design.py", argv, revision),
        "config": {
            "world": WORLD,
            "bucket_bytes": BUCKET_FLOATS * 4,
            "hold_s": args.hold,
            "trials": args.trials,
            "round_trips": ROUND_TRIPS,
            "network": "loopback (127.0.0.1), one host",
        },
        "trials": trials,
        "summary": summary,
    }
    write_results(args.json or results_path("collective-design", revision), report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
