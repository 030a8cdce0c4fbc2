"""Checkpoint save benchmark: how long a training loop is blocked by an asynchronous save versus a blocking one.

The state: a stack of ``nn.Linear(2048, 2048)`` layers (~50M parameters, fp32, ~200 MB), AdamW after one optimizer
step (so ``exp_avg`` and ``exp_avg_sq`` exist: ~400 MB more) and a LambdaLR schedule, prepared by an
``Accelerator(cpu=True)``. Every save goes through ``elasticd.worker.saver.CheckpointSaver`` into a fresh temporary
directory on the local disk (removed at the end), alternately blocking (``asynchronous=False``) and background
(``asynchronous=True``), ``--repeats`` saves each, on 1 process and on 2 gloo ranks under torchrun. Per save:

- ``blocking_s``: wall time of ``save()`` on rank 0, what the training loop waits for (blocking: the whole save;
  background: the host-memory snapshot and one barrier);
- ``total_s``: from ``save()`` to the commit on rank 0 (files written, every file fsynced and hashed into the
  manifest, directory renamed), from the ``checkpoint_committed`` event;
- on 1 process only, ``step_during_write_s``: median training step time while the background write runs, against
  ``step_idle_s`` without one (the write shares the CPU and the GIL with training).

Prints a table of medians and the ratio of background to blocking ``blocking_s`` (target: at most 10 %).

    python bench/checkpoint.py [--repeats 5] [--ranks 1 2] [--params 50e6] [--json OUT] [--dir TMPDIR]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
WIDTH = 2048  # features per layer: one layer is WIDTH² + WIDTH parameters (~4.2M)
TARGET_RATIO = 0.10  # background blocking time over blocking-save time
# One ranks setting: 2 x repeats saves of ~600 MB each on a shared 2-core machine, ~2 min at 2 ranks.
RUN_TIMEOUT_S = 1200
IDLE_STEPS = 5  # training steps timed without a write, for the step-time baseline


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="saves of each kind per ranks setting")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2], help="process counts to measure")
    parser.add_argument("--params", type=float, default=50e6, help="approximate model parameter count")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--dir", type=Path, help="parent of the temporary checkpoint directory")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)  # internal: result file of one run
    return parser.parse_args(argv)


def worker(args: argparse.Namespace, checkpoint_dir: Path) -> None:
    """One measured run (under torchrun when ranks > 1); rank 0 writes its samples to ``args.worker``."""
    import torch
    from accelerate import Accelerator

    from elasticd.worker.checkpoints import CheckpointStore
    from elasticd.worker.saver import COMMITTED, CheckpointSaver

    accelerator = Accelerator(cpu=True)  # a CPU-only host ignores WORLD_SIZE without cpu=True
    layers = max(1, round(args.params / (WIDTH * WIDTH + WIDTH)))
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)

    def train_step() -> float:
        start = time.perf_counter()
        accelerator.backward(model(torch.randn(4, WIDTH)).pow(2).mean())
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        return time.perf_counter() - start

    for _ in range(3):  # the optimizer state exists from the first step on; the others warm up the allocator
        train_step()
    idle = [train_step() for _ in range(IDLE_STEPS)] if accelerator.num_processes == 1 else []
    events: list[tuple[str, dict[str, Any]]] = []
    committed = threading.Event()

    def on_event(name: str, fields: dict[str, Any]) -> None:
        events.append((name, fields))
        committed.set()

    saver = CheckpointSaver(accelerator, CheckpointStore(checkpoint_dir, "bench", keep=2), on_event=on_event)
    samples: dict[str, Any] = {"blocking": [], "background": [], "step_during_write_s": [], "step_idle_s": idle}
    for step in range(1, 2 * args.repeats + 1):
        kind = "blocking" if step <= args.repeats else "background"
        accelerator.wait_for_everyone()
        committed.clear()
        start = time.perf_counter()
        saver.save(step, {"world_size": accelerator.num_processes}, asynchronous=kind == "background")
        blocking_s = time.perf_counter() - start
        while accelerator.num_processes == 1 and not committed.is_set():  # training goes on during the write
            samples["step_during_write_s"].append(train_step())
        saver.wait()
        accelerator.wait_for_everyone()  # rank 0's wait() includes the commit
        if accelerator.is_main_process:
            name, fields = events[-1]
            if name != COMMITTED:
                raise RuntimeError(f"save {step} ended in {name}: {fields}")
            samples[kind].append({"blocking_s": blocking_s, "total_s": fields["total_s"]})
    saver.close()
    if accelerator.is_main_process:
        size = sum(p.stat().st_size for p in (checkpoint_dir / "bench").rglob("*") if p.is_file()) // 2
        samples.update(ranks=accelerator.num_processes, parameters=sum(p.numel() for p in model.parameters()))
        args.worker.write_text(json.dumps({**samples, "checkpoint_bytes": size}))


def run(args: argparse.Namespace, ranks: int, workdir: Path) -> dict[str, Any]:
    """Measure at ``ranks`` processes in a child process tree; killed as a whole if it outlives RUN_TIMEOUT_S."""
    result = workdir / f"result-{ranks}.json"
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"] if ranks > 1 else []
    command = [sys.executable, *launcher, str(Path(__file__).resolve()), "--worker", str(result)]
    command += ["--dir", str(workdir / f"ranks-{ranks}"), "--params", str(args.params), "--repeats", str(args.repeats)]
    # One intra-op thread per rank: ranks must not fight over the cores of a small machine.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    child = subprocess.Popen(command, env=env, start_new_session=True)
    try:
        if child.wait(timeout=RUN_TIMEOUT_S) != 0:
            raise RuntimeError(f"the {ranks}-rank run exited with {child.returncode}")
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)  # the session is the launcher and its workers
            child.wait()
    return dict(json.loads(result.read_text()))


def summarize(sample: dict[str, Any]) -> dict[str, Any]:
    def median(kind: str, figure: str) -> float:
        return statistics.median(s[figure] for s in sample[kind])

    row = {"ranks": sample["ranks"], "parameters": sample["parameters"], "checkpoint_bytes": sample["checkpoint_bytes"]}
    for kind in ("blocking", "background"):
        row[f"{kind}_blocking_s"], row[f"{kind}_total_s"] = median(kind, "blocking_s"), median(kind, "total_s")
    row["ratio"] = row["background_blocking_s"] / row["blocking_blocking_s"]
    for figure in ("step_idle_s", "step_during_write_s"):
        row[figure] = statistics.median(sample[figure]) if sample[figure] else None
    return row


def render(rows: Sequence[dict[str, Any]]) -> str:
    def fmt(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    head = f"{'ranks':>5}  {'save':<10}  {'blocking_s':>10}  {'total_s':>8}  {'step_s':>7}"
    out = [head, "-" * len(head)]
    for row in rows:
        out.append(f"{row['ranks']:>5}  {'blocking':<10}  {fmt(row['blocking_blocking_s']):>10}  "
                   f"{fmt(row['blocking_total_s']):>8}  {fmt(row['step_idle_s']):>7}")  # fmt: skip
        out.append(f"{row['ranks']:>5}  {'background':<10}  {fmt(row['background_blocking_s']):>10}  "
                   f"{fmt(row['background_total_s']):>8}  {fmt(row['step_during_write_s']):>7}")  # fmt: skip
    for row in rows:
        verdict = "meets" if row["ratio"] <= TARGET_RATIO else "misses"
        out.append(f"ranks={row['ranks']}: background/blocking blocking time {100 * row['ratio']:.1f} % "
                   f"({verdict} the {100 * TARGET_RATIO:.0f} % target)")  # fmt: skip
    first = rows[0]
    out.append(f"{first['parameters'] / 1e6:.1f}M parameters, {first['checkpoint_bytes'] / 1e6:.0f} MB per checkpoint; "
               "step_s: median training step, idle (blocking rows) or during the background write")  # fmt: skip
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        worker(args, args.dir)
        return 0
    workdir = Path(tempfile.mkdtemp(prefix="elasticd-bench-checkpoint-", dir=args.dir))
    try:
        rows = [summarize(run(args, ranks, workdir)) for ranks in args.ranks]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(render(rows))
    if args.json is not None:
        machine = {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform()}
        args.json.write_text(json.dumps({"machine": machine, "repeats": args.repeats, "results": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
