"""The data position of an elastic run, and the per-rank index lists that follow from it (DESIGN.md §2, "Exactly once").

The order of an epoch is a permutation of ``range(dataset_len)`` seeded from ``(seed, epoch)`` alone, so every world
size sees the same order. The position (:class:`DataPosition`) counts the global samples consumed in the epoch; one
optimizer step consumes ``order[position : position + global_batch_size]``. Rank ``r`` takes the contiguous share
``[r * per_rank, (r + 1) * per_rank)`` of that global batch, cut into ``accumulation`` micro-batches. Because only the
position is saved, and the global batch is constant, a restart at any world size continues with the very next sample:
nothing of the epoch is skipped or seen twice.

The last step of an epoch may hold fewer than ``global_batch_size`` samples. It keeps its shape (every rank gets
``accumulation`` micro-batches of ``micro_batch_size``) and deals the real samples out evenly: with ``slots = world *
accumulation``, each micro-batch gets ``tail // slots`` of them and the remainder goes one each to micro-batch 0 of
ranks 0, 1, ..., then micro-batch 1 of each rank, and so on, so ranks differ by at most one real sample. Each
micro-batch takes a contiguous run of the order, rank-major as in a full step (a full step is the same rule with
``micro_batch_size`` per micro-batch); real samples come first, and the rest is padding, marked invalid in
:attr:`MicroBatch.valid` and pointing at the step's first sample so the dataset is never asked for an index out of
range. A rank may get no real sample at all (tail < world): losses should be summed over valid entries and divided
by :attr:`StepSlice.valid_samples`, never averaged per micro-batch.
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from elasticd.worker.batching import BatchPlan


@dataclass(frozen=True, slots=True)
class DataPosition:
    """Where the run stands: ``position`` global samples of epoch ``epoch`` are consumed."""

    epoch: int = 0
    position: int = 0

    def __post_init__(self) -> None:
        for name, value in (("epoch", self.epoch), ("position", self.position)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"data position: {name} must be a non-negative integer, got {value!r}")

    def to_dict(self) -> dict[str, int]:
        """The form stored in the checkpoint manifest (DESIGN.md §3: epoch, samples consumed in the epoch)."""
        return {"epoch": self.epoch, "samples_in_epoch": self.position}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DataPosition:
        """Reads :meth:`to_dict`'s form back; raises ValueError naming a missing or bad field."""
        missing = [key for key in ("epoch", "samples_in_epoch") if key not in data]
        if missing:
            raise ValueError(f"data position: missing {', '.join(missing)} in the manifest")
        return cls(epoch=data["epoch"], position=data["samples_in_epoch"])


@dataclass(frozen=True, slots=True)
class MicroBatch:
    """Dataset indices of one micro-batch; ``valid[i]`` is False where ``indices[i]`` is tail padding."""

    indices: tuple[int, ...]
    valid: tuple[bool, ...]


@dataclass(frozen=True, slots=True)
class StepSlice:
    """This rank's share of one optimizer step that starts at ``(epoch, position)``.

    ``valid_samples`` is the step's count of real samples over all ranks (``global_batch_size`` except on a tail).
    """

    epoch: int
    position: int
    micro_batches: tuple[MicroBatch, ...]
    valid_samples: int
    last_in_epoch: bool

    def next_position(self) -> DataPosition:
        """The position after this step; the start of the next epoch when this step ends its epoch."""
        if self.last_in_epoch:
            return DataPosition(self.epoch + 1, 0)
        return DataPosition(self.epoch, self.position + self.valid_samples)


