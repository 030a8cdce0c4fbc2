"""What the worker library does to a batch on its way to the script: onto the device, or poisoned (fault injection)."""

from __future__ import annotations

from typing import Any

import torch


def poison(batch: Any) -> Any:
    """Fault injection: every floating tensor of the batch becomes NaN, so the loss is NaN for real."""
    if isinstance(batch, torch.Tensor):
        return batch * float("nan") if batch.is_floating_point() else batch
    if isinstance(batch, dict):
        return {k: poison(v) for k, v in batch.items()}
    if isinstance(batch, list | tuple):
        return type(batch)(poison(v) for v in batch)
    return batch


def has_floating(batch: Any) -> bool:
    """Does ``batch`` hold a floating tensor (what :func:`poison` can make NaN)? Token ids alone do not."""
    if isinstance(batch, torch.Tensor):
        return batch.is_floating_point()
    if isinstance(batch, dict):
        return any(has_floating(v) for v in batch.values())
    if isinstance(batch, list | tuple):
        return any(has_floating(v) for v in batch)
    return False


def to_device(batch: Any, device: Any) -> Any:
    """Every tensor of the batch (nested in dicts, lists and tuples) moved to ``device``, without blocking."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, list | tuple):
        return type(batch)(to_device(v, device) for v in batch)
    return batch
