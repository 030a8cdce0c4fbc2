"""A Hugging Face ``Trainer`` script under elasticd: examples/text_classification.py's model and data, trained by
``transformers.Trainer`` with one changed line (``from elasticd import Trainer``).

    pip install 'elasticd[examples]'                       # transformers
    elasticd start --min-nodes 2 --max-nodes 3 examples/trainer_text_classification.py
    python examples/trainer_text_classification.py         # plain: trains as transformers' Trainer would

The same offline BERT-style classifier and labelled corpus as examples/text_classification.py, trained with mixed
precision as accelerate's config file says (bf16 on a CPU). ``elasticd.Trainer`` keeps the global batch at
``--global-batch`` whatever the world size (the accumulation adapts), resumes from the run's newest committed
checkpoint, commits Trainer's ``checkpoint-N`` folders into the run's lineage every ``--save-steps`` and when its
daemon asks (a drain, a SIGTERM), and trains every sentence of an epoch exactly once through lost and joining nodes.
Rank 0 prints one JSON line per optimizer step (for the tests and the demo).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import TrainerCallback, TrainingArguments

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the model and data of examples/text_classification.py

from text_classification import Reviews, build_model, build_tokenizer

from elasticd import Trainer  # the one changed line; it was: from transformers import Trainer

transformers.utils.logging.set_verbosity_warning()
transformers.utils.logging.disable_progress_bar()


class Sentences(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """The reviews as Trainer takes them; ``sample_id`` reaches the collator, never the model."""

    def __init__(self, reviews: Reviews) -> None:
        self.reviews = reviews

    def __len__(self) -> int:
        return len(self.reviews)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        item = self.reviews[i]
        return {k: item[k] for k in ("input_ids", "attention_mask", "labels")} | {"sample_id": item["id"]}


class Collate:
    """Stacks a micro-batch for the model; keeps its sample ids for :class:`RecordIds`."""

    def __init__(self) -> None:
        self.ids: list[int] = []

    def __call__(self, items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        self.ids += [int(x["sample_id"]) for x in items]
        return {k: torch.stack([x[k] for x in items]) for k in ("input_ids", "attention_mask", "labels")}


class RecordIds(TrainerCallback):
    """Appends, per optimizer step and rank, the sample ids it trained (tests: every sample of an epoch once)."""

    def __init__(self, collate: Collate, path: str) -> None:
        self.collate = collate
        self.file = open(path, "a")  # noqa: SIM115  (open for the process' life; a rank killed later still counts)

    def on_step_end(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        ids, self.collate.ids = self.collate.ids, []  # Trainer fetched exactly this step's micro-batches
        line = {"step": state.global_step, "round": int(os.environ.get("ELASTICD_ROUND", "0")),
                "rank": args.process_index, "ids": ids}  # fmt: skip
        print(json.dumps(line), file=self.file, flush=True)


class StepLines(TrainerCallback):
    """Rank 0's JSON line per optimizer step: step, world size, learning rate, and the time."""

    def __init__(self, sleep: float) -> None:
        self.sleep = sleep

    def on_step_end(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        time.sleep(self.sleep)
        if state.is_world_process_zero:
            scheduler = kwargs["lr_scheduler"]
            line = {
                "event": "step",
                "step": state.global_step,
                "epoch": round(state.epoch or 0.0, 4),
                "lr": scheduler.get_last_lr()[0],
                "world_size": args.world_size,
                "accumulation": args.gradient_accumulation_steps,
                "pid": os.getpid(),
                "t": time.time(),
            }
            print(json.dumps(line), flush=True)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--dataset-size", type=int, default=1920)
    p.add_argument("--global-batch", type=int, default=48, help="sentences per optimizer step, all ranks together")
    p.add_argument("--micro-batch", type=int, default=8, help="sentences per forward/backward on one rank")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--save-steps", type=int, default=20)
    p.add_argument("--output-dir", default="trainer-output")
    p.add_argument("--sleep", type=float, default=0.0, help="extra seconds per step (tests: time to act mid-run)")
    p.add_argument("--record-ids", default=None, help="append the sentence ids each rank trains on (tests)")
    p.add_argument("--save-weights", default=None, help="rank 0 writes the final weights here (torch.save)")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    tokenizer = build_tokenizer()
    model = build_model(len(tokenizer), args.seed)
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = args.dropout
    # BERT's classification loss is a per-batch mean that ignores Trainer's num_items_in_batch, though its forward
    # takes **kwargs: say so, and Trainer divides it by the accumulation (else the gradient grows with the
    # accumulation and the world size)
    model.accepts_loss_kwargs = False
    training = TrainingArguments(
        output_dir=args.output_dir,
        num_train_epochs=args.epochs,
        per_device_train_batch_size=args.micro_batch,
        learning_rate=args.lr,
        lr_scheduler_type="linear",
        warmup_steps=5,
        save_strategy="steps",
        save_steps=args.save_steps,
        logging_steps=10,
        seed=args.seed,
        report_to=[],
        remove_unused_columns=False,
        use_cpu=not torch.cuda.is_available(),
        disable_tqdm=True,
        ddp_find_unused_parameters=False,  # every parameter trains: no extra autograd pass (and no DDP warning)
    )
    collate = Collate()
    callbacks: list[TrainerCallback] = [StepLines(args.sleep)]
    if args.record_ids:
        callbacks.append(RecordIds(collate, args.record_ids))
    trainer = Trainer(
        model=model,
        args=training,
        train_dataset=Sentences(Reviews(args.dataset_size, tokenizer, args.seed)),
        data_collator=collate,
        callbacks=callbacks,
        global_batch_size=args.global_batch,
    )
    trainer.train()
    if trainer.is_world_process_zero():
        if args.save_weights:
            weights = {
                k: v.detach().float().cpu()
                for k, v in trainer.accelerator.unwrap_model(trainer.model).state_dict().items()
            }
            torch.save(weights, args.save_weights)
        done = {"event": "done", "step": trainer.state.global_step, "t": time.time(), "pid": os.getpid()}
        print(json.dumps(done), flush=True)


if __name__ == "__main__":
    main()
