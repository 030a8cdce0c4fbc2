"""One rank of two over a TCPStore, driving the worker library's sync points (``test_sync_points.py``).

argv: PORT RANK STEP_TIME_S. Every step is reported to the coordinator as taking STEP_TIME_S (no sleep: the step time
is what the coordinator is told). Rank 1 asks for a checkpoint right before step 20's sync point. Prints one JSON line:
the steps whose outcome said "requested", and the sync interval at the end.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta

import torch.distributed as dist

from elasticd.worker.coordination import Coordinator

REQUEST_AT = 20


def main() -> None:
    port, rank, step_time_s = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=30))
    coordinator = Coordinator(rank=rank, world_size=2)
    requested = []
    for step in range(1, 41):
        if rank == 1 and step == REQUEST_AT:
            coordinator.requested = True  # as SIGUSR2 from the daemon sets it
        if coordinator.at_step(step, step_time_s).requested:
            requested.append(step)
    print(json.dumps({"requested": requested, "interval": coordinator.interval}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
