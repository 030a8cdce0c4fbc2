"""Shard mirror benchmark: what mirroring each rank's FSDP2 shards every K steps costs a sharded training step.

The job: ``--ranks`` processes (one per "node", ``nproc_per_node`` 1) in a gloo group on 127.0.0.1, each with one
intra-op thread, train examples/train.py's MLP (``Linear(16, W)``, Tanh, ``depth - 1`` x ``Linear(W, W)`` and Tanh,
``Linear(W, 1)``; ``--params 100e6`` at depth 7 gives bench/workloads.py's LARGE, width 4096: 100.8M parameters),
each Linear its own ``fully_shard`` unit, then the root, with AdamW (lr 1e-4): a global batch of 6 synthetic samples
in micro-batches of 1 (2 per rank at 3 ranks, the gradient reduced on the last, as accelerate's ``accumulate`` does
under FSDP2), then ``optimizer.step()`` and ``zero_grad()``.

Each rank keeps one mirror ring, built as ``ShardKeeper.start_epoch`` builds it (a gloo group of its own,
``ShardMirror(group, rank=, world=, nproc_per_node=1, epoch=)``). With mirrors on at K, after every K-th step of that
configuration (a configuration counts its own measured steps across its blocks: its first, then every K-th) each rank
calls ``ring.offer`` with ``sharded_tensors(model, optimizer)``'s local shards (parameters and AdamW's moments) and a
small ``meta``, as ``ShardKeeper.after_step`` does: the copy into host memory blocks the step (as does a previous
send still in flight), the send to the next rank runs in a thread while training goes on (the product's own classes
from elasticd/worker/hot/, not a copy).

In one set of processes, after ``--warmup`` unmeasured steps, ``--blocks`` rounds follow of one block of ``--steps``
measured steps per configuration (no mirrors, the baseline; mirrors every K for each K of ``--every``), each round in
another rotation of the configurations (reversed on every second pass; over as many rounds as configurations, each
is in every position once), so drift of the machine hits all alike. A block starts at a barrier and one unmeasured
lead-in step, which mirrors when the configuration's previous measured step did: a send overlaps the first measured
step as it would have in steady state. A step's time is the wall time between the ends of two consecutive steps on
rank 0, the offer included; the send still in flight after a block's last step is waited for (``ring.settle``, its
time recorded, not counted) so that it does not spill into the next block, whose lead-in stands in for it. Make
``--blocks`` x ``--steps`` a multiple of every K, so each K mirrors exactly one step in K.

Reported per configuration: the median and the mean step, the overhead of both against the baseline (the mean's is
the one to judge, target 5 %: it carries what only every K-th step pays), each round's overhead of block means (the
machine's noise), the generations sent, and rank 0's mirror figures per generation (``blocking_s``: the step's time in
``offer``; ``total_s``: ``offer`` to the exchange's end; bytes sent; lead-in steps' generations included), and the
bytes each rank sends per generation. The ranks run a copy of ``elasticd/`` and ``bench/`` taken at the start (others
edit the tree meanwhile); the benchmark waits for other processes to go quiet first and records the cores they used
before and during the run. Raw results (every step of every block) go to
``bench/results/shard-mirror-<commit>.json`` unless ``--json`` says otherwise; bench/report.py renders them (kind
``shard_mirror``). The defaults run 3 + 4 x 5 x (4 + 1) = 103 steps of the 100M-parameter job: about 10 min on 2
quiet cores (~4-5 s a step without mirrors, extrapolated from 20M and 40M parameters), 13 when others use a core.

    python bench/shard_mirror.py [--params 100e6] [--ranks 3] [--every 1 2 4 8] [--blocks 4] [--steps 4]
                                 [--warmup 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/shard_mirror.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (
    BASE_ENV,
    code_revision,
    foreign_cores,
    foreign_cpu,
    free_port,
    report_header,
    results_path,
    snapshot_code,
    text_table,
    wait_for_quiet,
    write_results,
)
from bench.workloads import mlp_parameters

FEATURES = 16  # examples/train.py's inputs
GLOBAL_BATCH, MICRO_BATCH, LR = 6, 1, 1e-4  # bench/workloads.py's LARGE
TARGET = 0.05  # the acceptance: step time at the default K within 5 % of the job without mirrors
RUN_TIMEOUT_S = 1800.0  # the whole set of ranks (the defaults take ~10 min on 2 cores)
SETTLE_TIMEOUT_S = 300.0  # a generation in flight at a block's end
QUIET_TIMEOUT_S = 120.0  # before the run, wait at most this long for other processes to use under a quarter core


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", type=float, default=100e6, help="approximate parameters (sets the width at --depth)")
    p.add_argument("--depth", type=int, default=7, help="hidden layers of examples/train.py's MLP")
    p.add_argument("--width", type=int, default=0, help="units per hidden layer (default: from --params)")
    p.add_argument("--ranks", type=int, default=3, help="processes, one per node (at least 2)")
    p.add_argument("--every", type=int, nargs="+", default=[1, 2, 4, 8], help="mirror intervals K to measure")
    p.add_argument("--blocks", type=int, default=4, help="measured rounds: one block per configuration each")
    p.add_argument("--steps", type=int, default=4, help="optimizer steps per block")
    p.add_argument("--warmup", type=int, default=3, help="unmeasured steps first (at least 1: AdamW's state)")
    p.add_argument("--json", type=Path, help="where to write the results (default: bench/results/shard-mirror-*.json)")
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)  # internal: a rank's process
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.ranks < 2 or args.warmup < 1 or min(args.every) < 1 or args.steps < 1 or args.blocks < 1:
        p.error("--ranks >= 2, --warmup >= 1, every K >= 1, --steps and --blocks >= 1")
    if args.rank is None and (uneven := [k for k in args.every if args.blocks * args.steps % k]):
        print(f"warning: --blocks x --steps is no multiple of K={uneven}: those mirror unevenly", file=sys.stderr)
    if not args.width:
        args.width = max(64, 64 * round(math.sqrt(args.params / max(1, args.depth - 1)) / 64))
    return args


def configurations(every: Sequence[int]) -> list[int]:
    """0 (no mirrors, the baseline), then each K once, in the order given."""
    return [0, *dict.fromkeys(every)]


def round_order(configs: Sequence[int], index: int) -> list[int]:
    """The blocks' order in round ``index``: a rotation by ``index``, reversed on every second pass over the
    rotations (over ``len(configs)`` rounds every configuration is in every position once; over twice as many, it
    also follows and precedes each other)."""
    n = len(configs)
    order = [*configs[index % n :], *configs[: index % n]]
    return order[::-1] if (index // n) % 2 else order


def label(every: int) -> str:
    return "no mirrors (baseline)" if every == 0 else f"mirror every {every} step{'s' if every > 1 else ''}"


# -- one rank ---------------------------------------------------------------------------------------------------


def rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from elasticd.worker.hot.mirror import MirrorStats, ShardMirror
    from elasticd.worker.hot.remesh import replicated_state, sharded_tensors
    from elasticd.worker.hot.shard_heal import MIRROR_GROUP_TIMEOUT

    torch.set_num_threads(1)
    rank, world = args.rank, args.ranks
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    hidden = [layer for _ in range(args.depth - 1) for layer in (nn.Linear(args.width, args.width), nn.Tanh())]
    model = nn.Sequential(nn.Linear(FEATURES, args.width), nn.Tanh(), *hidden, nn.Linear(args.width, 1))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    accumulation = max(1, GLOBAL_BATCH // (world * MICRO_BATCH))
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(accumulation, MICRO_BATCH, FEATURES, generator=g), torch.randn(accumulation, MICRO_BATCH, 1)

    def train_step() -> None:
        for i in range(accumulation):
            model.set_requires_gradient_sync(i == accumulation - 1)  # type: ignore[operator]  # FSDPModule's
            (((model(x[i]) - y[i]) ** 2).mean() / accumulation).backward()
        optimizer.step()
        optimizer.zero_grad()

    group = dist.new_group(backend="gloo", timeout=MIRROR_GROUP_TIMEOUT)  # as ShardKeeper.start_epoch
    ring = ShardMirror(group, rank=rank, world=world, nproc_per_node=1, epoch="bench")
    step = 0

    def step_and_mirror(every: int, mirror: bool) -> None:
        nonlocal step
        train_step()
        step += 1
        if every and mirror:  # what ShardKeeper.after_step does at a mirrored step
            tensors = {k: t.to_local() for k, t in sharded_tensors(model, optimizer).items()}
            ring.offer(step, tensors, {"step": step, "every": every, "replicated": replicated_state(model, optimizer)})

    for _ in range(args.warmup):
        step_and_mirror(0, False)
    configs = configurations(args.every)
    counts = dict.fromkeys(configs, 0)  # each configuration's measured steps so far
    blocks: list[dict[str, Any]] = []
    for index in range(args.blocks):
        for position, every in enumerate(round_order(configs, index)):
            seen = MirrorStats(ring.stats.blocking_s, ring.stats.total_s, ring.stats.bytes_sent, ring.stats.generations)
            dist.barrier()
            # the lead-in, unmeasured, stands for this configuration's previous measured step (its send was waited
            # for after its block): the first measured step overlaps a send in flight as in steady state
            step_and_mirror(every, every > 0 and (counts[every] - 1) % every == 0)
            last = time.perf_counter()
            steps_s = []
            for _ in range(args.steps):
                step_and_mirror(every, every > 0 and counts[every] % every == 0)
                counts[every] += 1
                now = time.perf_counter()
                steps_s.append(now - last)
                last = now
            settled = ring.settle(SETTLE_TIMEOUT_S)
            if not settled or ring.failed is not None:
                raise RuntimeError(f"rank {rank}: the mirror did not settle: {ring.failed or 'still in flight'}")
            s, block = ring.stats, {"round": index, "position": position, "every": every, "steps_s": steps_s}
            block.update(settle_s=time.perf_counter() - last, generations=s.generations - seen.generations)
            block.update(blocking_s=s.blocking_s - seen.blocking_s, total_s=s.total_s - seen.total_s)
            blocks.append({**block, "bytes": s.bytes_sent - seen.bytes_sent})
    shard_bytes = sum(t.to_local().numel() * t.element_size() for t in sharded_tensors(model, optimizer).values())
    mine = {"rank": rank, "shard_bytes": shard_bytes, "generations": ring.stats.generations}
    mine.update(bytes_sent=ring.stats.bytes_sent, blocking_s=ring.stats.blocking_s, total_s=ring.stats.total_s)
    mine.update(refused=ring.stats.refused)
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        parameters = sum(p.numel() for p in model.parameters())  # a DTensor counts its global shape
        result = {"parameters": parameters, "accumulation": accumulation, "blocks": blocks, "ranks": everyone}
        args.out.write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


# -- the benchmark process --------------------------------------------------------------------------------------


def run_ranks(args: argparse.Namespace, script: Path, workdir: Path) -> dict[str, Any]:
    """Start every rank (the frozen copy of this file), wait for all; the first to fail ends the others."""
    out, port = workdir / "result.json", free_port()
    common = ["--params", str(args.params), "--depth", str(args.depth), "--width", str(args.width)]
    common += ["--ranks", str(args.ranks), "--every", *map(str, args.every), "--blocks", str(args.blocks)]
    common += ["--steps", str(args.steps), "--warmup", str(args.warmup), "--port", str(port), "--out", str(out)]
    env = {**os.environ, **BASE_ENV, "PYTHONPATH": str(script.parent.parent)}
    procs = [
        subprocess.Popen([sys.executable, str(script), *common, "--rank", str(r)], env=env, start_new_session=True)
        for r in range(args.ranks)
    ]
    deadline = time.monotonic() + RUN_TIMEOUT_S
    try:
        while any(p.poll() is None for p in procs):
            failed = [p.returncode for p in procs if p.returncode not in (None, 0)]
            if failed or time.monotonic() > deadline:
                raise RuntimeError(f"a rank exited with {failed[0]}" if failed else f"over {RUN_TIMEOUT_S:g} s")
            time.sleep(0.5)
        if any(p.returncode != 0 for p in procs):
            raise RuntimeError(f"the ranks exited with {[p.returncode for p in procs]}")
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return dict(json.loads(out.read_text()))


def summarize(blocks: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per configuration (baseline first): its steps' median and mean, the overheads of both against the baseline,
    each round's overhead of block means, and rank 0's mirror figures per generation."""
    rows = []
    base: dict[str, Any] = {}
    base_means: dict[int, float] = {}
    for every in sorted({b["every"] for b in blocks}):
        mine = [b for b in blocks if b["every"] == every]
        steps = [t for b in mine for t in b["steps_s"]]
        generations = sum(b["generations"] for b in mine)
        row: dict[str, Any] = {"every": every, "blocks": len(mine), "steps": len(steps)}
        row.update(median_s=statistics.median(steps), mean_s=statistics.fmean(steps), generations=generations)
        means = {b["round"]: statistics.fmean(b["steps_s"]) for b in mine}
        row["block_means_s"] = [means[r] for r in sorted(means)]  # by round
        for key in ("blocking_s", "total_s", "bytes"):
            row[f"{key}_per_generation"] = sum(b[key] for b in mine) / generations if generations else None
        row["settle_s"] = statistics.fmean(b["settle_s"] for b in mine)
        base, base_means = (base, base_means) if base else (row, means)  # every == 0 sorts first
        row["overhead_median"] = row["median_s"] / base["median_s"] - 1
        row["overhead_mean"] = row["mean_s"] / base["mean_s"] - 1
        row["round_overheads"] = [means[r] / base_means[r] - 1 for r in sorted(means) if r in base_means]
        rows.append(row)
    return rows


