"""An accelerate training script that survives anything elasticd throws at it (examples/plain_train.py, elastic).

    elasticd start --nproc-per-node 2 examples/train.py          # elastic, restarted through failures
    python examples/train.py                                     # plain: the library acts locally

Everything the accelerate tutorial shows is here: config, prepare, backward, autocast, gradient accumulation,
save_state/load_state. elasticd adds: resume from the newest committed checkpoint at any world size, the same
global batch and LR schedule at any world size, every sample of an epoch exactly once, checkpoints (periodic and on
demand), a guard against non-finite steps, and progress beats to the daemon.
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
from torch.utils.data import Dataset

import elasticd

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
    p.add_argument("--record-ids", default=None, help="append the sample ids each rank trains on (tests)")
    p.add_argument("--save-final", default=None, help="write the final weights here (tests)")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    backend = [InitProcessGroupKwargs(backend=args.process_group_backend)] if args.process_group_backend else []
    accelerator = Accelerator(
        mixed_precision=args.mixed_precision,
        cpu=not torch.cuda.is_available(),  # without it, accelerate on a CPU host ignores WORLD_SIZE and runs alone
        kwargs_handlers=backend,
    )
    run = elasticd.attach(accelerator)  # finds the newest committed checkpoint, if any
    torch.manual_seed(args.seed)
    dataset = Regression(args.dataset_size, args.seed)
    loader = run.dataloader(dataset, global_batch_size=args.global_batch, micro_batch_size=args.micro_batch, seed=0)
    hidden = [layer for _ in range(args.depth - 1) for layer in (nn.Linear(args.width, args.width), nn.Tanh())]
    model = nn.Sequential(nn.Linear(FEATURES, args.width), nn.Tanh(), *hidden, nn.Linear(args.width, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1.0 + 0.01 * s))
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    run.resume(model, optimizer, scheduler)  # load_state + data position; a no-op on a fresh run
    if accelerator.is_main_process:
        started = {"event": "start", "mixed_precision": accelerator.mixed_precision, "device": str(accelerator.device)}
        print(json.dumps({**started, "world_size": accelerator.num_processes}), flush=True)
    record = open(args.record_ids, "a") if args.record_ids else None  # noqa: SIM115

    for batch in run.batches(loader, epochs=args.epochs):  # continues exactly where the run stopped
        if record is not None:
            ids = batch["id"][batch["valid"]].tolist()
            # recorded before the step (a rank killed right after its gradient was reduced still counts);
            # a step may be tried again: after a rollback, a restart (round) or a recovery in place (epoch)
            attempt = {"round": run.settings.round, "rollbacks": run.state.rollbacks, "epoch": run.epoch}
            line = {"step": run.state.step + 1, **attempt, "rank": run.rank, "ids": ids}
            print(json.dumps(line), file=record, flush=True)
        with accelerator.accumulate(model), accelerator.autocast():
            error = ((model(batch["x"]) - batch["y"]) ** 2).mean(dim=1)
            valid = batch["valid"].float()  # the epoch's last step is padded: padding does not count
            loss = (error * valid).sum() / valid.sum().clamp(min=1)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        # beat, NaN guard, periodic or requested checkpoint; True once per completed optimizer step
        if run.step(loss):
            time.sleep(args.sleep)
            if accelerator.is_main_process:
                line = {
                    "event": "step",
                    "step": run.state.step,
                    "epoch": run.state.data.epoch,
                    "loss": round(loss.item(), 6),
                    "lr": scheduler.get_last_lr()[0],
                    "world_size": accelerator.num_processes,
                    "accumulation": accelerator.gradient_accumulation_steps,
                    "pid": os.getpid(),
                    "t": time.time(),
                }
                print(json.dumps(line), flush=True)
    run.close()
    if args.save_final:
        weights = accelerator.get_state_dict(model)  # on every rank: under FSDP it gathers the shards
        if accelerator.is_main_process:
            torch.save(weights, args.save_final)
    if accelerator.is_main_process:
        print(json.dumps({"event": "done", "step": run.state.step, "t": time.time(), "pid": os.getpid()}), flush=True)
    accelerator.end_training()


if __name__ == "__main__":
    main()
