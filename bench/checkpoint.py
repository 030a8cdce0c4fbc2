"""Checkpoint save benchmark: how long a training loop is blocked by an asynchronous save versus a blocking one.

The state: a stack of ``nn.Linear(2048, 2048)`` layers (~50M parameters, fp32, ~200 MB), AdamW after one optimizer
step (so ``exp_avg`` and ``exp_avg_sq`` exist: ~400 MB more) and a LambdaLR schedule, prepared by an
``Accelerator(cpu=True)``. Every save goes through ``elasticd.worker.saver.CheckpointSaver`` into a fresh temporary
directory on the local disk (removed at the end), alternately blocking (``asynchronous=False``) and background
(``asynchronous=True``), ``--repeats`` saves each, on 1 process and on 2 gloo ranks under torchrun. Per save:

- ``blocking_s``: wall time of ``save()`` on rank 0, what the training loop waits for (blocking: the whole save;
  background: the host-memory snapshot and one barrier; either: the wait for the previous background write when it
  is still going, since nothing waits for a write between saves);
- ``total_s``: from ``save()`` to the commit on rank 0 (files written, every file fsynced and hashed into the
  manifest, directory renamed), from the ``checkpoint_committed`` event;
- ``step_s``: median time of the ``--steps`` training steps that follow each save (after a background save they
  overlap its write, which shares the CPU and the GIL with training; after a blocking save nothing is written).

Prints a table of medians and the ratio of background to blocking ``blocking_s`` (target: at most 10 %). The runs
use a copy of ``elasticd/``, ``examples/`` and ``bench/`` taken when the benchmark starts (others edit the tree
meanwhile). Before each ranks setting the benchmark waits (up to ``QUIET_TIMEOUT_S``) until other processes use
under a quarter core, and records what they used then and during the run. The raw results (commit, machine,
versions, every save's figures, the others' load) go to ``bench/results/checkpoint[-text-classifier-<size>]-<short
commit>[-dirty].json`` unless ``--json`` says otherwise. Roughly 2 minutes per ranks setting at the defaults on a
2-core machine (~4 in all), about as long with ``--model text-classifier --model-size base``, well under a minute
with ``tiny``.

    python bench/checkpoint.py [--repeats 5] [--ranks 1 2] [--params 50e6] [--steps 4] [--json OUT] [--dir TMPDIR]
    python bench/checkpoint.py --model text-classifier   # examples/text_classification.py's transformers model

``--model text-classifier`` saves the example's BERT-style classifier instead (built from its config, AdamW after
one step on random token ids; the model goes into ``model.safetensors`` as for any transformers model), at
``--model-size tiny`` (the example's default) or ``base`` (BERT-base's geometry); ``--params`` then does not apply.
"""

from __future__ import annotations

import argparse
import json
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

if __package__ in (None, ""):  # run as `python bench/checkpoint.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (
    code_revision,
    foreign_cores,
    foreign_cpu,
    report_header,
    results_path,
    snapshot_code,
    wait_for_quiet,
    write_results,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
WIDTH = 2048  # features per layer: one layer is WIDTH² + WIDTH parameters (~4.2M)
TARGET_RATIO = 0.10  # background blocking time over blocking-save time
# One ranks setting: 2 x repeats saves of ~600 MB each on a shared 2-core machine, ~2 min at 2 ranks.
RUN_TIMEOUT_S = 1200
# Before each ranks setting wait at most this long (s) for other processes to use under a quarter core.
QUIET_TIMEOUT_S = 120.0


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="saves of each kind per ranks setting")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2], help="process counts to measure")
    parser.add_argument("--params", type=float, default=50e6, help="approximate model parameter count")
    parser.add_argument("--model", choices=["linear-stack", "text-classifier"], default="linear-stack")
    parser.add_argument("--model-size", choices=["tiny", "base"], default="tiny", help="text-classifier: its size")
    parser.add_argument("--steps", type=int, default=4, help="training steps timed after each save")
    parser.add_argument(
        "--sharded", action="store_true", help="shard the model with accelerate's FSDP2 (DCP checkpoints, per rank)"
    )
    parser.add_argument(
        "--json", type=Path, help="where to write the results (default: bench/results/checkpoint[-MODEL]-<commit>.json)"
    )
    parser.add_argument("--dir", type=Path, help="parent of the temporary checkpoint directory")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)  # internal: result file of one run
    return parser.parse_args(argv)


