"""One rank of two over a TCPStore: a healthy step, a failed step (cut), two healthy steps (``test_hot_cutoff.py``).

argv: PORT RANK [DDP_OPTION ...] (``find_unused_parameters``, ``static_graph``, ``gradient_as_bucket_view``: set
True). Prints one JSON line: how many parameters got a gradient in each step, and the last step's gradients.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository, for tests.integration

from tests.integration.cutoff_model import Rank


def main() -> None:
    port, rank = int(sys.argv[1]), int(sys.argv[2])
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=30))
    ddp: dict[str, Any] = {option: True for option in sys.argv[3:]}
    member = Rank(**ddp)
    counts = [member.step(1 + rank)]
    member.health.fail("a peer died")  # as a failure notice does, before this rank's backward
    counts.append(member.step(10 + rank))
    member.health.consume()  # the step boundary
    counts += [member.step(20 + rank), member.step(30 + rank)]
    print(json.dumps({"counts": counts, "cuts": member.cutoff.cuts, "gradients": member.gradients().tolist()}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
