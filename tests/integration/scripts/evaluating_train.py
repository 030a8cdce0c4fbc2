"""A training script that stops for a long evaluation at one step, inside ``run.busy()`` or not (``--busy``).

elasticd start ... tests/integration/scripts/evaluating_train.py --steps 30 --eval-at 15 --eval-seconds 4 --busy
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from accelerate import Accelerator
from torch import nn

import elasticd

FEATURES = 8


class Regression(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self, size: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(size, FEATURES, generator=g)
        self.y = self.x.sum(dim=1, keepdim=True)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "y": self.y[i]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--eval-at", type=int, default=15)
    p.add_argument("--eval-seconds", type=float, default=4.0)
    p.add_argument("--busy", action="store_true")
    args = p.parse_args()
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    run = elasticd.attach(accelerator)
    loader = run.dataloader(Regression(16 * args.steps), global_batch_size=16, micro_batch_size=8, seed=0)
    model = nn.Linear(FEATURES, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = accelerator.prepare(model, optimizer)
    run.resume(model, optimizer)
    for batch in run.batches(loader, epochs=1):
        with accelerator.accumulate(model):
            loss = ((model(batch["x"]) - batch["y"]) ** 2).mean()
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        run.step(loss)
        time.sleep(0.05)
        if accelerator.sync_gradients and run.state.step == args.eval_at:
            with run.busy() if args.busy else _nothing():
                time.sleep(args.eval_seconds)  # an evaluation far longer than a step
        if accelerator.sync_gradients and accelerator.is_main_process:
            print(json.dumps({"event": "step", "step": run.state.step, "t": time.time(), "world_size": 2}), flush=True)
    run.close()


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


if __name__ == "__main__":
    main()
