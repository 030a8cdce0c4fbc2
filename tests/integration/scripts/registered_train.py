"""A job that keeps state of its own the accelerate way: a step counter and an EMA of a parameter, objects with
``state_dict``/``load_state_dict`` registered with ``accelerator.register_for_checkpointing`` and updated after each
optimizer step (tests/integration/test_registered_state.py).

Every rank appends one JSON line per completed step to ``--record``: the step, its rank and pid, the counter, the
EMA and the parameter it follows (after the step), so a test can check both objects against the weights at every
step on every rank. Rank 0 prints the step lines ``cluster.py`` waits on.

elasticd start ... tests/integration/scripts/registered_train.py --epochs 50 --record states.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import torch
from accelerate import Accelerator
from torch import nn

import elasticd

FEATURES, DATASET, GLOBAL_BATCH, MICRO_BATCH = 16, 480, 48, 4
EMA_DECAY = 0.9


class Samples(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(7)
        self.x = torch.randn(DATASET, FEATURES, generator=g)
        self.y = torch.sin(self.x.sum(dim=1, keepdim=True))

    def __len__(self) -> int:
        return DATASET

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "y": self.y[i]}


class StepCounter:
    """The script's own count of optimizer steps."""

    def __init__(self) -> None:
        self.steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = int(state["steps"])


class ParameterEma:
    """An exponential moving average of one parameter, from zero: after step s, d * ema(s-1) + (1-d) * p(s)."""

    def __init__(self, parameter: torch.Tensor) -> None:
        self.parameter = parameter
        self.value = torch.zeros_like(parameter.detach())
        self.updates = 0

    @torch.no_grad()
    def update(self) -> None:
        self.value.mul_(EMA_DECAY).add_(self.parameter.detach(), alpha=1 - EMA_DECAY)
        self.updates += 1

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value, "updates": self.updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value.copy_(state["value"])
        self.updates = int(state["updates"])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--sleep", type=float, default=0.05)
    p.add_argument("--record", required=True)
    args = p.parse_args()
    accelerator = Accelerator(cpu=True)
    run = elasticd.attach(accelerator)
    loader = run.dataloader(Samples(), global_batch_size=GLOBAL_BATCH, micro_batch_size=MICRO_BATCH, seed=0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, 32), nn.Tanh(), nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02)
    model, optimizer = accelerator.prepare(model, optimizer)
    parameter = accelerator.unwrap_model(model)[2].weight
    counter, ema = StepCounter(), ParameterEma(parameter)
    accelerator.register_for_checkpointing(counter, ema)
    run.resume(model, optimizer)
    record = open(args.record, "a")  # noqa: SIM115  # every rank appends, one line per step
    for batch in run.batches(loader, epochs=args.epochs):
        with accelerator.accumulate(model):
            valid = batch["valid"].float()
            error = ((model(batch["x"]) - batch["y"]) ** 2).mean(dim=1)
            loss = (error * valid).sum() / valid.sum().clamp(min=1)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            if accelerator.sync_gradients:  # after each optimizer step, as accelerate's examples keep such state
                counter.steps += 1
                ema.update()
        if not run.step(loss):
            continue
        line = {
            "step": run.state.step,
            "rank": run.rank,
            "pid": os.getpid(),
            "counter": counter.steps,
            "updates": ema.updates,
            "ema": ema.value.reshape(-1).tolist(),
            "param": parameter.detach().reshape(-1).tolist(),
        }
        print(json.dumps(line), file=record, flush=True)
        time.sleep(args.sleep)
        if accelerator.is_main_process:
            step = {"event": "step", "step": run.state.step, "world_size": accelerator.num_processes, "t": time.time()}
            print(json.dumps(step), flush=True)
    run.close()
    if accelerator.is_main_process:
        print(json.dumps({"event": "done", "step": run.state.step, "t": time.time(), "pid": os.getpid()}), flush=True)
    accelerator.end_training()


if __name__ == "__main__":
    main()
