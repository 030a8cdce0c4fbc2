"""What accelerate made of a worker's world under elasticd, with or without ``Accelerator(cpu=True)``.

argv: OUT_DIR cpu|default -- builds ``Accelerator(cpu=True)`` or a bare ``Accelerator()``, trains one epoch of a tiny
model through the worker library (16 samples in global batches of 4: 4 optimizer steps, each checkpointed when the
daemon says ``--checkpoint-every-steps 1``), and writes OUT_DIR/rank-<RANK>.json: the rank torchrun gave the process
and what accelerate says of its world.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from accelerate import Accelerator, PartialState

import elasticd

out, how = Path(sys.argv[1]), sys.argv[2]
accelerator = Accelerator(cpu=True) if how == "cpu" else Accelerator()
run = elasticd.attach(accelerator)
samples = [{"x": torch.full((4,), float(i))} for i in range(16)]
loader = run.dataloader(samples, global_batch_size=4, micro_batch_size=2, seed=0)
layer = torch.nn.Linear(4, 1)
model, optimizer = accelerator.prepare(layer, torch.optim.SGD(layer.parameters(), lr=0.01))
run.resume(model, optimizer)
for batch in run.batches(loader, epochs=1):
    with accelerator.accumulate(model):
        loss = model(batch["x"]).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    run.step(loss)
run.close()
Path(out, f"rank-{os.environ['RANK']}.json").write_text(
    json.dumps(
        {
            "num_processes": accelerator.num_processes,
            "process_index": accelerator.process_index,
            "distributed_type": str(PartialState().distributed_type),
            "steps": run.state.step,
        }
    )
)
accelerator.end_training()
