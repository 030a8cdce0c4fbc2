"""A plain accelerate training script: the starting point that examples/train.py turns into an elastic one.

    accelerate launch examples/plain_train.py        # or: python examples/plain_train.py

Everything the accelerate tutorial shows is here: config, prepare, backward, autocast, gradient accumulation,
save_state/load_state. README.md shows the diff to examples/train.py.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs
from torch import nn
from torch.utils.data import DataLoader, Dataset

FEATURES = 16


class Regression(Dataset[dict[str, torch.Tensor]]):
    """A synthetic dataset: y = x · w + noise, every sample derived from its id (so runs are reproducible)."""

    def __init__(self, size: int, seed: int = 0) -> None:
        self.size, self.seed = size, seed
        self.true_w = torch.linspace(-1.0, 1.0, FEATURES)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        x = torch.randn(FEATURES, generator=g)
        y = (x @ self.true_w + 0.01 * torch.randn((), generator=g)).unsqueeze(0)
        return {"x": x, "y": y, "id": torch.tensor(i)}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--dataset-size", type=int, default=4800)
    p.add_argument("--global-batch", type=int, default=48, help="samples per optimizer step, all ranks together")
    p.add_argument("--micro-batch", type=int, default=8, help="samples per forward/backward on one rank")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sleep", type=float, default=0.0, help="extra seconds per step, to stand in for real compute")
    p.add_argument("--width", type=int, default=32, help="units per hidden layer")
    p.add_argument("--depth", type=int, default=1, help="hidden layers (bench/recovery.py's large state: 7 of 4096)")
    p.add_argument("--mixed-precision", choices=["no", "bf16", "fp16"], default=None, help="else accelerate's")
    p.add_argument(
        "--process-group-backend",
        choices=["gloo", "nccl"],
        default=None,
        help="else accelerate's (NCCL on GPUs): gloo keeps the model on the GPU and the group on gloo, as workers "
        "sharing one GPU need (NCCL refuses two ranks of a group on one GPU)",
    )
    p.add_argument("--checkpoint-dir", default="checkpoints/plain")
    p.add_argument("--checkpoint-every", type=int, default=50)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    backend = [InitProcessGroupKwargs(backend=args.process_group_backend)] if args.process_group_backend else []
    accelerator = Accelerator(
        mixed_precision=args.mixed_precision,
        gradient_accumulation_steps=args.global_batch // (args.micro_batch * world),
        cpu=not torch.cuda.is_available(),  # without it, accelerate on a CPU host ignores WORLD_SIZE and runs alone
        kwargs_handlers=backend,
    )
    torch.manual_seed(args.seed)
    dataset = Regression(args.dataset_size, args.seed)
    loader = DataLoader(dataset, batch_size=args.micro_batch, shuffle=True)
    hidden = [layer for _ in range(args.depth - 1) for layer in (nn.Linear(args.width, args.width), nn.Tanh())]
    model = nn.Sequential(nn.Linear(FEATURES, args.width), nn.Tanh(), *hidden, nn.Linear(args.width, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1.0 + 0.01 * s))
    model, optimizer, scheduler, loader = accelerator.prepare(model, optimizer, scheduler, loader)
    if os.path.isdir(args.checkpoint_dir):
        accelerator.load_state(args.checkpoint_dir)
    if accelerator.is_main_process:
        started = {"event": "start", "mixed_precision": accelerator.mixed_precision, "device": str(accelerator.device)}
        print(json.dumps({**started, "world_size": accelerator.num_processes}), flush=True)

    step = 0
    for epoch in range(args.epochs):
        for batch in loader:
            with accelerator.accumulate(model), accelerator.autocast():
                loss = nn.functional.mse_loss(model(batch["x"]), batch["y"])
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if not accelerator.sync_gradients:
                continue
            step += 1
            time.sleep(args.sleep)
            if accelerator.is_main_process:
                line = {"event": "step", "epoch": epoch, "step": step, "loss": round(loss.item(), 6), "t": time.time(),
                        "world_size": accelerator.num_processes, "pid": os.getpid()}  # fmt: skip
                print(json.dumps(line), flush=True)
            if step % args.checkpoint_every == 0:
                accelerator.save_state(args.checkpoint_dir)
    accelerator.end_training()


if __name__ == "__main__":
    main()
