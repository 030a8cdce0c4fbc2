"""World-size-1 cycles of elasticd's collective backend code, in a process of its own (bench/gpu_check.py's
``backend_cycles``): ``cycles`` times, the hot path's ``Groups.replace`` (retire the old default group, form a new
one over a fresh store), an all-reduce of 4 MB on the group's device, checked. On NCCL that is torch's
``init_process_group(..., device_id=)``, a real all-reduce on the GPU and ``ncclCommAbort`` of the old communicator
(``NcclGroups.retire``) with the environment the daemon gives workers (``worker_env``): the mechanics of an
in-place re-formation on one GPU, not a multi-rank recovery (NCCL refuses two ranks of a group on one GPU).

Prints one JSON line: ``ok``, the backend, per cycle the seconds to replace the group (retire and form) and to
all-reduce and ``can_shrink`` (NCCL: whether this build's communicator offers ``ncclCommShrink``); or ``problem``.

    python bench/gpu_backend_cycles.py --backend nccl|gloo --device cuda|cpu [--cycles 5]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/gpu_backend_cycles.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch
import torch.distributed as dist

from elasticd.worker.hot.backend import Groups, collective_device, groups_named, worker_env

ELEMENTS = 1 << 20  # 4 MB of fp32
TIMEOUT = timedelta(seconds=60)


def cycle(groups: Groups, base: dist.Store, index: int, device: str) -> dict[str, float | bool]:
    t0 = time.perf_counter()
    group, how = groups.replace(dist.PrefixStore(f"cycle{index}", base), 0, 1, None)
    t1 = time.perf_counter()
    where = collective_device(group)
    if device == "cuda" and where.type != "cuda":
        where = torch.device("cuda", torch.cuda.current_device())  # gloo with the tensor on the GPU
    tensor = torch.full((ELEMENTS,), float(index + 1), device=where)
    dist.all_reduce(tensor, group=group)
    if where.type == "cuda":
        torch.cuda.synchronize(where)
    if float(tensor[0]) != float(index + 1):
        raise RuntimeError(f"cycle {index}: all-reduce gave {float(tensor[0])}, expected {index + 1}")
    t2 = time.perf_counter()
    return {"replace_s": t1 - t0, "all_reduce_s": t2 - t1, "can_shrink": groups.can_shrink(group), "new": how == "new"}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=["nccl", "gloo"], required=True)
    p.add_argument("--device", choices=["cuda", "cpu"], required=True)
    p.add_argument("--cycles", type=int, default=5)
    args = p.parse_args()
    os.environ.update(worker_env(os.environ))  # as the daemon sets a worker's: NCCL errors keep the process
    result: dict[str, object] = {"backend": args.backend, "device": args.device, "torch": torch.__version__}
    try:
        if args.device == "cuda":
            torch.cuda.set_device(0)
            result["gpu"] = torch.cuda.get_device_name(0)
        groups = groups_named(args.backend, timeout=TIMEOUT, environ=os.environ)
        base = dist.HashStore()
        cycles = []
        for index in range(args.cycles):
            cycles.append(cycle(groups, base, index, args.device))
        t0 = time.perf_counter()
        if dist.group.WORLD is not None:
            groups.retire(dist.group.WORLD)
        result["last_retire_s"] = round(time.perf_counter() - t0, 4)
        result["cycles"] = [{k: round(v, 4) if isinstance(v, float) else v for k, v in c.items()} for c in cycles]
        result["ok"] = len(cycles) == args.cycles
    except Exception as exc:  # one line for the driver: what failed, where
        result["ok"] = False
        result["problem"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()[-2000:]
    print(json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
