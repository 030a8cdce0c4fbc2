"""Per-step overhead benchmark: what elasticd's worker library adds to one optimizer step of about 20 ms.

Two loops run side by side in one process, on one ``Accelerator(cpu=True)``, each with its own model, AdamW and
LambdaLR (prepared by the accelerator) over the same map-style synthetic dataset, and the same step body::

    with accelerator.accumulate(model):
        loss = mse(model(batch["x"]), batch["y"]); accelerator.backward(loss)
        optimizer.step(); scheduler.step(); optimizer.zero_grad()

- ``baseline``: plain accelerate, batches from a standard ``DataLoader`` prepared by the accelerator;
- ``elasticd``: the same body with batches from ``run.batches(run.dataloader(...))`` and ``run.step(loss)`` after it
  (so the NaN guard wrapped around ``optimizer.step``, the beat, the batch plan and the coordinator are all in). A
  ``BeatReceiver`` in the benchmark process stands in for the daemon (``ELASTICD_SOCKET``), so beats really leave
  the worker, and a board directory (``ELASTICD_BOARD``) makes the worker write its hang-watchdog slot every step
  and answer stack and flight-recorder requests (forward-pass timing hooks included); checkpoints are off
  (``WorkerSettings(every_steps=0)``) in a temporary directory.

A sample is a sequence of 16 tokens of 16 features; the MLP applies to every token, a micro-batch is 32
sequences. Compute per step (``--compute``): ``sleep`` adds ``time.sleep(0.02)`` to a tiny MLP (the most stable
stand-in for 20 ms of work on a small noisy machine); ``matmul`` has no sleep but an MLP ``--hidden`` wide (0.47M
parameters by default) whose forward, backward and AdamW take about 20 ms on one core (wider and memory-bound, the
step time of this VM swings by +-15 %; this size stays compute-bound). Each mode runs as 1 process and as 2 gloo
ranks under ``torchrun --standalone`` (``OMP_NUM_THREADS=1`` everywhere), so the DDP gradient all-reduce is in both
loops and the coordinator's periodic all-reduce in elasticd's.

After ``--warmup`` steps of each loop, blocks of ``--steps`` steps alternate ``--blocks`` times per loop in ABBA
order (baseline first, then elasticd first, ...), so that drift of the machine hits both alike. A step's time is
the wall time between the ends of two consecutive steps on rank 0 (data loading included). Reported per loop: the
median step, the median of block means (which, unlike the median step, includes costs paid once every few steps,
such as the coordinator's all-reduce), and overhead = median elasticd / median baseline - 1 (target: at most 1 %),
in percent and in microseconds per step; ``pairs`` gives the overhead of each adjacent pair of blocks, whose spread
is the noise of the machine.

Workers run a copy of ``elasticd/`` and ``bench/`` taken when the benchmark starts (others edit the tree meanwhile);
the JSON records the commit. Before each run the benchmark waits for other processes to go quiet, and measures what
everything else used during it (``others``, in cores); a run above a quarter core is measured once more.
``--breakdown`` also times the parts of elasticd's step in place (timers wrapped around library functions, which
cost some microseconds each: take the overhead itself from a run without it).

    python bench/step_overhead.py [--compute sleep matmul] [--ranks 1 2] [--blocks 5] [--steps 200] [--breakdown]
                                  [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from importlib.metadata import version
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/step_overhead.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import code_revision, snapshot_code, wait_for_quiet
from elasticd import envvars
from elasticd.agent.beats import BeatReceiver

REPO_ROOT = Path(__file__).resolve().parent.parent
TARGET_OVERHEAD = 0.01  # elasticd's median step over the baseline's, minus 1
SLEEP_S = 0.02  # stand-in compute per optimizer step in --compute sleep
FEATURES, SEQUENCE = 16, 16  # a sample: SEQUENCE tokens of FEATURES inputs each
MICRO_BATCH = 32  # sequences per micro-batch, per rank (512 tokens)
DISTINCT = 4096  # sequences actually stored: sample i is sequence i % DISTINCT (a few MB whatever the step count)
HIDDEN = {"sleep": 64, "matmul": 480}  # MLP width for each compute mode (--hidden overrides matmul's)
# One (compute, ranks) run: 2 x (warmup + blocks x steps) steps of 20-35 ms plus ~10 s of startup, ~1.5 min.
RUN_TIMEOUT_S = 600
LOOPS = ("baseline", "elasticd")
# Before each run, wait at most this long (s) for other processes to use under a quarter core. A run during which
# anything else (other processes, the host's steal) used more than CONTENDED_CORES cores on average is run once
# more, and flagged if that one is contended too: its overhead would be mostly their noise.
QUIET_TIMEOUT_S = 120.0
CONTENDED_CORES = 0.25


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compute", nargs="+", choices=["sleep", "matmul"], default=["sleep", "matmul"])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2], help="process counts to measure")
    parser.add_argument("--blocks", type=int, default=5, help="measured blocks per loop")
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps per block")
    parser.add_argument("--warmup", type=int, default=50, help="unmeasured steps of each loop first")
    parser.add_argument("--hidden", type=int, default=HIDDEN["matmul"], help="MLP width in --compute matmul")
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="also time the pieces of a step (their timers inflate the overhead: read it from a run without)",
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)  # internal: result file of one run
    parser.add_argument("--mode", choices=["sleep", "matmul"], help=argparse.SUPPRESS)  # internal: the child's
    parser.add_argument("--dir", type=Path, help=argparse.SUPPRESS)  # internal: the child's checkpoint dir
    return parser.parse_args(argv)


# -- the worker: one (compute, ranks) run, under torchrun when ranks > 1 ---------------------------------------------


def instrument(pieces: dict[str, list[float]]) -> None:
    """Wrap the parts of elasticd's step in timers that append their wall times (s) to ``pieces``, by name."""
    from elasticd.worker import guard
    from elasticd.worker.beats import BeatClient
    from elasticd.worker.coordination import Coordinator
    from elasticd.worker.run import Run
    from elasticd.worker.sampler import ElasticSampler
    from elasticd.worker.state import TrainingState

    def wrap(owner: Any, attribute: str, name: str) -> None:
        original = getattr(owner, attribute)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                pieces.setdefault(name, []).append(time.perf_counter() - start)

        setattr(owner, attribute, timed)

    # guarded_step looks grads_nonfinite up in its module at every call
    wrap(guard, "grads_nonfinite", "guard: grads_nonfinite (in optimizer.step)")
    wrap(Run, "step", "run.step, all of it")
    wrap(BeatClient, "send", "run.step: beat send")
    wrap(TrainingState, "advanced", "run.step: state.advanced")
    wrap(Run, "_loss_value", "run.step: loss.item()")
    wrap(Coordinator, "at_step", "run.step: coordinator.at_step")
    wrap(Coordinator, "_agree", "coordinator all-reduce (at sync steps)")
    wrap(ElasticSampler, "_step", "batches: sampler step slice")