def worker(args: argparse.Namespace, checkpoint_dir: Path) -> None:
    """One measured run (under torchrun when ranks > 1); rank 0 writes its samples to ``args.worker``."""
    import torch
    from accelerate import Accelerator

    from elasticd.worker.checkpoints import CheckpointStore, own_files
    from elasticd.worker.saver import COMMITTED, CheckpointSaver

    accelerator = Accelerator(cpu=True)  # a CPU-only host ignores WORLD_SIZE without cpu=True
    if args.sharded:
        from elasticd.worker.fsdp import take_fsdp_path

        assert take_fsdp_path(accelerator), "accelerate did not take its FSDP2 path"
    model, batch = _model(args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)

    def train_step() -> float:
        start = time.perf_counter()
        accelerator.backward(batch(model).pow(2).mean())
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        return time.perf_counter() - start

    for _ in range(3):  # the optimizer state exists from the first step on; the others warm up the allocator
        train_step()
    events: list[tuple[str, dict[str, Any]]] = []
    store = CheckpointStore(checkpoint_dir, "bench", keep=2)
    saver = CheckpointSaver(accelerator, store, on_event=lambda name, fields: events.append((name, fields)))
    samples: dict[str, Any] = {"blocking": [], "background": []}
    timed: list[tuple[int, str, float, list[float]]] = []
    for step in range(1, 2 * args.repeats + 1):
        kind = "blocking" if step % 2 else "background"  # alternately: both see the same machine state
        accelerator.wait_for_everyone()
        start = time.perf_counter()
        # save() first waits for this rank's previous background write, if it is still going: that wait blocks the
        # loop too, and is counted here (the benchmark never waits for a write between saves)
        saver.save(step, {"world_size": accelerator.num_processes}, asynchronous=kind == "background")
        blocking_s = time.perf_counter() - start
        timed.append((step, kind, blocking_s, [train_step() for _ in range(args.steps)]))
    saver.wait(everyone=True)
    if accelerator.is_main_process:
        outcome = {int(fields["step"]): (name, fields) for name, fields in events if "step" in fields}
        for step, kind, blocking_s, step_s in timed:
            name, fields = outcome.get(step, ("missing", {}))
            if name != COMMITTED:
                raise RuntimeError(f"save {step} ended in {name}: {fields}")
            samples[kind].append({"blocking_s": blocking_s, "total_s": fields["total_s"], "step_s": step_s})
    saver.close()
    if accelerator.is_main_process:
        size = sum(p.stat().st_size for p in (checkpoint_dir / "bench").rglob("*") if p.is_file()) // 2
        newest = max((checkpoint_dir / "bench").glob("step-*"))
        # what each rank wrote itself (its shards and RNG; rank 0 also what no rank claims: metadata, scheduler)
        own = [sum(p.stat().st_size for p in own_files(newest, r)) for r in range(accelerator.num_processes)]
        own[0] += sum(p.stat().st_size for p in newest.rglob("*") if p.is_file()) - sum(own)
        parameters = sum(p.numel() for p in model.parameters())  # a DTensor counts its global shape
        samples.update(ranks=accelerator.num_processes, bytes_per_rank=own)
        args.worker.write_text(json.dumps({**samples, "checkpoint_bytes": size, "parameters": parameters}))


def _model(args: argparse.Namespace) -> tuple[Any, Any]:
    """The model to checkpoint, and a function that runs it forward on a random batch."""
    import torch

    if args.model == "text-classifier":
        import importlib.util

        spec = importlib.util.spec_from_file_location(
            "text_classification", REPO_ROOT / "examples" / "text_classification.py"
        )
        assert spec is not None and spec.loader is not None
        example = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(example)
        vocab = len(example.build_tokenizer())
        ids = torch.randint(vocab, (4, example.MAX_LENGTH))
        return example.build_model(vocab, 0, args.model_size), lambda model: model(input_ids=ids).logits
    layers = max(1, round(args.params / (WIDTH * WIDTH + WIDTH)))
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)])
    return model, lambda model: model(torch.randn(4, WIDTH))


