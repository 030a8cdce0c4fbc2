"""Real gloo process groups inside one test process: every rank a thread, over one ``HashStore``."""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

JOIN_TIMEOUT_S = 30.0


def gloo_group(size: int, timeout: timedelta = timedelta(seconds=30)) -> list[Any]:
    """``size`` ranks of one gloo group, by rank (``timeout``: the group's default for its operations)."""
    store = dist.HashStore()
    groups: list[Any] = [None] * size

    def make(rank: int) -> None:
        groups[rank] = dist.ProcessGroupGloo(store, rank, size, timeout)

    threads = [threading.Thread(target=make, args=(rank,)) for rank in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=JOIN_TIMEOUT_S)
    assert all(g is not None for g in groups), "a rank did not join its gloo group"
    return groups


def on_every_rank(work: Callable[[int], Any], size: int, ranks: tuple[int, ...] | None = None) -> list[Any]:
    """``work(rank)`` on ``size`` ranks at once (or only on ``ranks``), a thread each; each outcome: its result or the
    exception it raised (None for a rank left out)."""
    outcomes: list[Any] = [None] * size

    def run(rank: int) -> None:
        try:
            outcomes[rank] = work(rank)
        except Exception as exc:
            outcomes[rank] = exc

    threads = [threading.Thread(target=run, args=(rank,)) for rank in (range(size) if ranks is None else ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=JOIN_TIMEOUT_S)
    assert not any(t.is_alive() for t in threads), "a rank's work did not return"
    return outcomes