class ElasticSampler:
    """The index lists of rank ``rank`` under ``plan``, from any saved :class:`DataPosition`."""

    def __init__(
        self,
        dataset_len: int,
        plan: BatchPlan,
        rank: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        if dataset_len < 1:
            raise ValueError(f"the dataset is empty (dataset_len={dataset_len})")
        if not 0 <= rank < plan.world_size:
            raise ValueError(f"rank {rank} is outside the world of {plan.world_size}")
        self.dataset_len = dataset_len
        self.plan = plan
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        # One epoch's order at a time: a run walks epochs in sequence, and an order costs 8 bytes per sample.
        self._cached: tuple[int, torch.Tensor] | None = None

    def order(self, epoch: int) -> torch.Tensor:
        """The sample order of ``epoch`` (int64, a permutation of ``range(dataset_len)``); independent of the world."""
        if self._cached is not None and self._cached[0] == epoch:
            return self._cached[1]
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(_epoch_seed(self.seed, epoch))
            order = torch.randperm(self.dataset_len, generator=generator)
        else:
            order = torch.arange(self.dataset_len)
        self._cached = (epoch, order)
        return order

    def steps_per_epoch(self) -> int:
        """Optimizer steps in an epoch that starts at position 0."""
        full, tail = divmod(self.dataset_len, self.plan.global_batch_size)
        return full if self.drop_last or not tail else full + 1

    def steps(
        self,
        start: DataPosition,
        epochs: int,
        skip_positions: frozenset[tuple[int, int]] = frozenset(),
        on_skip: Callable[[StepSlice], None] | None = None,
    ) -> Iterator[StepSlice]:
        """The steps from ``start`` until epoch ``epochs`` begins (``epochs`` counts from epoch 0, as in a resume).

        A step whose start ``(epoch, position)`` is in ``skip_positions`` is consumed but not yielded; ``on_skip``
        receives it, so the caller can report the samples it steps over. Raises ValueError at once when ``start``
        lies past the end of the dataset (the dataset shrank since the checkpoint).
        """
        if start.position > self.dataset_len:
            raise ValueError(
                f"data position {start.position} of epoch {start.epoch} is past the end of the dataset"
                f" ({self.dataset_len} samples); was the checkpoint taken with another dataset?"
            )
        return self._steps(start, epochs, skip_positions, on_skip)

    def _steps(
        self,
        start: DataPosition,
        epochs: int,
        skip_positions: frozenset[tuple[int, int]],
        on_skip: Callable[[StepSlice], None] | None,
    ) -> Iterator[StepSlice]:
        epoch, position = start.epoch, start.position
        while epoch < epochs:
            if not self._has_step(position):
                epoch, position = epoch + 1, 0
                continue
            step = self._step(epoch, position)
            if (epoch, position) not in skip_positions:
                yield step
            elif on_skip is not None:
                on_skip(step)
            after = step.next_position()
            epoch, position = after.epoch, after.position

    def _has_step(self, position: int) -> bool:
        left = self.dataset_len - position
        return left >= self.plan.global_batch_size if self.drop_last else left > 0

    def _step(self, epoch: int, position: int) -> StepSlice:
        plan = self.plan
        order = self.order(epoch)
        world, accumulation = plan.world_size, plan.accumulation
        taken = min(plan.global_batch_size, self.dataset_len - position)
        share, extra = divmod(taken, world * accumulation)
        # Micro-batch k of rank r holds share real samples, plus one of the extra ones dealt k-major (k * world + r)
        # so that ranks differ by at most one; runs are laid out rank-major, so a full step is the plain formula.
        counts = [share + (k * world + self.rank < extra) for k in range(accumulation)]
        # Real samples of the ranks before this one: their shares plus the extras dealt to them.
        before = self.rank * accumulation * share + sum(
            min(self.rank, max(0, extra - k * world)) for k in range(accumulation)
        )
        mine: list[int] = order[position + before : position + before + sum(counts)].tolist()
        pad = int(order[position])  # a real index, so padded entries load like any other sample
        micro_batches = []
        used = 0
        for count in counts:
            missing = plan.micro_batch_size - count
            micro_batches.append(
                MicroBatch(
                    indices=(*mine[used : used + count], *([pad] * missing)),
                    valid=(*([True] * count), *([False] * missing)),
                )
            )
            used += count
        return StepSlice(
            epoch=epoch,
            position=position,
            micro_batches=tuple(micro_batches),
            valid_samples=taken,
            last_in_epoch=not self._has_step(position + taken),
        )


def micro_batch_loader(
    dataset: Dataset[Any],
    micro_batches: Iterable[MicroBatch],
    collate_fn: Callable[[list[Any]], Any] | None = None,
    num_workers: int = 0,
) -> Iterator[Any]:
    """Loads each micro-batch from the map-style ``dataset``, in order, with its mask as a bool tensor.

    The loading is torch's ``DataLoader`` with ``micro_batches`` as its batch sampler (read lazily) and ``collate_fn``
    (default: torch's ``default_collate``). A mapping batch gets the mask under ``"valid"`` (replacing any such key);
    any other batch is returned as ``(batch, valid)``.
    """
    masks: deque[torch.Tensor] = deque()

    def index_lists() -> Iterator[list[int]]:
        # The DataLoader draws index lists ahead of the batches it returns (prefetch); the queue keeps masks in step.
        for micro in micro_batches:
            masks.append(torch.tensor(micro.valid, dtype=torch.bool))
            yield list(micro.indices)

    loader = DataLoader(dataset, batch_sampler=index_lists(), collate_fn=collate_fn, num_workers=num_workers)
    for batch in loader:
        valid = masks.popleft()
        if isinstance(batch, MutableMapping):
            batch["valid"] = valid  # in place keeps the collated type (e.g. a tokenizer's BatchEncoding)
            yield batch
        elif isinstance(batch, Mapping):
            yield {**batch, "valid": valid}
        else:
            yield batch, valid


def _epoch_seed(seed: int, epoch: int) -> int:
    # A hash rather than seed + epoch, whose runs would collide (seed 0 epoch 1 == seed 1 epoch 0); 63 bits for torch.
    digest = hashlib.sha256(f"elasticd:{seed}:{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)