def render(summary: Sequence[dict[str, Any]], ranks: Sequence[dict[str, Any]]) -> str:
    def num(value: float | None, scale: float = 1.0, digits: int = 3) -> str:
        return "-" if value is None else f"{value * scale:.{digits}f}"

    head = ["configuration", "median s", "mean s", "overhead median", "overhead mean", "rounds (mean)", "gens"]
    head += ["blocking s/gen", "total s/gen", "MB/gen", "settle s"]
    body = []
    for r in summary:
        spread = r["round_overheads"]
        rounds = f"{100 * min(spread):+.1f}..{100 * max(spread):+.1f} %" if spread else "-"
        body.append(
            [label(r["every"]), num(r["median_s"]), num(r["mean_s"]), f"{100 * r['overhead_median']:+.2f} %",
             f"{100 * r['overhead_mean']:+.2f} %", rounds, str(r["generations"]), num(r["blocking_s_per_generation"]),
             num(r["total_s_per_generation"]), num(r["bytes_per_generation"], 1e-6, 1), num(r["settle_s"])]
        )  # fmt: skip
    per_rank = ", ".join(
        f"rank {r['rank']} {r['bytes_sent'] / max(1, r['generations']) / 1e6:.1f} MB x {r['generations']}"
        for r in ranks
    )
    return text_table(head, body) + f"\nsent per generation (all configurations): {per_rank}"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.rank is not None:
        rank_main(args)
        return 0
    revision = code_revision()
    started = time.time()
    workdir = Path(tempfile.mkdtemp(prefix="elasticd-bench-shard-mirror-"))
    try:
        script = snapshot_code(workdir / "code", bench=True) / "bench" / Path(__file__).name
        cores_before = wait_for_quiet(QUIET_TIMEOUT_S)
        others, measured_from = foreign_cpu(), time.monotonic()
        result = run_ranks(args, script, workdir)
        cores_during = foreign_cores(others, foreign_cpu(), time.monotonic() - measured_from)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    summary = summarize(result["blocks"])
    print(render(summary, result["ranks"]))
    parameters = int(result["parameters"])
    config: dict[str, Any] = {"params": args.params, "width": args.width, "depth": args.depth, "features": FEATURES}
    config.update(parameters=parameters, state_bytes=3 * 4 * parameters, ranks=args.ranks, nproc_per_node=1)
    config.update(every=args.every, blocks=args.blocks, steps=args.steps, warmup=args.warmup, target=TARGET)
    config.update(global_batch=GLOBAL_BATCH, micro_batch=MICRO_BATCH, accumulation=result["accumulation"], lr=LR)
    assert parameters == mlp_parameters(args.width, args.depth, FEATURES), "not examples/train.py's MLP"
    report = {
        **report_header("shard_mirror.py", argv, revision),
        "config": config,
        "duration_s": round(time.time() - started, 1),
        "foreign_cores_before": round(cores_before, 2),
        "foreign_cores_during": round(cores_during, 2),
        "summary": summary,
        "ranks": result["ranks"],
        "blocks": result["blocks"],
    }
    write_results(args.json or results_path("shard-mirror", revision), report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
