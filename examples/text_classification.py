"""A transformers text classifier under elasticd: the accelerate tutorial's workload, small enough for a CPU.

    pip install 'elasticd[examples]'                       # transformers
    elasticd start --nproc-per-node 2 examples/text_classification.py
    python examples/text_classification.py                 # plain: the library acts locally

A BERT-style sequence classifier built from a small config (no download), a word-level tokenizer and a labelled
corpus built here from fixed word lists (offline and reproducible: a sentence's words and label derive from its id),
trained with mixed precision as accelerate's config file says (``accelerate config``; bf16 on a CPU). Written
against the worker library exactly like ``examples/train.py``: resume, the same global batch and LR schedule at
any world size, every sentence of an epoch exactly once, ``save_state`` checkpoints (the model as safetensors).
At the end every rank gives its part of the weights and rank 0 scores held-out sentences alone with them, and can
write the model with ``save_pretrained``.

Sharded, as a model too big for one card would be: the same script with an FSDP2 config (``examples/fsdp2.yaml``,
each ``BertLayer`` its own shard unit, bf16); checkpoints are then DCP shards, one set per rank, resharded on load.

    elasticd start --nproc-per-node 2 --accelerate-config examples/fsdp2.yaml examples/text_classification.py
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import torch
import transformers
from accelerate import Accelerator
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from torch.utils.data import Dataset
from transformers import BertConfig, BertForSequenceClassification, PreTrainedTokenizerFast

import elasticd

transformers.utils.logging.disable_progress_bar()  # save_pretrained's bar: a log line per shard, not a TTY widget

POSITIVE = ["great", "good", "excellent", "fun", "wonderful", "brilliant", "enjoyable", "superb", "moving", "sharp"]
NEGATIVE = ["bad", "awful", "boring", "terrible", "dull", "poor", "weak", "dreadful", "messy", "flat"]
NEUTRAL = ["the", "movie", "film", "plot", "acting", "was", "is", "very", "quite", "a", "story", "and", "but", "its"]
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
MAX_LENGTH = 24
# (hidden size, layers, attention heads, feed-forward size): tiny trains in seconds on a CPU; base is BERT-base's
# geometry (~86M parameters with this vocabulary), for checkpoint sizes and times like a real fine-tune's
SIZES = {"tiny": (64, 2, 4, 128), "base": (768, 12, 12, 3072)}


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the corpus' words, as ``transformers`` tokenizers are used (no download)."""
    vocab = {word: i for i, word in enumerate(SPECIAL + NEUTRAL + POSITIVE + NEGATIVE)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]"
    )


