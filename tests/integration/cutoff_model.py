"""One rank's DDP model armed as the hot session arms it: the resilient hook and the backward cutoff
(``test_hot_cutoff.py``, in this process and in ``scripts/cutoff_ranks.py``)."""

from __future__ import annotations

from typing import Any

import torch

from elasticd.worker.hot.comm_hook import GroupHolder, ResilientAllReduce
from elasticd.worker.hot.cutoff import BackwardCutoff
from elasticd.worker.hot.failure import StepHealth

LAYERS = 6


class Accelerator:
    """accelerate's ``backward``, as the cutoff sees it: the loss's own backward pass."""

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        loss.backward(**kwargs)


class Rank:
    """One rank's DDP model with the resilient hook and the cutoff, as the hot session arms them."""

    def __init__(self, group: Any | None = None, notice: str | None = None, **ddp: Any) -> None:
        torch.manual_seed(0)  # the same initial model on every rank
        layers = [torch.nn.Linear(16, 16) for _ in range(LAYERS)]
        self.model = torch.nn.parallel.DistributedDataParallel(
            torch.nn.Sequential(*layers), process_group=group, bucket_cap_mb=0.001, **ddp
        )
        self.health = StepHealth()
        self.hook = ResilientAllReduce(GroupHolder(group), self.health)
        self.hook.register(self.model)
        self.notice = notice
        self.aborted: list[str] = []
        self.accelerator = Accelerator()
        self.cutoff = BackwardCutoff(self.health, lambda: self.notice, self.abort)
        self.cutoff.install(self.accelerator, self.model)

    def abort(self, reason: str) -> None:
        self.aborted.append(reason)
        self.hook.abort(reason)

    def step(self, seed: int) -> int:
        """One forward and backward pass through the accelerator; how many parameters got a gradient."""
        self.model.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        self.accelerator.backward(self.model(torch.randn(4, 16)).square().mean())
        return sum(1 for p in self.model.parameters() if p.grad is not None)

    def gradients(self) -> torch.Tensor:
        return torch.cat([p.grad.flatten() for p in self.model.parameters() if p.grad is not None])
