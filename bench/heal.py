"""Heal benchmark: a join's heal at a real state size, against a raw gloo broadcast of the same bytes, in one run.

Three processes on this host, one gloo group over a TCPStore on 127.0.0.1 (``OMP_NUM_THREADS=1``), each with
examples/train.py's model (an MLP of ``--depth`` layers of ``--width`` units; default 4096 x 7: 100,761,601
parameters) and AdamW. Ranks 0 and 1 take the same optimizer step on the same batch: they hold the state; rank 2
does not (the joiner). Per trial, in one run, in alternating order:

- ``heal``: ``elasticd.worker.hot.heal.heal`` on all three: the joiner's fingerprint differs, so it receives the
  description and every tensor of the model and of AdamW's state, in pieces from both senders at once
  (``stripes.py``). Timed on the joiner (its ``HealReport``: from its call, after a barrier, to its return, checks
  and loading included), with the bytes it received.
- ``raw_broadcast``: ``broadcast`` of one uint8 tensor of exactly the joiner's received bytes from rank 0 to the
  joiner, on a gloo group of those two: what one sender moves on this box's gloo at best, the reference
  throughput of issue 24 ("heal throughput >= 50 % of a raw gloo broadcast of the same bytes").
- ``equal``: every member holds the state (after a node loss): the heal moves no state, its time is the
  fingerprints' cost (one pass over the parameters) and one all-gather.

Between trials the joiner's weights are shifted, so every ``heal`` moves the same bytes. Throughput is bytes over
seconds; nothing is asserted (a benchmark, not a test).

    python bench/heal.py [--width 4096] [--depth 7] [--trials 3] [--json OUT]

Raw results: ``bench/results/heal-<short commit>[-dirty].json``; docs/benchmarks.md's table is generated from it
(``python bench/report.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/heal.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from bench.common import code_revision, free_port, report_header, results_path, write_results
from bench.workloads import mlp_parameters
from elasticd.worker.hot.heal import heal
from elasticd.worker.state import TrainingState

WORLD = 3
JOINER = 2
FEATURES = 16  # examples/train.py's inputs
GROUP_TIMEOUT = timedelta(minutes=5)


def build(width: int, depth: int, seed: int) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    """examples/train.py's model, optimizer and schedule."""
    torch.manual_seed(seed)
    hidden = [layer for _ in range(depth - 1) for layer in (nn.Linear(width, width), nn.Tanh())]
    model = nn.Sequential(nn.Linear(FEATURES, width), nn.Tanh(), *hidden, nn.Linear(width, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1.0 + 0.01 * s))
    return model, optimizer, scheduler


def one_step(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any) -> None:
    batch = torch.randn(4, FEATURES, generator=torch.Generator().manual_seed(3))
    model(batch).pow(2).mean().backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)


def member(rank: int, port: int, width: int, depth: int, trials: int, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, WORLD, rank == 0, timeout=GROUP_TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=GROUP_TIMEOUT)
    pair = dist.new_group([0, JOINER], backend="gloo", timeout=GROUP_TIMEOUT)
    model, optimizer, scheduler = build(width, depth, seed=0 if rank != JOINER else 1)
    one_step(model, optimizer, scheduler)
    state = TrainingState() if rank == JOINER else TrainingState(step=1)
    samples: list[dict[str, Any]] = []
    received = 0  # what the joiner's last heal received: the raw broadcast sends as many bytes (trial 0 heals first)
    for trial in range(trials):
        order = ("heal", "raw_broadcast") if trial % 2 == 0 else ("raw_broadcast", "heal")
        for kind in (*order, "equal"):
            dist.barrier()
            if kind == "raw_broadcast":
                size = torch.tensor([received], dtype=torch.int64)
                dist.broadcast(size, src=JOINER)  # the joiner knows the heal's bytes; rank 0 sends that many
                seconds = 0.0
                if rank in (0, JOINER):
                    buffer = torch.ones(int(size.item()), dtype=torch.uint8)
                    dist.barrier(group=pair)
                    started = time.monotonic()
                    dist.broadcast(buffer, src=0, group=pair)
                    seconds = time.monotonic() - started
                    del buffer
                sample = {"kind": kind, "bytes": int(size.item()), "seconds": seconds}
            else:
                mine = state if kind == "heal" or rank != JOINER else TrainingState(step=1)
                healed, report = heal(0, model, optimizer, scheduler, mine)
                sample = {"kind": kind, "bytes": report.received, "seconds": report.seconds, "sent": report.sent}
                if kind == "heal":
                    received = report.received
                    assert rank != JOINER or (report.healed and healed.step == 1), report
            if rank == JOINER:
                samples.append({"trial": trial, **sample})
        if rank == JOINER:
            with torch.no_grad():
                for parameter in model.parameters():
                    parameter.add_(1.0)  # a receiver again at the next trial: the same bytes move
    if rank == JOINER:
        Path(out).write_text(json.dumps(samples))
    dist.destroy_process_group()


