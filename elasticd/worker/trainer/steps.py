"""The training data of a ``transformers.Trainer`` run, cut so that every world size trains the same micro-batches.

Step ``k`` of an epoch trains the ``k``-th run of ``global_batch`` samples of that epoch's shuffle (seeded by the
run's seed and the epoch, never by the world size). The run is cut into ``global_batch / micro_batch`` micro-batches
of consecutive samples; micro-batch ``m`` goes to rank ``m % W`` as the ``m // W``-th of its accumulation. So the
samples of a step, and how they are grouped into micro-batches, are the same at every world size: only who computes
which micro-batch changes. Trainer's own arithmetic then stays right after a resize: it resumes at ``global_step``
by skipping ``k * accumulation`` of this rank's micro-batches, which are exactly its share of the first ``k`` steps
at the new size (:meth:`StepBatches.skipping`).

An epoch trains ``len(dataset) // global_batch`` steps; the samples of a last, partial global batch are not trained
(said at start, ``trainer_batches``): a partial step would be split differently at each world size.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.utils.data import DataLoader, Sampler


@dataclass(slots=True)
class StepBatches(Sampler[list[int]]):
    """This rank's micro-batches (lists of dataset indices), epoch by epoch (a DataLoader's ``batch_sampler``).
    Only :meth:`set_epoch` changes one; a resume within an epoch is a copy (:meth:`skipping`)."""

    size: int  # samples in the dataset
    global_batch: int
    micro_batch: int
    rank: int
    world_size: int
    seed: int = 0
    shuffle: bool = True
    epoch: int = 0
    skip: int = 0  # this rank's micro-batches of the epoch not yielded (a resume within the epoch)

    def __post_init__(self) -> None:
        per_step = self.global_batch // self.micro_batch
        if self.global_batch % self.micro_batch or per_step % self.world_size:
            raise ValueError(
                f"a global batch of {self.global_batch} does not split into micro-batches of {self.micro_batch}"
                f" over {self.world_size} ranks"
            )

    @property
    def accumulation(self) -> int:
        """Micro-batches per optimizer step on each rank."""
        return self.global_batch // (self.micro_batch * self.world_size)

    @property
    def steps_per_epoch(self) -> int:
        return self.size // self.global_batch

    def __len__(self) -> int:
        return self.steps_per_epoch * self.accumulation - self.skip

    def order(self) -> torch.Tensor:
        """The epoch's shuffle: the same on every rank and at every world size."""
        if not self.shuffle:
            return torch.arange(self.size)
        return torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch))

    def __iter__(self) -> Iterator[list[int]]:
        order = self.order()
        b, w = self.micro_batch, self.world_size
        yielded = 0
        for step in range(self.steps_per_epoch):
            start = step * self.global_batch
            for j in range(self.accumulation):
                m = j * w + self.rank
                if yielded >= self.skip:
                    yield order[start + m * b : start + (m + 1) * b].tolist()
                yielded += 1

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def skipping(self, micro_batches: int) -> StepBatches:
        return replace(self, skip=micro_batches)


class StepLoader(DataLoader[Any]):
    """A DataLoader over :class:`StepBatches`: Trainer moves it to an epoch (``set_epoch``, as it does accelerate's
    loaders) and resumes within one (:meth:`skipping`: a new loader, the one in use is never changed)."""

    def __init__(self, dataset: Any, batches: StepBatches, **kwargs: Any) -> None:
        super().__init__(dataset, batch_sampler=batches, **kwargs)
        self.batches = batches
        self._kwargs = kwargs

    def set_epoch(self, epoch: int) -> None:
        self.batches.set_epoch(epoch)

    def skipping(self, micro_batches: int) -> StepLoader:
        return StepLoader(self.dataset, self.batches.skipping(micro_batches), **self._kwargs)
