"""What accelerate made of a worker's environment: precision, autocast dtype, processes, CPU threads.

argv: OUT_DIR -- writes OUT_DIR/rank-<process index>.json. A plain accelerate script: no elasticd import.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from accelerate import Accelerator

accelerator = Accelerator()
layer = torch.nn.Linear(4, 4)
inside: list[torch.dtype] = []  # a layer's own output: prepare() casts what the model returns back to fp32
layer.register_forward_hook(lambda _module, _inputs, output: inside.append(output.dtype))
model = accelerator.prepare(torch.nn.Sequential(layer))
model(torch.ones(2, 4, device=accelerator.device))
Path(sys.argv[1], f"rank-{accelerator.process_index}.json").write_text(
    json.dumps(
        {
            "mixed_precision": accelerator.mixed_precision,
            "autocast_dtype": str(inside[0]),
            "num_processes": accelerator.num_processes,
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "torch_threads": torch.get_num_threads(),
        }
    )
)
