"""The product on a GPU, checked by one command: ``elasticd start`` nodes, the worker library and the example scripts
with their model on the device, one line per scenario with its figure and verdict, raw JSON under bench/results/.

**Not yet run on a GPU** (none has been lent where this was written): ``--backend gloo --device cpu`` runs the same
scenarios on the CPU, which is how the suite tests this script (tests/integration/test_gpu_check.py). On a machine
with one GPU (``--device cuda``, the default), every scenario's workers share GPU 0:

- ``elastic``: bench/recovery.py's 7 kB job (examples/train.py) on 3 ``elasticd start`` nodes, one worker each, the
  model on the device and the group on gloo (DDP takes CUDA tensors over gloo; NCCL refuses two ranks of a group on
  one GPU): a join (2 -> 3 nodes) and a node loss (kill -9 of a whole node, 3 -> 2), both in place; seconds to the
  first step at the new size, as bench/recovery.py reports them.
- ``checkpoint``: examples/train.py's MLP sized to each ``--state-mb`` of weights and AdamW moments (default 1024 and
  8192 on a GPU, 16 on the CPU), on 2 nodes: what a save blocks training for, asynchronous (the device -> host copy
  into pinned buffers, then a background write) against blocking, per committed save from the daemons' Prometheus
  histograms; then a node of the asynchronous job is killed and the other resumes alone (world size 2 -> 1) from
  the newest commit.
- ``bf16_nan``: examples/text_classification.py, bf16 autocast from an accelerate config file, a NaN injected into
  rank 0's batch on the device (``ELASTICD_FAULT``): the guard's verdict, the run's end.
- ``device_error``: a worker of 2 indexes out of bounds on its device (on a GPU a real CUDA error, which leaves its
  CUDA context unusable): the documented fallback, the worker exits and a fresh process takes its place.
- ``backend_cycles``: ``--backend``'s group at world size 1 through elasticd's backend code (bench/gpu_backend_
  cycles.py; NCCL: init, all-reduce on the GPU, ``ncclCommAbort``, re-init), ``--cycles`` times.
- ``nccl_multi`` (2+ GPUs): NCCL node loss, hang (a SIGSTOPped rank) and join in place across GPUs
  (bench/gpu_nccl_multi.py). On one GPU it is reported as not run; on the CPU it runs the same on gloo, the hook
  polling every bucket as it does on a GPU.

    bench/gpu_check.sh [--device cuda|cpu] [--backend nccl|gloo] [--scenarios ...] [--state-mb MB ...]
                       [--json OUT] [--logs DIR]

Exit status: 0 every scenario ok, 1 one failed, 2 this machine cannot run the check (one line says why). The raw
results go to ``bench/results/gpu_check-<device>-<backend>-<short commit>.json`` unless ``--json`` says otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/gpu_check.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from bench import gpu_nccl_multi, gpu_scenarios, recovery
from bench.common import (
    BenchTimeout,
    code_revision,
    interrupt_on_sigterm,
    machine,
    results_path,
    snapshot_code,
    versions,
    write_results,
)
from bench.gpu_jobs import Target

# in this order: the short ones first, the checkpoint's GBs last but for the multi-GPU harness
SCENARIOS = ("backend_cycles", "bf16_nan", "device_error", "elastic", "checkpoint", "nccl_multi")
# the MLP's width per device: 4096 units make 8 GB of state in ~43 layers on a GPU; 512 keep the CPU's small
WIDTH = {"cuda": 4096, "cpu": 512}
STATE_MB = {"cuda": [1024, 8192], "cpu": [16]}
BUDGET_S = 300.0  # no scenario starts later than this (s)
# The check stops itself here (s), a scenario in flight given up with what it saw, so that the raw file is written
# and every node is gone before bench/gpu_check.sh's own limit (6 minutes).
STOP_S = 340


def cannot_run(device: str, backend: str) -> str | None:
    """Why this machine cannot run the check on ``device`` and ``backend``, or None."""
    if device == "cuda":
        if torch.version.cuda is None:
            return f"this torch ({torch.__version__}) is a CPU build: bench/gpu_check.sh --install puts a CUDA build in"
        if not torch.cuda.is_available():
            return "no CUDA device is visible (nvidia-smi, CUDA_VISIBLE_DEVICES)"
    elif backend == "nccl":
        return "--device cpu runs gloo only (NCCL needs a GPU)"
    return None


def one_line(record: dict[str, Any]) -> str:
    """A scenario's figure and verdict, for the terminal."""
    figures = {
        k: v
        for k, v in record.items()
        if k not in ("scenario", "problem", "milestones", "daemon", "traceback", "samples", "cycles")
        and v not in (None, "", [])
    }
    shown = json.dumps(figures, default=str)
    verdict = "ok" if record.get("problem") is None else f"FAILED: {record['problem']}"
    return f"  {record['scenario']}: {verdict}  {shown[:600]}"


def run_scenario(
    name: str, args: argparse.Namespace, target: Target, logs: Path, started: float
) -> list[dict[str, Any]]:
    workdir = logs / name
    if name == "elastic":
        return gpu_scenarios.elastic(target, workdir)
    if name == "checkpoint":
        width = args.width or WIDTH[args.device]
        records: list[dict[str, Any]] = []
        for mb in args.state_mb:
            label = f"checkpoint_{mb}mb"
            if time.monotonic() - started > args.budget_s:
                records.append({"scenario": label, "problem": f"not run: past the {args.budget_s:g} s budget"})
            else:
                records += _guarded(label, functools.partial(gpu_scenarios.checkpoint, target, workdir, mb, width))
        return records
    if name == "bf16_nan":
        return gpu_scenarios.bf16_nan(target, workdir)
    if name == "device_error":
        return gpu_scenarios.device_error(target, workdir)
    if name == "backend_cycles":
        return gpu_scenarios.backend_cycles(target, workdir, args.backend, args.cycles)
    return nccl_multi(args, workdir)