def summarize(samples: Sequence[dict[str, Any]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for kind in ("heal", "raw_broadcast", "equal"):
        rows = [s for s in samples if s["kind"] == kind]
        seconds = [float(s["seconds"]) for s in rows]
        median = statistics.median(seconds)
        nbytes = int(statistics.median(int(s["bytes"]) for s in rows))
        summary[kind] = {
            "median_s": median,
            "samples_s": seconds,
            "bytes": nbytes,
            "throughput_bytes_per_s": nbytes / median if median > 0 and nbytes else None,
        }
    heal_rate, raw_rate = (summary[k]["throughput_bytes_per_s"] for k in ("heal", "raw_broadcast"))
    summary["heal_vs_raw"] = heal_rate / raw_rate if heal_rate and raw_rate else None
    # per trial, the heal's throughput over the broadcast's next to it (the same bytes): robust to a drifting box
    by_trial = {(s["trial"], s["kind"]): float(s["seconds"]) for s in samples}
    trials = sorted({int(s["trial"]) for s in samples})
    pairs = [by_trial[(t, "raw_broadcast")] / by_trial[(t, "heal")] for t in trials if by_trial[(t, "heal")] > 0]
    summary["heal_vs_raw_by_trial"] = pairs
    summary["heal_vs_raw_median_of_trials"] = statistics.median(pairs) if pairs else None
    return summary


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=4096, help="units per layer (default 4096)")
    p.add_argument("--depth", type=int, default=7, help="layers (default 7: ~100M parameters at width 4096)")
    p.add_argument("--trials", type=int, default=3, help="trials (default 3); the table reports medians")
    p.add_argument("--json", type=Path, help="where to write the raw results (default: bench/results/heal-<commit>)")
    args = p.parse_args(argv)
    if args.trials < 1 or args.width < 1 or args.depth < 1:
        p.error("--trials, --width and --depth must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    revision = code_revision()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="elasticd-bench-heal-") as tmp:
        out = str(Path(tmp) / "samples.json")
        mp.start_processes(
            member,
            args=(free_port(), args.width, args.depth, args.trials, out),
            nprocs=WORLD,
            start_method="spawn",
        )
        samples = json.loads(Path(out).read_text())
    parameters = mlp_parameters(args.width, args.depth, FEATURES)
    report = {
        **report_header("heal.py", argv, revision),
        "config": {
            "world": WORLD,
            "width": args.width,
            "depth": args.depth,
            "parameters": parameters,
            "state": "fp32 weights and AdamW moments: 12 bytes a parameter",
            "network": "one host, 127.0.0.1, gloo (CPU), OMP_NUM_THREADS=1",
            "trials": args.trials,
        },
        "duration_s": time.monotonic() - started,
        "summary": summarize(samples),
        "samples": samples,
    }
    write_results(args.json or results_path("heal", revision), report)
    for kind in ("heal", "raw_broadcast", "equal"):
        row = report["summary"][kind]
        rate = row["throughput_bytes_per_s"]
        print(f"{kind:14} {row['median_s']:.3f} s  {row['bytes'] / 1e9:.3f} GB  {(rate or 0) / 1e9:.2f} GB/s")
    summary = report["summary"]
    print(f"heal / raw broadcast throughput: {summary['heal_vs_raw']:.2f} of the medians,", end=" ")
    print(f"{summary['heal_vs_raw_median_of_trials']:.2f} median of the trials' pairs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
