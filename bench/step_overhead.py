"""Per-step overhead benchmark: what elasticd's worker library, and its hot recovery path, add to a ~20 ms step.

Two loops (three with ``--hot`` at 2 ranks) run side by side in one process, on one ``Accelerator(cpu=True)``, each
with its own model, AdamW and LambdaLR (prepared by the accelerator) over the same map-style synthetic dataset, and
the same step body::

    with accelerator.accumulate(model):
        loss = mse(model(batch["x"]), batch["y"]); accelerator.backward(loss)
        optimizer.step(); scheduler.step(); optimizer.zero_grad()

- ``baseline``: plain accelerate, batches from a standard ``DataLoader`` prepared by the accelerator;
- ``elasticd``: the same body with batches from ``run.batches(run.dataloader(...))`` and ``run.step(loss)`` after it
  (so the NaN guard wrapped around ``optimizer.step``, the beat, the batch plan and the coordinator are all in). A
  ``BeatReceiver`` in the benchmark process stands in for the daemon (``ELASTICD_SOCKET``), so beats really leave
  the worker, and a board directory (``ELASTICD_BOARD``) makes the worker write its hang-watchdog slot every step
  and answer stack and flight-recorder requests (forward-pass timing hooks included); checkpoints are off
  (``WorkerSettings(checkpoint_every_steps=0)``) in a temporary directory. This is the cold path (``--recovery cold``).
- ``hot`` (``--hot``, the default, at 2+ ranks only: a world of one has nobody to re-form with): the ``elasticd`` loop
  again, from a second ``Run`` with hot recovery armed as under ``elasticd start --recovery hot``: its settings come
  from the ``ELASTICD_*`` variables a daemon exports (recovery ``hot``, the etcd endpoint and credentials, a fence
  token, a node id per rank, the local address), so ``run.resume`` arms ``HotPath``: the ``ResilientAllReduce`` comm
  hook on this loop's DDP model (the other two keep DDP's default all-reduce: checked), the failed-step guard around
  ``optimizer.step``, the backward cutoff's hook on every parameter, the ``FailureWatch`` thread holding an etcd watch,
  and the liveness probe listener. The benchmark's process starts an embedded etcd with authentication on (as production
  etcd must be) and holds one node liveness lease per rank on it, refreshed as a daemon does (``NodeLease``), so the
  watch sees every node alive, and a greeting listener and registry record per rank, as each daemon has, so that the
  silence watch greets the next node's "daemon" every 0.1 s. Every rank must report ``run.hot`` armed, and the hot path
  must not have failed a step during the run (no recovery, membership epoch 0), or the run fails.

A sample is a sequence of 16 tokens of 16 features; the MLP applies to every token, a micro-batch is 32
sequences. Compute per step (``--compute``): ``sleep`` adds ``time.sleep(0.02)`` to a tiny MLP (the most stable
stand-in for 20 ms of work on a small noisy machine); ``matmul`` has no sleep but an MLP ``--hidden`` wide (0.47M
parameters by default) whose forward, backward and AdamW take about 20 ms on one core (wider and memory-bound, the
step time of this VM swings by +-15 %; this size stays compute-bound). Each mode runs as 1 process and as 2 gloo
ranks under ``torchrun --standalone`` (``OMP_NUM_THREADS=1`` everywhere), so the DDP gradient all-reduce is in every
loop and the coordinator's periodic all-reduce in elasticd's.

After ``--warmup`` steps of each loop, ``--blocks`` rounds of one block of ``--steps`` steps per loop follow, each
round in another order of the loops (all orders in turn: ABBA for two loops; with three, 6 rounds put every loop
in every position twice), so that drift of the machine hits every loop alike. A step's time is the wall time
between the ends of two consecutive steps on rank 0 (data loading included). Reported per loop: the median step,
the median of block means (which, unlike the median step, includes costs paid once every few steps, such as the
coordinator's all-reduce); overhead = median elasticd / median baseline - 1 (target: at most 1 %), in percent and
in microseconds per step; ``pairs`` gives the overhead of the two loops' blocks of each round, whose spread is the
noise of the machine. For the hot loop the same against the baseline and against the cold ``elasticd`` loop (the
hot path's own cost; target: at most 2 %), and the CPU time the hot path's threads used on rank 0 over the measured
rounds (they run whichever loop is stepping, so the step medians of all loops carry their idle cost alike).

Workers run a copy of ``elasticd/`` and ``bench/`` taken when the benchmark starts (others edit the tree meanwhile);
the JSON records the commit. Before each run the benchmark waits for other processes to go quiet, and measures what
everything else used during it (``others``, in cores; the benchmark's own etcd is not counted as others); a run
above a quarter core is measured once more. ``--breakdown`` also times the parts of elasticd's step in place (timers
wrapped around library functions, which cost some microseconds each: take the overhead itself from a run without
it). The raw results go to ``bench/results/step_overhead-<commit>.json`` unless ``--json`` says otherwise.

    python bench/step_overhead.py [--compute sleep matmul] [--ranks 1 2] [--blocks 6] [--steps 200] [--no-hot]
                                  [--breakdown] [--json OUT]

``--sharded-mirror`` runs bench/shard_mirror.py instead, with the other arguments (its own): what a sharded (FSDP2)
job's shard mirrors add to its step.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/step_overhead.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import code_revision, machine, results_path, snapshot_code, versions, wait_for_quiet, write_results
from elasticd import envvars
from elasticd.agent.beats import BeatReceiver
from elasticd.agent.node_lease import NodeLease
from elasticd.agent.registry import NodeRegistry
from elasticd.endpoints import parse_endpoints
from elasticd.etcd.client import EtcdClient
from elasticd.etcd.server import EmbeddedEtcd
from elasticd.keys import RunKeys
from elasticd.liveness_probe import ProbeListener

TARGET_OVERHEAD = 0.01  # elasticd's median step over the baseline's, minus 1
TARGET_HOT_OVERHEAD = 0.02  # issue 11: the hot path (comm hook, watch thread) at 20 ms steps, hot over cold and base
SLEEP_S = 0.02  # stand-in compute per optimizer step in --compute sleep
FEATURES, SEQUENCE = 16, 16  # a sample: SEQUENCE tokens of FEATURES inputs each
MICRO_BATCH = 32  # sequences per micro-batch, per rank (512 tokens)
DISTINCT = 4096  # sequences actually stored: sample i is sequence i % DISTINCT (a few MB whatever the step count)
HIDDEN = {"sleep": 64, "matmul": 480}  # MLP width for each compute mode (--hidden overrides matmul's)
# One (compute, ranks) run: 2 or 3 x (warmup + blocks x steps) steps of 20-35 ms plus ~10 s of startup, 1.5-2.5 min.
RUN_TIMEOUT_S = 600
LOOPS = ("baseline", "elasticd")  # "hot" joins them in a run with hot recovery armed (see loops())
# What a daemon started with --recovery hot would tell its workers (elasticd/agent/daemon.py); the node id gets the
# rank appended (node_id()): every rank stands for a node of its own, as in the recovery benchmarks.
HOT_RUN_ID = "bench-hot"
HOT_FENCE_TOKEN = "0.bench"  # "<round's first token>.<n>": the member of rank r is "0.bench.r"
HOT_NODE = "bench-node"
ETCD_START_TIMEOUT_S = 30.0
# Before each run, wait at most this long (s) for other processes to use under a quarter core. A run during which
# anything else (other processes, the host's steal) used more than CONTENDED_CORES cores on average is run once
# more, and flagged if that one is contended too: its overhead would be mostly their noise.
QUIET_TIMEOUT_S = 120.0
CONTENDED_CORES = 0.25


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compute", nargs="+", choices=["sleep", "matmul"], default=["sleep", "matmul"])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2], help="process counts to measure")
    parser.add_argument("--blocks", type=int, default=6, help="measured rounds: one block per loop each")
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps per block")
    parser.add_argument("--warmup", type=int, default=50, help="unmeasured steps of each loop first")
    parser.add_argument("--hidden", type=int, default=HIDDEN["matmul"], help="MLP width in --compute matmul")
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="also time the pieces of a step (their timers inflate the overhead: read it from a run without)",
    )
    parser.add_argument(
        "--hot",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="at 2+ ranks, also run the elasticd loop with hot recovery armed, against an embedded etcd (default: on)",
    )
    parser.add_argument(
        "--json", type=Path, help="where to write the results (default: bench/results/step_overhead-<commit>.json)"
    )
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)  # internal: result file of one run
    parser.add_argument("--mode", choices=["sleep", "matmul"], help=argparse.SUPPRESS)  # internal: the child's
    parser.add_argument("--dir", type=Path, help=argparse.SUPPRESS)  # internal: the child's checkpoint dir
    return parser.parse_args(argv)


def loops(hot: bool) -> tuple[str, ...]:
    return (*LOOPS, "hot") if hot else LOOPS


def round_order(names: Sequence[str], index: int) -> tuple[str, ...]:
    """The loops' order in round ``index``: every permutation in turn (two loops: ABBA; three: 6 rounds put each
    loop in each position twice), so drift of the machine hits every loop alike."""
    orders = list(itertools.permutations(names))
    return orders[index % len(orders)]


def node_id(base: str, rank: int) -> str:
    """The node id rank ``rank`` reports in the hot run: a node of its own per rank."""
    return f"{base}-{rank}"


# -- the worker: one (compute, ranks) run, under torchrun when ranks > 1 ---------------------------------------------


def hot_settings(args: argparse.Namespace, world: int) -> Any:
    """The hot loop's ``WorkerSettings``: what a daemon started with ``--recovery hot`` exports (read from the
    environment the benchmark set, as a worker under a daemon does), with checkpoints off and a board of its own."""
    from elasticd.worker.settings import WorkerSettings

    daemon = WorkerSettings.from_env()
    rank = int(os.environ.get("RANK", "0"))
    board = Path(os.environ[envvars.BOARD]) / "hot"  # the cold loop's Run owns the slots of the board itself
    board.mkdir(exist_ok=True)
    settings = replace(
        daemon,
        checkpoint_dir=args.dir / "hot",
        checkpoint_every_steps=0,  # no checkpoint during the measurement
        checkpoint_every_seconds=0.0,
        board=str(board),
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        nproc_per_node=world,  # the same batch plan as the cold loop's
        node_id=node_id(daemon.node_id or HOT_NODE, rank),
    )
    if settings.recovery != "hot" or not (settings.etcd and settings.fence_token and settings.local_addr):
        raise RuntimeError(f"the hot run's environment lacks what a daemon exports for --recovery hot: {settings}")
    return settings


def comm_hooks(model: Any) -> list[str]:
    """The states of the comm hooks registered on ``model`` by type name ([] for DDP's default all-reduce, and for
    a model that is no ``DistributedDataParallel``, in a 1-process run)."""
    import torch

    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return []
    hooks = getattr(model, "_comm_hooks", None)
    if hooks is None:
        raise RuntimeError("torch's DistributedDataParallel._comm_hooks moved: update this benchmark")
    return [type(state).__name__ for _, state in hooks]


def thread_cpu_s() -> dict[str, float]:
    """CPU seconds (user + system) used so far by each thread of this process, by Python thread name; threads
    Python did not start (gloo's, grpc's) summed under "native threads"."""
    import threading

    import psutil

    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    used: dict[str, float] = {}
    for thread in psutil.Process().threads():
        name = names.get(thread.id, "native threads")
        used[name] = used.get(name, 0.0) + thread.user_time + thread.system_time
    return used


def instrument(pieces: dict[str, list[float]], loop: list[str]) -> None:
    """Wrap the parts of elasticd's step in timers that append their wall times (s) to ``pieces``, by the name of the
    loop running (``loop[0]``: the cold and the hot loop call the same library functions) and of the part."""
    from elasticd.worker import guard, step_beats
    from elasticd.worker.beats import BeatClient
    from elasticd.worker.coordination import Coordinator
    from elasticd.worker.hot.comm_hook import ResilientAllReduce
    from elasticd.worker.hot_path import HotPath
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
                pieces.setdefault(f"{loop[0]}: {name}", []).append(time.perf_counter() - start)

        setattr(owner, attribute, timed)

    # guarded_step looks grads_nonfinite up in its module at every call
    wrap(guard, "grads_nonfinite", "guard: grads_nonfinite (in optimizer.step)")
    wrap(Run, "step", "run.step, all of it")
    wrap(BeatClient, "send", "run.step: beat send")
    wrap(TrainingState, "advanced", "run.step: state.advanced")
    wrap(step_beats, "loss_value", "run.step: loss.item()")
    wrap(Coordinator, "at_step", "run.step: coordinator.at_step")
    wrap(Coordinator, "_agree", "coordinator all-reduce (at sync steps)")
    wrap(ElasticSampler, "_step", "batches: sampler step slice")
    # the hot path's per-step work (the failed-step guard's check is a closure inside optimizer.step: not wrapped)
    wrap(ResilientAllReduce, "reduce", "comm hook: reduce (per bucket, until issued)")
    wrap(HotPath, "recovered_from_failure", "run.step: hot.recovered_from_failure")


def worker(args: argparse.Namespace) -> None:
    """All loops in one process; rank 0 writes its step times (s) to ``args.worker``."""
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
    current = ["setup"]  # the loop running now, for the breakdown's timers
    if args.breakdown:
        instrument(pieces, current)
    accelerator = Accelerator(cpu=True)  # a CPU-only host ignores WORLD_SIZE without cpu=True
    world, micro = accelerator.num_processes, MICRO_BATCH
    settings = WorkerSettings(
        run_id="bench",
        checkpoint_dir=args.dir,
        checkpoint_every_steps=0,  # no checkpoint during the measurement
        socket=os.environ[envvars.SOCKET],
        board=os.environ[envvars.BOARD],  # the hang watchdog's progress slot is written every step, as under a daemon
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        nproc_per_node=world,
    )
    run = elasticd.attach(accelerator, settings)
    # the hot loop's own Run (its own board slots, etcd-backed fence): a second worker library in the process
    run_h = elasticd.attach(accelerator, hot_settings(args, world)) if args.hot else None
    # One epoch covers every step of a loop: no epoch boundary inside a block.
    dataset = Synthetic(micro * world * (args.warmup + args.blocks * args.steps + 1))

    model_b, optimizer_b, scheduler_b = make_training()
    loader_b = DataLoader(dataset, batch_size=micro, shuffle=True, drop_last=True)
    model_b, optimizer_b, scheduler_b, loader_b = accelerator.prepare(model_b, optimizer_b, scheduler_b, loader_b)

    loader_e = run.dataloader(dataset, global_batch_size=micro * world, micro_batch_size=micro, seed=0)
    model_e, optimizer_e, scheduler_e = accelerator.prepare(*make_training())
    run.resume(model_e, optimizer_e, scheduler_e)

    models = {"baseline": model_b, "elasticd": model_e}
    runs = {"elasticd": run}
    if run_h is not None:
        loader_h = run_h.dataloader(dataset, global_batch_size=micro * world, micro_batch_size=micro, seed=0)
        model_h, optimizer_h, scheduler_h = accelerator.prepare(*make_training())
        run_h.resume(model_h, optimizer_h, scheduler_h)  # arms hot recovery: the hook goes on model_h only
        models["hot"], runs["hot"] = model_h, run_h
        armed = accelerator.gather(torch.tensor([int(run_h.hot is not None)])).tolist()
        if not all(armed):
            missing = [rank for rank, on in enumerate(armed) if not on]
            raise RuntimeError(
                f"hot recovery was not armed on rank(s) {missing}: see their hot_recovery_unsupported log line"
            )
    hooks = {name: comm_hooks(model) for name, model in models.items()}
    expected = {name: (["ResilientAllReduce"] if name == "hot" and world > 1 else []) for name in models}
    if hooks != expected:  # the hot path's hook on any other loop's model would make the comparison meaningless
        raise RuntimeError(f"comm hooks per loop: {hooks}, expected {expected}")

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
            name = current[0]
            pieces.setdefault(f"{name}: forward + backward", []).append(backward - start)
            pieces.setdefault(f"{name}: optimizer.step", []).append(stepped - backward)
        return loss

    def baseline_step(batch: dict[str, torch.Tensor]) -> None:
        train_step(model_b, optimizer_b, scheduler_b, batch)

    def elasticd_step(batch: dict[str, torch.Tensor]) -> None:
        run.step(train_step(model_e, optimizer_e, scheduler_e, batch))

    def hot_step(batch: dict[str, torch.Tensor]) -> None:
        assert run_h is not None
        run_h.step(train_step(model_h, optimizer_h, scheduler_h, batch))

    def forever(loader: Any) -> Iterator[Any]:
        while True:
            yield from loader

    steppers: dict[str, tuple[Iterator[Any], Callable[[Any], None]]] = {
        "baseline": (forever(loader_b), baseline_step),
        "elasticd": (run.batches(loader_e, epochs=1_000), elasticd_step),
    }
    if run_h is not None:
        steppers["hot"] = (run_h.batches(loader_h, epochs=1_000), hot_step)
    names = loops(run_h is not None)

    def block(name: str, steps: int) -> list[float]:
        """Step times (s) of ``steps`` steps of loop ``name``, every rank starting together."""
        batches, one_step = steppers[name]
        current[0] = name
        accelerator.wait_for_everyone()
        if name in runs:
            # The pause while the other loops ran is no step of this one: without this, run.step would report a
            # step of several seconds, and the coordinator would sync every step until its average forgot it.
            assert hasattr(runs[name], "_step_started"), "elasticd.worker.run.Run changed: update this benchmark"
            runs[name]._step_started = time.perf_counter()
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

    for name in names:
        block(name, args.warmup)
    pieces.clear()
    samples: dict[str, list[list[float]]] = {name: [] for name in names}
    cpu_before, measured_from = thread_cpu_s(), time.perf_counter()
    for index in range(args.blocks):
        for name in round_order(names, index):
            samples[name].append(block(name, args.steps))
    measured_s = time.perf_counter() - measured_from
    cpu_after = thread_cpu_s()
    hot: dict[str, Any] | None = None
    if run_h is not None:
        assert run_h.hot is not None
        session = run_h.hot.session
        hot = {
            "armed_ranks": int(sum(armed)),
            "member": session.identity.member,
            "node_id": session.identity.node_id,
            "epoch": session.epoch,  # 0: no recovery in place happened
            "failed_steps": session.guard.skipped,
            "steps": run_h.state.step,
            "sync_interval_steps": run_h.coordinator.interval,
        }
        if session.epoch != 0 or session.guard.skipped:
            # a recovery in place in a healthy run: the hot loop's figures are not a healthy step's
            raise RuntimeError(
                f"the hot path failed steps during the measurement (rank {accelerator.process_index}): {hot}"
            )
        run_h.close()
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
            "comm_hooks": hooks,
            "hot": hot,
            # CPU s each thread used over the measured rounds (measured_s of wall time), rank 0
            "measured_s": measured_s,
            "thread_cpu_s": {k: v - cpu_before.get(k, 0.0) for k, v in sorted(cpu_after.items())},
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
    return snapshot_code(dest, bench=True) / "bench" / Path(__file__).name


def run_one(args: argparse.Namespace, mode: str, ranks: int, workdir: Path, script: Path) -> dict[str, Any]:
    """:func:`run_once`, once more if others used the machine meanwhile (see CONTENDED_CORES)."""
    sample = run_once(args, mode, ranks, workdir, script)
    if max(sample["foreign_cores_before"], sample["foreign_cores_during"]) <= CONTENDED_CORES:
        return sample
    print(f"{mode} at {ranks} ranks: others used {sample['foreign_cores_during']:.2f} cores, measuring again")
    return run_once(args, mode, ranks, workdir, script)


class HotEtcd:
    """What the daemons give a hot run: an etcd (authentication on, as production etcd must be) and one node
    liveness lease per rank on it, refreshed as a daemon does, so that the workers' watch sees every node alive."""

    def __init__(self, data_dir: Path, ranks: int) -> None:
        self.server = EmbeddedEtcd(data_dir=data_dir, auth=True)
        self.server.start(ready_timeout_s=ETCD_START_TIMEOUT_S)
        self.client: EtcdClient | None = None
        self.leases: list[NodeLease] = []
        self.listeners: list[ProbeListener] = []
        self.registries: list[NodeRegistry] = []
        try:
            access = self.server.access
            self.client = EtcdClient.connect(
                parse_endpoints(self.server.endpoint), connect_timeout_s=ETCD_START_TIMEOUT_S, **access.connect_kwargs()
            )
            for rank in range(ranks):
                # on a client of its own, which closing the lease closes, as the daemon's (agent/node_lease.py)
                own = EtcdClient.connect(
                    parse_endpoints(self.server.endpoint),
                    connect_timeout_s=ETCD_START_TIMEOUT_S,
                    **access.connect_kwargs(),
                )
                lease = NodeLease(own, RunKeys(HOT_RUN_ID), node_id(HOT_NODE, rank))
                lease.start()
                self.leases.append(lease)
                # the daemon's greeting listener and its registry record, as agent/daemon.py has them: the workers'
                # silence watch (worker/hot/silence.py) greets the next node's every 0.1 s
                listener = ProbeListener("127.0.0.1")
                self.listeners.append(listener)
                registry = NodeRegistry(
                    self.client, RunKeys(HOT_RUN_ID), node_id(HOT_NODE, rank), probe=f"127.0.0.1:{listener.port}"
                )
                registry.claim()
                registry.start_keepalive()
                self.registries.append(registry)
        except BaseException:
            self.close()
            raise
        # what elasticd/agent/daemon.py exports to its workers under --recovery hot (credentials included)
        self.env = {
            envvars.RECOVERY: "hot",
            envvars.ETCD: self.server.endpoint,
            envvars.RUN_ID: HOT_RUN_ID,
            envvars.FENCE_TOKEN: HOT_FENCE_TOKEN,
            envvars.NODE_ID: HOT_NODE,  # the worker appends its rank: node_id()
            envvars.LOCAL_ADDR: "127.0.0.1",  # where peers would probe the workers' liveness port
            **access.worker_env(),
        }

    def cpu_s(self) -> float:
        """CPU s etcd used so far: the benchmark's own, not the others' (it is reaped only by close())."""
        import psutil

        assert self.server.pid is not None
        times = psutil.Process(self.server.pid).cpu_times()
        return float(times.user + times.system)

    def close(self) -> None:
        for lease in self.leases:
            lease.close()
        for registry in self.registries:
            registry.release()
        for listener in self.listeners:
            listener.close()
        if self.client is not None:
            self.client.close()
        self.server.stop()