def nccl_multi(args: argparse.Namespace, workdir: Path) -> list[dict[str, Any]]:
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    if args.device == "cuda" and gpus < 2:
        return [
            {"scenario": "nccl_multi", "not_run": f"{gpus} GPU: NCCL's multi-rank recovery needs 2+", "problem": None}
        ]
    deadline = time.monotonic() + max(60.0, args.budget_s / 3)
    # on the CPU the hook polls every bucket, as it does on a GPU (an NCCL future completes when it is enqueued)
    poll = args.device == "cpu"
    record = gpu_nccl_multi.run(args.backend, workdir, trials=1, victim=0, poll=poll, deadline=deadline)
    samples = record["samples"]
    problems = [s.get("problem") for found in samples.values() for s in found if s.get("problem")]
    figures = {
        f"{scenario}_{key}": round(found[0][key], 4)
        for scenario, key in (("node_loss", "recovered_s"), ("hang", "recovered_s"), ("join", "members_stall_s"))
        if (found := samples.get(scenario)) and key in found[0]
    }
    methods = sorted({m for found in samples.values() for s in found for m in s.get("method", [])})
    return [
        {
            "scenario": "nccl_multi",
            **figures,
            "methods": methods,
            **record,
            "problem": problems[0] if problems else None,
        }
    ]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--backend", choices=["nccl", "gloo"], default=None, help="backend_cycles' and nccl_multi's")
    p.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=None, help="default: all that apply")
    p.add_argument("--state-mb", type=int, nargs="+", default=None, help="checkpoint: state sizes (MB)")
    p.add_argument("--width", type=int, default=None, help="checkpoint: the MLP's units per layer")
    p.add_argument("--cycles", type=int, default=5, help="backend_cycles: form -> all-reduce -> retire cycles")
    p.add_argument("--budget-s", type=float, default=BUDGET_S, help="start no scenario past this (s)")
    p.add_argument("--stop-s", type=int, default=STOP_S, help="give the running scenario up here (s)")
    p.add_argument("--json", type=Path, help="raw results (default: bench/results/gpu_check-<device>-<backend>-...)")
    p.add_argument("--logs", type=Path, help="keep every node's logs here (default: a temporary dir)")
    args = p.parse_args(argv)
    args.backend = args.backend or ("nccl" if args.device == "cuda" else "gloo")
    args.state_mb = args.state_mb or STATE_MB[args.device]
    args.scenarios = args.scenarios or list(SCENARIOS)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if (why := cannot_run(args.device, args.backend)) is not None:
        print(f"gpu_check: {why}", file=sys.stderr)
        return 2
    interrupt_on_sigterm()  # the shell script's timeout: every node is killed on the way out
    signal.signal(signal.SIGALRM, _out_of_time)
    signal.alarm(args.stop_s)
    recovery._quiet_timeout_s = 2.0  # a short wait for others' CPU before each measurement, as a budget allows
    started = time.monotonic()
    revision = code_revision()
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if args.device == "cuda" else []
    print(f"gpu_check: {args.device}, {args.backend}, commit {revision['commit']}, torch {torch.__version__}, {gpus}")
    records: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        logs = args.logs or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="gpu_check-")))
        logs.mkdir(parents=True, exist_ok=True)
        target = Target(args.device, snapshot_code(logs / "code"))
        for name in args.scenarios:
            if time.monotonic() - started > min(args.budget_s, args.stop_s):
                new = [{"scenario": name, "problem": f"not run: past the {args.budget_s:g} s budget"}]
            else:
                try:
                    new = _guarded(name, functools.partial(run_scenario, name, args, target, logs, started))
                except OutOfTime:
                    new = [{"scenario": name, "problem": f"given up at {args.stop_s} s, the check's limit"}]
            print("\n".join(one_line(r) for r in new), flush=True)
            records += new
        signal.alarm(0)
    failed = [r["scenario"] for r in records if r.get("problem") is not None]
    took = time.monotonic() - started
    print(f"gpu_check: {len(records) - len(failed)} ok, {len(failed)} failed {failed} in {took:.0f} s")
    path = args.json or results_path(f"gpu_check-{args.device}-{args.backend}", revision)
    header = {
        "command": ["bench/gpu_check.sh", *(argv if argv is not None else sys.argv[1:])],
        "device": args.device,
        "backend": args.backend,
        "gpus": gpus,
        "seconds": round(time.monotonic() - started, 1),
        "code": revision,
        "machine": machine(),
        "versions": versions(),
    }
    write_results(path, {**header, "records": records})
    return 1 if failed else 0


class OutOfTime(Exception):
    """The check's own time limit (``--stop-s``) came."""


def _out_of_time(_signum: int, _frame: object) -> None:
    raise OutOfTime


def _guarded(name: str, run: Callable[[], list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The scenario's records, or one record saying why it broke (a timeout, a node that exited)."""
    try:
        return run()
    except (BenchTimeout, RuntimeError, OSError, StopIteration, KeyError) as exc:
        return [{"scenario": name, "problem": f"{type(exc).__name__}: {str(exc)[:2000]}"}]


if __name__ == "__main__":
    sys.exit(main())