class Reviews(Dataset[dict[str, torch.Tensor]]):
    """Short reviews whose label is 1 when they hold more positive words than negative ones."""

    def __init__(self, size: int, tokenizer: PreTrainedTokenizerFast, seed: int = 0) -> None:
        self.size, self.tokenizer, self.seed = size, tokenizer, seed

    def __len__(self) -> int:
        return self.size

    def sentence(self, i: int) -> tuple[str, int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        label = int(torch.randint(2, (), generator=g))
        strong, weak = (POSITIVE, NEGATIVE) if label else (NEGATIVE, POSITIVE)
        n_strong = int(torch.randint(1, 4, (), generator=g))
        n_weak = int(torch.randint(0, n_strong, (), generator=g))
        words = [
            NEUTRAL[int(j)]
            for j in torch.randint(len(NEUTRAL), (int(torch.randint(4, 12, (), generator=g)),), generator=g)
        ]
        words += [strong[int(j)] for j in torch.randint(len(strong), (n_strong,), generator=g)]
        words += [weak[int(j)] for j in torch.randint(len(weak), (n_weak,), generator=g)]
        order = torch.randperm(len(words), generator=g).tolist()
        return " ".join(words[j] for j in order), label

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        text, label = self.sentence(i)
        encoded = self.tokenizer(
            text, padding="max_length", max_length=MAX_LENGTH, truncation=True, return_tensors="pt"
        )
        return {
            "input_ids": encoded["input_ids"][0],
            "attention_mask": encoded["attention_mask"][0],
            "labels": torch.tensor(label),
            "id": torch.tensor(i),
        }


def build_model(vocab_size: int, seed: int, size: str = "tiny") -> BertForSequenceClassification:
    torch.manual_seed(seed)
    hidden, layers, heads, feed_forward = SIZES[size]
    config = BertConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=feed_forward,
        max_position_embeddings=MAX_LENGTH,
    )
    config.num_labels = 2  # a setter of transformers' PretrainedConfig (its type stubs do not name the keyword)
    return BertForSequenceClassification(config)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--dataset-size", type=int, default=1920)
    p.add_argument("--global-batch", type=int, default=48, help="sentences per optimizer step, all ranks together")
    p.add_argument("--micro-batch", type=int, default=8, help="sentences per forward/backward on one rank")
    p.add_argument("--model-size", choices=sorted(SIZES), default="tiny")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sleep", type=float, default=0.0, help="extra seconds per step (tests: time to act mid-run)")
    p.add_argument("--eval-size", type=int, default=256, help="held-out sentences rank 0 scores at the end")
    p.add_argument("--save-pretrained", default=None, help="write the trained model here (save_pretrained)")
    p.add_argument("--record-ids", default=None, help="append the sentence ids each rank trains on (tests)")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    # mixed precision, dynamo and the rest come from accelerate's config file (elasticd passes it on)
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    run = elasticd.attach(accelerator)
    tokenizer = build_tokenizer()
    dataset = Reviews(args.dataset_size, tokenizer, args.seed)
    loader = run.dataloader(dataset, global_batch_size=args.global_batch, micro_batch_size=args.micro_batch, seed=0)
    model = build_model(len(tokenizer), args.seed, args.model_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1.0 + 0.01 * s))
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    run.resume(model, optimizer, scheduler)
    if accelerator.is_main_process:
        started = {
            "event": "start",
            "mixed_precision": accelerator.mixed_precision,
            "device": str(accelerator.device),
            "step": run.state.step,
        }
        print(json.dumps({**started, "world_size": accelerator.num_processes, "pid": os.getpid()}), flush=True)

    record = open(args.record_ids, "a") if args.record_ids else None  # noqa: SIM115
    for batch in run.batches(loader, epochs=args.epochs):
        if record is not None:  # as examples/train.py: per attempt of a step (a step failed in place is tried again)
            attempt = {"round": run.settings.round, "rollbacks": run.state.rollbacks, "epoch": run.epoch}
            ids = batch["id"][batch["valid"]].tolist()
            line = {"step": run.state.step + 1, **attempt, "rank": run.rank, "ids": ids}
            print(json.dumps(line), file=record, flush=True)  # a rank killed later still counts
        with accelerator.accumulate(model), accelerator.autocast():
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            losses = torch.nn.functional.cross_entropy(logits.float(), batch["labels"], reduction="none")
            valid = batch["valid"].float()  # the epoch's last step is padded: padding does not count
            loss = (losses * valid).sum() / valid.sum().clamp(min=1)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
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
    weights = accelerator.get_state_dict(model)  # on every rank: under FSDP it gathers the shards
    if accelerator.is_main_process:
        trained = build_model(len(tokenizer), args.seed, args.model_size)
        trained.load_state_dict(weights)
        accuracy = evaluate(trained, Reviews(args.eval_size, tokenizer, seed=args.seed + 1), accelerator.device)
        if args.save_pretrained:
            trained.save_pretrained(args.save_pretrained)
            tokenizer.save_pretrained(args.save_pretrained)
        done = {"event": "done", "step": run.state.step, "accuracy": round(accuracy, 4), "t": time.time()}
        print(json.dumps({**done, "pid": os.getpid()}), flush=True)
    accelerator.end_training()


@torch.no_grad()
def evaluate(model: Any, dataset: Reviews, device: torch.device) -> float:
    """Accuracy on held-out sentences, on this process alone."""
    model.eval()
    batch = [dataset[i] for i in range(len(dataset))]
    inputs = {k: torch.stack([b[k] for b in batch]).to(device) for k in ("input_ids", "attention_mask")}
    predicted = model(**inputs).logits.argmax(dim=-1).cpu()
    return float((predicted == torch.stack([b["labels"] for b in batch])).float().mean())


if __name__ == "__main__":
    main()