def worker(args: argparse.Namespace) -> None:
    """Both loops in one process; rank 0 writes its step times (s) to ``args.worker``."""
    import torch
    from accelerate import Accelerator
    from torch.utils.data import DataLoader, Dataset

    import elasticd
    from elasticd.worker.settings import WorkerSettings

    class Synthetic(Dataset[dict[str, torch.Tensor]]):
        """``size`` sequences of y = x . w + noise, DISTINCT of them drawn up front: __getitem__ is two indexings."""

        def __init__(self, size: int) -> None:
            g = torch.Generator().manual_seed(0)
            self.size = size
            self.x = torch.randn(DISTINCT, SEQUENCE, FEATURES, generator=g)
            noise = 0.01 * torch.randn(DISTINCT, SEQUENCE, 1, generator=g)
            self.y = self.x @ torch.linspace(-1.0, 1.0, FEATURES).unsqueeze(1) + noise

        def __len__(self) -> int:
            return self.size

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"x": self.x[i % DISTINCT], "y": self.y[i % DISTINCT]}

    def make_model() -> torch.nn.Module:
        torch.manual_seed(0)  # both loops start from the same weights
        width = args.hidden if args.mode == "matmul" else HIDDEN["sleep"]
        layers: list[torch.nn.Module] = [torch.nn.Linear(FEATURES, width), torch.nn.Tanh()]
        layers += [torch.nn.Linear(width, width), torch.nn.Tanh(), torch.nn.Linear(width, width), torch.nn.Tanh()]
        return torch.nn.Sequential(*layers, torch.nn.Linear(width, 1))

    def make_training() -> tuple[Any, Any, Any]:
        model = make_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1.0 + 0.001 * step))
        return model, optimizer, scheduler

    sleep_s = SLEEP_S if args.mode == "sleep" else 0.0
    pieces: dict[str, list[float]] = {}
    if args.breakdown:
        instrument(pieces)
    accelerator = Accelerator(cpu=True)  # a CPU-only host ignores WORLD_SIZE without cpu=True
    world, micro = accelerator.num_processes, MICRO_BATCH
    settings = WorkerSettings(
        run_id="bench",
        checkpoint_dir=args.dir,
        every_steps=0,  # no checkpoint during the measurement
        socket=os.environ[envvars.SOCKET],
        board=os.environ[envvars.BOARD],  # the hang watchdog's progress slot is written every step, as under a daemon
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        nproc_per_node=world,
    )
    run = elasticd.attach(accelerator, settings)
    # One epoch covers every step of a loop: no epoch boundary inside a block.
    dataset = Synthetic(micro * world * (args.warmup + args.blocks * args.steps + 1))

    model_b, optimizer_b, scheduler_b = make_training()
    loader_b = DataLoader(dataset, batch_size=micro, shuffle=True, drop_last=True)
    model_b, optimizer_b, scheduler_b, loader_b = accelerator.prepare(model_b, optimizer_b, scheduler_b, loader_b)

    loader_e = run.dataloader(dataset, global_batch_size=micro * world, micro_batch_size=micro, seed=0)
    model_e, optimizer_e, scheduler_e = accelerator.prepare(*make_training())
    run.resume(model_e, optimizer_e, scheduler_e)

    def train_step(model: Any, optimizer: Any, scheduler: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        with accelerator.accumulate(model):
            start = time.perf_counter()
            loss = ((model(batch["x"]) - batch["y"]) ** 2).mean()
            accelerator.backward(loss)  # with 2 ranks: DDP's all-reduce, which waits for the slower rank
            backward = time.perf_counter()
            optimizer.step()
            stepped = time.perf_counter()
            scheduler.step()
            optimizer.zero_grad()
        if sleep_s:
            time.sleep(sleep_s)
        if args.breakdown:
            name = "baseline" if model is model_b else "elasticd"
            pieces.setdefault(f"{name}: forward + backward", []).append(backward - start)
            pieces.setdefault(f"{name}: optimizer.step", []).append(stepped - backward)
        return loss

    def baseline_step(batch: dict[str, torch.Tensor]) -> None:
        train_step(model_b, optimizer_b, scheduler_b, batch)

    def elasticd_step(batch: dict[str, torch.Tensor]) -> None:
        run.step(train_step(model_e, optimizer_e, scheduler_e, batch))

    def forever(loader: Any) -> Iterator[Any]:
        while True:
            yield from loader

    loops: dict[str, tuple[Iterator[Any], Callable[[Any], None]]] = {
        "baseline": (forever(loader_b), baseline_step),
        "elasticd": (run.batches(loader_e, epochs=1_000), elasticd_step),
    }

    def block(name: str, steps: int) -> list[float]:
        """Step times (s) of ``steps`` steps of loop ``name``, every rank starting together."""
        batches, one_step = loops[name]
        accelerator.wait_for_everyone()
        if name == "elasticd":
            # The pause while the other loop ran is no step of this one: without this, run.step would report a
            # step of several seconds, and the coordinator would sync every step until its average forgot it.
            assert hasattr(run, "_step_started"), "elasticd.worker.run.Run changed: update this benchmark"
            run._step_started = time.perf_counter()
        times_s: list[float] = []
        last = time.perf_counter()
        for _ in range(steps):
            batch = next(batches)
            fetched = time.perf_counter()
            one_step(batch)
            now = time.perf_counter()
            times_s.append(now - last)
            if args.breakdown:
                pieces.setdefault(f"{name}: next(batches)", []).append(fetched - last)
            last = now
        return times_s

    for name in LOOPS:
        block(name, args.warmup)
    pieces.clear()
    samples: dict[str, list[list[float]]] = {name: [] for name in LOOPS}
    for index in range(args.blocks):
        for name in LOOPS if index % 2 == 0 else LOOPS[::-1]:
            samples[name].append(block(name, args.steps))
    run.close()
    if accelerator.is_main_process:
        result = {
            "compute": args.mode,
            "ranks": world,
            "micro_batch": micro,
            "hidden": args.hidden if args.mode == "matmul" else HIDDEN["sleep"],
            "parameters": sum(p.numel() for p in model_b.parameters()),
            "sleep_s": sleep_s,
            "sync_interval_steps": run.coordinator.interval,
            "elasticd_steps": run.state.step,
            "samples": samples,
            # per piece: (median, mean) in s, and the number of calls
            "pieces": {k: (statistics.median(v), statistics.fmean(v), len(v)) for k, v in sorted(pieces.items())},
        }
        args.worker.write_text(json.dumps(result))
    accelerator.end_training()


# -- the driver: one child process tree per (compute, ranks), a beat receiver standing in for the daemon ----------


def cpu_seconds() -> tuple[float, float]:
    """(CPU s used by the whole machine, all cores, steal included; CPU s used by this process and its reaped
    descendants): between two calls after the run's processes are reaped, the difference is everyone else's."""
    import psutil

    t = psutil.cpu_times()
    me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    ours = me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime
    return t.user + t.nice + t.system + t.irq + t.softirq + t.steal, ours


def freeze_code(dest: Path) -> Path:
    """Copy ``elasticd/``, ``examples/`` and ``bench/`` to ``dest``: others edit the tree during the minutes a run
    takes, and every worker must run the code as it was when the benchmark began. Returns the worker script."""
    snapshot_code(dest)
    shutil.copytree(REPO_ROOT / "bench", dest / "bench", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return dest / "bench" / Path(__file__).name


def run_one(args: argparse.Namespace, mode: str, ranks: int, workdir: Path, script: Path) -> dict[str, Any]:
    """:func:`run_once`, once more if others used the machine meanwhile (see CONTENDED_CORES)."""
    sample = run_once(args, mode, ranks, workdir, script)
    if max(sample["foreign_cores_before"], sample["foreign_cores_during"]) <= CONTENDED_CORES:
        return sample
    print(f"{mode} at {ranks} ranks: others used {sample['foreign_cores_during']:.2f} cores, measuring again")
    return run_once(args, mode, ranks, workdir, script)


def run_once(args: argparse.Namespace, mode: str, ranks: int, workdir: Path, script: Path) -> dict[str, Any]:
    """Measure ``mode`` at ``ranks`` processes in a child process tree running ``script`` (a frozen copy of this
    file, see :func:`freeze_code`); the tree is killed as a whole past RUN_TIMEOUT_S."""
    result = workdir / f"result-{mode}-{ranks}.json"
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"] if ranks > 1 else []
    command = [sys.executable, *launcher, str(script), "--worker", str(result), "--mode", mode]
    command += ["--dir", str(workdir / f"checkpoints-{mode}-{ranks}"), "--hidden", str(args.hidden)]
    command += ["--blocks", str(args.blocks), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    command += ["--breakdown"] if args.breakdown else []
    receiver = BeatReceiver(str(workdir / f"beats-{mode}-{ranks}.sock"))
    board = workdir / f"board-{mode}-{ranks}"
    board.mkdir(exist_ok=True)
    # One intra-op thread per process: ranks must not fight over the cores of a small machine.
    code = str(script.parent.parent)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": code,
        envvars.SOCKET: receiver.path,
        envvars.BOARD: str(board),
    }
    cores_before = wait_for_quiet(QUIET_TIMEOUT_S)
    machine_before, ours_before = cpu_seconds()
    started = time.monotonic()
    child = subprocess.Popen(command, env=env, start_new_session=True)
    try:
        if child.wait(timeout=RUN_TIMEOUT_S) != 0:
            raise RuntimeError(f"the {mode} run at {ranks} ranks exited with {child.returncode}")
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)  # the session is the launcher and its workers
            child.wait()
        time.sleep(0.3)  # the receiver reads on a 200 ms timeout: let it drain the last beats
        receiver.close()
    wall_s = time.monotonic() - started
    machine_after, ours_after = cpu_seconds()
    cores_during = max(0.0, (machine_after - machine_before) - (ours_after - ours_before)) / wall_s
    sample = dict(json.loads(result.read_text()))
    beats = receiver.snapshot().beats
    # every rank sends hello and resumed, then step beats (how often is the library's choice: at least one)
    if beats < 3 * ranks:
        raise RuntimeError(f"the beat receiver got {beats} beats from {ranks} ranks: beats were not really sent")
    sample.update(beats_received=beats, wall_s=wall_s, foreign_cores_before=cores_before)
    sample.update(foreign_cores_during=cores_during)
    return sample


def summarize(sample: dict[str, Any]) -> dict[str, Any]:
    """Medians per loop, overheads, and the per-block samples."""
    keep = ["compute", "ranks", "micro_batch", "hidden", "parameters", "sleep_s", "sync_interval_steps"]
    keep += ["beats_received", "wall_s", "foreign_cores_before", "foreign_cores_during"]
    row: dict[str, Any] = {key: sample[key] for key in keep}
    for name in LOOPS:
        blocks = sample["samples"][name]
        row[f"{name}_median_s"] = statistics.median(t for b in blocks for t in b)
        row[f"{name}_block_mean_s"] = statistics.median(statistics.fmean(b) for b in blocks)
        row[f"{name}_block_medians_s"] = [statistics.median(b) for b in blocks]
    base, elastic = row["baseline_median_s"], row["elasticd_median_s"]
    row["overhead"] = elastic / base - 1
    row["overhead_us"] = (elastic - base) * 1e6
    row["mean_overhead"] = row["elasticd_block_mean_s"] / row["baseline_block_mean_s"] - 1
    # Block i of one loop against block i of the other (adjacent in time): the spread says how noisy the machine was.
    pairs = zip(row["elasticd_block_medians_s"], row["baseline_block_medians_s"], strict=True)
    row["pair_overheads"] = [e / b - 1 for e, b in pairs]
    row["pieces"] = sample["pieces"]
    row["samples"] = sample["samples"]
    return row


def render(rows: Sequence[dict[str, Any]]) -> str:
    def ms(seconds: float) -> str:
        return f"{seconds * 1e3:.3f}"

    head = (
        f"{'compute':<7}  {'ranks':>5}  {'base_ms':>8}  {'elastic_ms':>10}  {'overhead':>8}  {'us/step':>7}  "
        f"{'pairs_%':>13}  {'mean_base':>9}  {'mean_elastic':>12}  {'mean_over':>9}  {'others':>6}"
    )
    out = [head, "-" * len(head)]
    for row in rows:
        pairs = [100 * p for p in row["pair_overheads"]]
        out.append(
            f"{row['compute']:<7}  {row['ranks']:>5}  {ms(row['baseline_median_s']):>8}  "
            f"{ms(row['elasticd_median_s']):>10}  {100 * row['overhead']:>7.2f}%  {row['overhead_us']:>7.0f}  "
            f"{f'{min(pairs):.2f}..{max(pairs):.2f}':>13}  {ms(row['baseline_block_mean_s']):>9}  "
            f"{ms(row['elasticd_block_mean_s']):>12}  {100 * row['mean_overhead']:>8.2f}%  "
            f"{row['foreign_cores_during']:>6.2f}"
        )
    for row in rows:
        verdict = "meets" if row["overhead"] <= TARGET_OVERHEAD else "misses"
        contended = max(row["foreign_cores_before"], row["foreign_cores_during"]) > CONTENDED_CORES
        model = f"{row['parameters'] / 1e6:.2f}M parameters (width {row['hidden']})"
        batch = f"micro-batch {row['micro_batch']}x{SEQUENCE}"
        sync = f"sync every {row['sync_interval_steps']} steps, {row['beats_received']} beats received"
        result = f"overhead {100 * row['overhead']:.2f} % ({verdict} the {100 * TARGET_OVERHEAD:.0f} % target)"
        warning = "; CONTENDED: other processes were busy, rerun on a quiet machine" if contended else ""
        out.append(f"{row['compute']}, {row['ranks']} rank(s): {model}, {batch}, {sync}; {result}{warning}")
    out.append(
        "base_ms/elastic_ms: median step (ms); pairs_%: overhead of each block pair's medians; mean_*: median of "
        "block means (ms), which include once-every-few-steps costs; others: cores other processes used meanwhile"
    )
    for row in rows:
        if row["pieces"]:
            out.append(f"\nbreakdown, {row['compute']}, {row['ranks']} rank(s), rank 0 (us per call; timers included):")
            for name, (median_s, mean_s, calls) in row["pieces"].items():
                out.append(f"  {name:<44} median {median_s * 1e6:8.1f}  mean {mean_s * 1e6:8.1f}  calls {calls:>5}")
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        worker(args)
        return 0
    # Under /tmp: a Unix socket path must stay under 108 bytes.
    workdir = Path(tempfile.mkdtemp(prefix="elasticd-bench-step-"))
    revision = code_revision()
    try:
        script = freeze_code(workdir / "code")
        rows = [summarize(run_one(args, mode, ranks, workdir, script)) for mode in args.compute for ranks in args.ranks]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(render(rows))
    dirty = " plus uncommitted changes to elasticd/ or examples/" if revision["uncommitted_changes"] else ""
    print(f"code: commit {revision['commit']}{dirty}")
    if args.json is not None:
        machine = {
            "python": platform.python_version(),
            "torch": version("torch"),
            "accelerate": version("accelerate"),
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
        }
        settings = {"blocks": args.blocks, "steps": args.steps, "warmup": args.warmup, "sleep_s": SLEEP_S}
        report = {"machine": machine, "code": revision, "settings": settings, "results": rows}
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