def run(args: argparse.Namespace, ranks: int, workdir: Path, script: Path) -> dict[str, Any]:
    """Measure at ``ranks`` processes in a child process tree running ``script`` (the frozen copy of this file);
    killed as a whole if it outlives RUN_TIMEOUT_S. Records the cores other processes used before and during it."""
    result = workdir / f"result-{ranks}.json"
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"] if ranks > 1 else []
    command = [sys.executable, *launcher, str(script), "--worker", str(result)]
    command += ["--dir", str(workdir / f"ranks-{ranks}"), "--params", str(args.params), "--repeats", str(args.repeats)]
    command += ["--steps", str(args.steps), "--model", args.model, "--model-size", args.model_size]
    command += ["--sharded"] if args.sharded else []
    # One intra-op thread per rank: ranks must not fight over the cores of a small machine.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(script.parent.parent)}
    if args.sharded:  # what an accelerate config with FSDP2 gives a worker: each Linear its own shard unit
        env.update(ACCELERATE_USE_FSDP="true", FSDP_VERSION="2", FSDP_STATE_DICT_TYPE="SHARDED_STATE_DICT")
        env.update(FSDP_AUTO_WRAP_POLICY="SIZE_BASED_WRAP", FSDP_MIN_NUM_PARAMS="1000000", ACCELERATE_USE_CPU="true")
    cores_before = wait_for_quiet(QUIET_TIMEOUT_S)
    others, started = foreign_cpu(), time.monotonic()
    child = subprocess.Popen(command, env=env, start_new_session=True)
    try:
        if child.wait(timeout=RUN_TIMEOUT_S) != 0:
            raise RuntimeError(f"the {ranks}-rank run exited with {child.returncode}")
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)  # the session is the launcher and its workers
            child.wait()
    cores_during = foreign_cores(others, foreign_cpu(), time.monotonic() - started)
    sample = dict(json.loads(result.read_text()))
    sample.update(foreign_cores_before=round(cores_before, 2), foreign_cores_during=round(cores_during, 2))
    return sample


def summarize(sample: dict[str, Any]) -> dict[str, Any]:
    """Medians per kind of save, their ratio, and the samples themselves."""
    keep = ("ranks", "parameters", "checkpoint_bytes", "bytes_per_rank", "foreign_cores_before", "foreign_cores_during")
    row: dict[str, Any] = {key: sample.get(key) for key in keep}
    for kind in ("blocking", "background"):
        for figure in ("blocking_s", "total_s"):
            row[f"{kind}_{figure}"] = statistics.median(s[figure] for s in sample[kind])
        row[f"{kind}_step_s"] = statistics.median(t for s in sample[kind] for t in s["step_s"])
        row[f"{kind}_samples"] = sample[kind]
    row["ratio"] = row["background_blocking_s"] / row["blocking_blocking_s"]
    return row


def render(rows: Sequence[dict[str, Any]]) -> str:
    def fmt(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    head = f"{'ranks':>5}  {'save':<10}  {'blocking_s':>10}  {'total_s':>8}  {'step_s':>7}"
    out = [head, "-" * len(head)]
    for row in rows:
        out.append(f"{row['ranks']:>5}  {'blocking':<10}  {fmt(row['blocking_blocking_s']):>10}  "
                   f"{fmt(row['blocking_total_s']):>8}  {fmt(row['blocking_step_s']):>7}")  # fmt: skip
        out.append(f"{row['ranks']:>5}  {'background':<10}  {fmt(row['background_blocking_s']):>10}  "
                   f"{fmt(row['background_total_s']):>8}  {fmt(row['background_step_s']):>7}")  # fmt: skip
    for row in rows:
        verdict = "meets" if row["ratio"] <= TARGET_RATIO else "misses"
        out.append(f"ranks={row['ranks']}: background/blocking blocking time {100 * row['ratio']:.1f} % "
                   f"({verdict} the {100 * TARGET_RATIO:.0f} % target)")  # fmt: skip
    first = rows[0]
    out.append(f"{first['parameters'] / 1e6:.1f}M parameters, {first['checkpoint_bytes'] / 1e6:.0f} MB per checkpoint; "
               "step_s: median training step after a save (background: during its write)")  # fmt: skip
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        worker(args, args.dir)
        return 0
    revision = code_revision()
    started = time.time()
    workdir = Path(tempfile.mkdtemp(prefix="elasticd-bench-checkpoint-", dir=args.dir))
    try:
        script = snapshot_code(workdir / "code", bench=True) / "bench" / Path(__file__).name
        rows = [summarize(run(args, ranks, workdir, script)) for ranks in args.ranks]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(render(rows))
    name = "checkpoint" if args.model == "linear-stack" else f"checkpoint-{args.model}-{args.model_size}"
    name += "-sharded" if args.sharded else ""
    config = {"model": args.model, "model_size": args.model_size, "params": args.params, "repeats": args.repeats}
    config.update(sharded=args.sharded)
    config.update(steps=args.steps, ranks=args.ranks, target_ratio=TARGET_RATIO, quiet_timeout_s=QUIET_TIMEOUT_S)
    report = {
        **report_header("checkpoint.py", argv, revision),
        "config": config,
        "duration_s": round(time.time() - started, 1),
        "results": rows,
    }
    write_results(args.json or results_path(name, revision), report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