def run_once(args: argparse.Namespace, mode: str, ranks: int, workdir: Path, script: Path) -> dict[str, Any]:
    """Measure ``mode`` at ``ranks`` processes in a child process tree running ``script`` (a frozen copy of this
    file, see :func:`freeze_code`); the tree is killed as a whole past RUN_TIMEOUT_S. With ``--hot`` at 2+ ranks,
    an etcd for the hot loop runs meanwhile (:class:`HotEtcd`)."""
    hot = args.hot and ranks > 1
    result = workdir / f"result-{mode}-{ranks}.json"
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"] if ranks > 1 else []
    command = [sys.executable, *launcher, str(script), "--worker", str(result), "--mode", mode]
    command += ["--dir", str(workdir / f"checkpoints-{mode}-{ranks}"), "--hidden", str(args.hidden)]
    command += ["--blocks", str(args.blocks), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    command += ["--breakdown"] if args.breakdown else []
    command += ["--hot"] if hot else ["--no-hot"]
    board = workdir / f"board-{mode}-{ranks}"
    board.mkdir(exist_ok=True)
    etcd = HotEtcd(workdir / f"etcd-{mode}-{ranks}", ranks) if hot else None
    try:
        receiver = BeatReceiver(str(workdir / f"beats-{mode}-{ranks}.sock"))
        # One intra-op thread per process: ranks must not fight over the cores of a small machine.
        code = str(script.parent.parent)
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": code,
            envvars.SOCKET: receiver.path,
            envvars.BOARD: str(board),
            **(etcd.env if etcd is not None else {}),
        }
        cores_before = wait_for_quiet(QUIET_TIMEOUT_S)
        machine_before, ours_before = cpu_seconds()
        etcd_before = etcd.cpu_s() if etcd is not None else 0.0
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
        etcd_s = etcd.cpu_s() - etcd_before if etcd is not None else 0.0
        machine_after, ours_after = cpu_seconds()
    finally:
        if etcd is not None:
            etcd.close()
    cores_during = max(0.0, (machine_after - machine_before) - (ours_after - ours_before) - etcd_s) / wall_s
    sample = dict(json.loads(result.read_text()))
    beats = receiver.snapshot().beats
    # every rank sends hello and resumed, then step beats (how often is the library's choice: at least one)
    if beats < 3 * ranks:
        raise RuntimeError(f"the beat receiver got {beats} beats from {ranks} ranks: beats were not really sent")
    if hot and (sample["hot"] is None or sample["hot"]["armed_ranks"] != ranks):
        raise RuntimeError(f"the {mode} run at {ranks} ranks did not run with hot recovery armed: {sample['hot']}")
    sample.update(beats_received=beats, wall_s=wall_s, foreign_cores_before=cores_before)
    sample.update(foreign_cores_during=cores_during, etcd_cores=etcd_s / wall_s)
    return sample


