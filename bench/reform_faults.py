"""The first step after a re-formation in place: what DDP's rebuilt buckets cost (issue 24's node loss at 1.2 GB).

After a node loss at ~100M parameters the survivors' first step at the new size ran 0.1-0.3 s longer than the ones
after it (bench/recovery.py ``node_loss_large``). A re-formation moves DDP to the new group
(``_update_process_group``, which resets the reducer) and rebuilds its buckets (``worker/hot/reform.py``); the
reducer's ``initialize_buckets`` always allocates new bucket memory, and glibc serves blocks that large from fresh
``mmap`` pages, which the first backward then faults in, page by page.

This measures it in one process (a gloo world of one, so nothing but the reducer is timed): examples/train.py's MLP
(default 4096 x 7, ~100M parameters, AdamW, 3 samples a step, one thread), ``--steady`` steps, then ``--reforms``
times a new group, the reducer moved to it and its buckets rebuilt as the hot path does, and ``--after`` steps. Per
step: seconds and minor page faults (``getrusage``). Nothing is asserted (a benchmark, not a test).

    python bench/reform_faults.py [--width 4096] [--depth 7] [--json OUT]

Raw results: ``bench/results/reform-faults-<short commit>[-dirty].json``.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/reform_faults.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist
from torch import nn

from bench.common import code_revision, free_port, report_header, results_path, write_results
from bench.workloads import mlp_parameters

FEATURES = 16  # examples/train.py's inputs


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def run(width: int, depth: int, steady: int, reforms: int, after: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    hidden = [m for _ in range(depth - 1) for m in (nn.Linear(width, width), nn.Tanh())]
    model = nn.parallel.DistributedDataParallel(
        nn.Sequential(nn.Linear(FEATURES, width), nn.Tanh(), *hidden, nn.Linear(width, 1))
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = torch.randn(3, FEATURES), torch.randn(3, 1)

    def step() -> dict[str, float]:
        began, faults = time.perf_counter(), _faults()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return {"seconds": round(time.perf_counter() - began, 4), "faults": _faults() - faults}

    steps = [step() for _ in range(steady)]
    cycles = []
    for _ in range(reforms):
        group = dist.new_group([0])
        began, faults = time.perf_counter(), _faults()
        model._update_process_group(group)  # as worker/hot/reform.py does
        model.reducer._push_all_rebuilt_params()
        model.reducer._rebuild_buckets()
        model._has_rebuilt_buckets = True
        reform = {"seconds": round(time.perf_counter() - began, 4), "faults": _faults() - faults}
        cycles.append({"reform": reform, "steps": [step() for _ in range(after)]})
    dist.destroy_process_group()
    return {"steady": steps, "cycles": cycles}


def summarise(result: dict[str, Any]) -> dict[str, Any]:
    """The steady step (median, the first one left out: it allocates AdamW's moments), the first step after each
    re-formation and the steps after it, each against the steady one."""
    steady = result["steady"][1:]
    typical_s = statistics.median(s["seconds"] for s in steady)
    typical_faults = statistics.median(s["faults"] for s in steady)
    firsts = [c["steps"][0] for c in result["cycles"]]
    later = [s for c in result["cycles"] for s in c["steps"][1:]]
    return {
        "steady_step_s": typical_s,
        "steady_step_faults": typical_faults,
        "first_after_reform_extra_s": round(statistics.median(s["seconds"] for s in firsts) - typical_s, 4),
        "first_after_reform_extra_faults": statistics.median(s["faults"] for s in firsts) - typical_faults,
        "later_extra_s": round(statistics.median(s["seconds"] for s in later) - typical_s, 4) if later else None,
        "reform_s": statistics.median(c["reform"]["seconds"] for c in result["cycles"]),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--depth", type=int, default=7)
    parser.add_argument("--steady", type=int, default=5)
    parser.add_argument("--reforms", type=int, default=3)
    parser.add_argument("--after", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    revision = code_revision()
    result = run(args.width, args.depth, args.steady, args.reforms, args.after)
    report = {
        **report_header("reform_faults.py", argv, revision),
        "config": {
            "width": args.width,
            "depth": args.depth,
            "parameters": mlp_parameters(args.width, args.depth),
            "world": "one process, gloo",
            "page_bytes": resource.getpagesize(),
        },
        **result,
        "summary": summarise(result),
    }
    write_results(args.json or results_path("reform-faults", revision), report)
    print(report["summary"], file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
