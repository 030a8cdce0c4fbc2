"""A small accelerate training script that survives anything elasticd throws at it.

Runs the same under ``elasticd start``, ``torchrun``, ``accelerate launch`` and plain ``python``:

    elasticd start --nproc-per-node 2 examples/train.py --steps 200
    python examples/train.py --steps 50

It learns a linear map from synthetic data. The batch of step ``s`` is drawn from a generator seeded with
``(seed, s)`` and split across ranks, so a run resumed at any world size sees the same data per step. Every
``--checkpoint-every`` steps it commits an ``accelerator.save_state`` checkpoint (atomic: ``.partial`` then rename);
at start it resumes from the newest committed one. Rank 0 prints one JSON line per step.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from accelerate import Accelerator
from torch import nn

from elasticd.worker.beats import BeatClient
from elasticd.worker.checkpoints import CheckpointStore

FEATURES = 16


def parse_args() -> argparse.Namespace:
    env = os.environ.get
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200, help="optimizer steps in total")
    p.add_argument("--global-batch", type=int, default=48, help="samples per optimizer step, all ranks together")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sleep", type=float, default=0.0, help="extra seconds per step, to stand in for real compute")
    p.add_argument("--mixed-precision", choices=["no", "bf16", "fp16"], default="no")
    p.add_argument("--checkpoint-every", type=int, default=int(env("ELASTICD_CHECKPOINT_EVERY_STEPS", "20")))
    p.add_argument("--checkpoint-dir", default=env("ELASTICD_CHECKPOINT_DIR", "checkpoints"))
    p.add_argument("--run-id", default=env("ELASTICD_RUN_ID", "default"))
    p.add_argument("--keep", type=int, default=int(env("ELASTICD_KEEP_CHECKPOINTS", "3")))
    return p.parse_args()


def batch_for_step(step: int, seed: int, global_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole global batch of ``step``, identical on every rank and at every world size."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    true_w = torch.linspace(-1.0, 1.0, FEATURES).unsqueeze(1)
    x = torch.randn(global_batch, FEATURES, generator=g)
    y = x @ true_w + 0.01 * torch.randn(global_batch, 1, generator=g)
    return x, y


def main() -> None:
    args = parse_args()
    accelerator = Accelerator(
        mixed_precision=args.mixed_precision,
        gradient_accumulation_steps=args.grad_accum,
        cpu=not torch.cuda.is_available(),  # without it, accelerate on a CPU host ignores WORLD_SIZE and runs alone
    )
    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(FEATURES, 32), nn.Tanh(), nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1.0 + 0.01 * s))
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)

    store = CheckpointStore(args.checkpoint_dir, args.run_id, keep=args.keep)
    if accelerator.is_main_process:
        store.remove_partials()
    accelerator.wait_for_everyone()
    step = 0
    if (latest := store.latest()) is not None:
        accelerator.load_state(str(latest.path))
        step = latest.step
    beats = BeatClient.from_env()
    world, rank = accelerator.num_processes, accelerator.process_index
    if args.global_batch % (world * args.grad_accum):
        raise SystemExit(f"--global-batch {args.global_batch} must divide by world size x grad accum")
    micro = args.global_batch // (world * args.grad_accum)
    if accelerator.is_main_process:
        print(json.dumps({"event": "start", "step": step, "world_size": world, "t": time.time()}), flush=True)

    while step < args.steps:
        started = time.perf_counter()
        x, y = batch_for_step(step, args.seed, args.global_batch)
        mine = slice(rank * micro * args.grad_accum, (rank + 1) * micro * args.grad_accum)
        for xm, ym in zip(x[mine].split(micro), y[mine].split(micro), strict=True):
            with accelerator.accumulate(model), accelerator.autocast():
                loss = nn.functional.mse_loss(model(xm), ym)
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
        if args.sleep:
            time.sleep(args.sleep)
        step += 1
        loss_value = accelerator.reduce(loss.detach(), reduction="mean").item()
        step_time = time.perf_counter() - started
        beats.send(step=step, loss=loss_value, samples=micro * args.grad_accum, step_time_s=step_time)
        if accelerator.is_main_process:
            line = {
                "event": "step",
                "step": step,
                "loss": round(loss_value, 6),
                "world_size": world,
                "t": time.time(),
            }
            print(json.dumps(line), flush=True)
        if args.checkpoint_every and step % args.checkpoint_every == 0:
            if accelerator.is_main_process:
                store.begin(step)
            accelerator.wait_for_everyone()
            accelerator.save_state(str(store.partial_path(step)))
            accelerator.wait_for_everyone()
            if accelerator.is_main_process:
                store.commit(step, {"world_size": world})
            accelerator.wait_for_everyone()

    if accelerator.is_main_process:
        print(json.dumps({"event": "done", "step": step, "world_size": world, "t": time.time()}), flush=True)
    accelerator.end_training()


if __name__ == "__main__":
    main()