def compare(row: dict[str, Any], loop: str, reference: str) -> dict[str, Any]:
    """Overhead of ``loop`` over ``reference``: of the median steps (fraction and us per step), of the medians of
    block means, and of the two loops' block medians in each round (their spread: how noisy the machine was)."""
    median, base = row[f"{loop}_median_s"], row[f"{reference}_median_s"]
    pairs = zip(row[f"{loop}_block_medians_s"], row[f"{reference}_block_medians_s"], strict=True)
    return {
        "overhead": median / base - 1,
        "overhead_us": (median - base) * 1e6,
        "mean_overhead": row[f"{loop}_block_mean_s"] / row[f"{reference}_block_mean_s"] - 1,
        "pair_overheads": [m / b - 1 for m, b in pairs],
    }


def summarize(sample: dict[str, Any]) -> dict[str, Any]:
    """Medians per loop, overheads, and the per-block samples."""
    keep = ["compute", "ranks", "micro_batch", "hidden", "parameters", "sleep_s", "sync_interval_steps"]
    keep += ["beats_received", "wall_s", "foreign_cores_before", "foreign_cores_during", "etcd_cores"]
    keep += ["comm_hooks", "hot", "measured_s", "thread_cpu_s"]
    row: dict[str, Any] = {key: sample[key] for key in keep}
    for name, blocks in sample["samples"].items():
        row[f"{name}_median_s"] = statistics.median(t for b in blocks for t in b)
        row[f"{name}_block_mean_s"] = statistics.median(statistics.fmean(b) for b in blocks)
        row[f"{name}_block_medians_s"] = [statistics.median(b) for b in blocks]
    row.update(compare(row, "elasticd", "baseline"))  # the cold path, keys as before the hot loop existed
    if "hot" in sample["samples"]:
        row["hot_vs_baseline"] = compare(row, "hot", "baseline")
        row["hot_vs_cold"] = compare(row, "hot", "elasticd")  # what the hot path itself adds
    row["pieces"] = sample["pieces"]
    row["samples"] = sample["samples"]
    return row


def contended(row: dict[str, Any]) -> bool:
    return max(row["foreign_cores_before"], row["foreign_cores_during"]) > CONTENDED_CORES


def render(rows: Sequence[dict[str, Any]]) -> str:
    def ms(seconds: float) -> str:
        return f"{seconds * 1e3:.3f}"

    def spread(fractions: Sequence[float]) -> str:
        percents = [100 * p for p in fractions]
        return f"{min(percents):.2f}..{max(percents):.2f}"

    head = (
        f"{'compute':<7}  {'ranks':>5}  {'base_ms':>8}  {'elastic_ms':>10}  {'overhead':>8}  {'us/step':>7}  "
        f"{'pairs_%':>13}  {'mean_base':>9}  {'mean_elastic':>12}  {'mean_over':>9}  {'others':>6}"
    )
    out = [head, "-" * len(head)]
    for row in rows:
        out.append(
            f"{row['compute']:<7}  {row['ranks']:>5}  {ms(row['baseline_median_s']):>8}  "
            f"{ms(row['elasticd_median_s']):>10}  {100 * row['overhead']:>7.2f}%  {row['overhead_us']:>7.0f}  "
            f"{spread(row['pair_overheads']):>13}  {ms(row['baseline_block_mean_s']):>9}  "
            f"{ms(row['elasticd_block_mean_s']):>12}  {100 * row['mean_overhead']:>8.2f}%  "
            f"{row['foreign_cores_during']:>6.2f}"
        )
    for row in rows:
        verdict = "meets" if row["overhead"] <= TARGET_OVERHEAD else "misses"
        model = f"{row['parameters'] / 1e6:.2f}M parameters (width {row['hidden']})"
        batch = f"micro-batch {row['micro_batch']}x{SEQUENCE}"
        sync = f"sync every {row['sync_interval_steps']} steps, {row['beats_received']} beats received"
        result = f"overhead {100 * row['overhead']:.2f} % ({verdict} the {100 * TARGET_OVERHEAD:.0f} % target)"
        warning = "; CONTENDED: other processes were busy, rerun on a quiet machine" if contended(row) else ""
        out.append(f"{row['compute']}, {row['ranks']} rank(s): {model}, {batch}, {sync}; {result}{warning}")
    out.append(
        "base_ms/elastic_ms: median step (ms); pairs_%: overhead of each round's two block medians; mean_*: median "
        "of block means (ms), which include once-every-few-steps costs; others: cores other processes used meanwhile"
    )
    hot_rows = [row for row in rows if "hot_vs_cold" in row]
    if hot_rows:
        out.append("\nhot recovery armed (comm hook, failed-step guard, watch thread, probe listener) against both:")
        head = (
            f"{'compute':<7}  {'ranks':>5}  {'base_ms':>8}  {'cold_ms':>8}  {'hot_ms':>8}  {'hot/base':>8}  "
            f"{'us/step':>7}  {'pairs_%':>13}  {'hot/cold':>8}  {'us/step':>7}  {'pairs_%':>13}  "
            f"{'mean_hot/base':>13}  {'mean_hot/cold':>13}  {'etcd':>5}"
        )
        out += [head, "-" * len(head)]
        for row in hot_rows:
            base, cold = row["hot_vs_baseline"], row["hot_vs_cold"]
            out.append(
                f"{row['compute']:<7}  {row['ranks']:>5}  {ms(row['baseline_median_s']):>8}  "
                f"{ms(row['elasticd_median_s']):>8}  {ms(row['hot_median_s']):>8}  {100 * base['overhead']:>7.2f}%  "
                f"{base['overhead_us']:>7.0f}  {spread(base['pair_overheads']):>13}  {100 * cold['overhead']:>7.2f}%  "
                f"{cold['overhead_us']:>7.0f}  {spread(cold['pair_overheads']):>13}  "
                f"{100 * base['mean_overhead']:>12.2f}%  {100 * cold['mean_overhead']:>12.2f}%  "
                f"{row['etcd_cores']:>5.3f}"
            )
        for row in hot_rows:
            hot, cold, base = row["hot"], row["hot_vs_cold"], row["hot_vs_baseline"]
            verdicts = [
                f"{what} {100 * c['overhead']:.2f} % ({'meets' if c['overhead'] <= TARGET_HOT_OVERHEAD else 'misses'})"
                for what, c in (("hot path (hot over cold)", cold), ("library with it (hot over baseline)", base))
            ]
            warning = "; CONTENDED: other processes were busy, rerun on a quiet machine" if contended(row) else ""
            out.append(
                f"{row['compute']}, {row['ranks']} ranks: armed on {hot['armed_ranks']} of {row['ranks']} ranks "
                f"(member {hot['member']}, epoch {hot['epoch']}, {hot['failed_steps']} failed steps), comm hooks "
                f"{row['comm_hooks']}; target {100 * TARGET_HOT_OVERHEAD:.0f} %: {'; '.join(verdicts)}{warning}"
            )
            # the hook's deadline watcher, the etcd watch (and pyetcd's Python thread behind it), the probe listener
            threads = {k: v for k, v in row["thread_cpu_s"].items() if k.startswith(("elasticd-hot-", "pyetcd"))}
            hot_steps = sum(len(b) for b in row["samples"]["hot"])
            used = ", ".join(
                f"{name} {1e6 * cpu / hot_steps:.1f} us per hot step ({100 * cpu / row['measured_s']:.3f} % of a core)"
                for name, cpu in threads.items()
            )
            out.append(
                f"  hot path threads' CPU on rank 0 over the measured rounds (the kernel counts 10 ms ticks): "
                f"{used or 'none seen'}"
            )
        out.append(
            "hot/base, hot/cold: overhead of the hot loop's median step over the baseline's and over the cold elasticd "
            "loop's, us/step and pairs_% likewise; mean_*: of the medians of block means; etcd: cores the benchmark's "
            "etcd used (not counted as others)"
        )
    for row in rows:
        if row["pieces"]:
            out.append(f"\nbreakdown, {row['compute']}, {row['ranks']} rank(s), rank 0 (us per call; timers included):")
            for name, (median_s, mean_s, calls) in row["pieces"].items():
                out.append(f"  {name:<56} median {median_s * 1e6:8.1f}  mean {mean_s * 1e6:8.1f}  calls {calls:>5}")
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    given = list(sys.argv[1:] if argv is None else argv)
    if "--sharded-mirror" in given:
        from bench.shard_mirror import main as shard_mirror

        return shard_mirror([a for a in given if a != "--sharded-mirror"])
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
    out = args.json or results_path("step_overhead", revision)
    settings = {"blocks": args.blocks, "steps": args.steps, "warmup": args.warmup, "sleep_s": SLEEP_S}
    settings.update(hot=args.hot, hot_target=TARGET_HOT_OVERHEAD, target=TARGET_OVERHEAD)
    command = ["python", "bench/step_overhead.py", *(argv if argv is not None else sys.argv[1:])]
    report = {"command": command, "machine": machine(), "versions": versions(), "code": revision}
    write_results(out, {**report, "settings": settings, "results": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
