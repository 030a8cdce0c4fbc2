"""Shard mirrors: each rank's shards of a sharded job, copied every K steps into another node's host memory.

With FSDP every rank holds only its slice of the parameters and optimizer state, so a lost node takes its slices
with it. Here, at every K-th optimizer-step boundary, each rank copies its shards (and the caller's ``meta``: the
run's position, the optimizer's unsharded state) into a host buffer of its own (the blocking part, a memory copy),
and a thread sends that buffer to its ring peer on the next node while training goes on, receiving the previous
node's at the same time (the idea of keeping checkpoints in peers' host memory: Gemini, SOSP'23).

Ring: rank ``r`` sends to ``(r + nproc_per_node) % world`` and receives from ``(r - nproc_per_node) % world``, so a
mirror is never on its owner's node; a world of one node keeps no mirror.

Memory, per rank, in shard sizes: its own copies of the last two generations (a generation whose sending the
owner's death interrupted leaves the one before complete everywhere) and its peer's mirror, one complete generation
plus the one being received. Buffers are reused between generations.

Guards: a mirror is used only when received whole (its announced size, to the byte) and of the epoch this rank
trains in (a mirror from a stale epoch, sent before a re-formation, is refused); an interrupted receive leaves the
previous complete mirror in place.
"""

from __future__ import annotations

import pickle
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

# How often a generation still in flight is looked at while the next one waits for it (seconds).
_WAIT_POLL_S = 0.01


@dataclass(slots=True)
class Generation:
    """One rank's shards at one step: a flat byte buffer and where each key's rows are in it."""

    step: int
    epoch: str
    owner: int  # the rank (of the epoch's world) whose shards these are
    offsets: dict[str, tuple[int, int, tuple[int, ...], torch.dtype]]  # key -> (offset, bytes, local shape, dtype)
    meta: dict[str, Any]
    data: torch.Tensor  # uint8

    def tensor(self, key: str) -> torch.Tensor:
        offset, n, shape, dtype = self.offsets[key]
        out = torch.empty(shape, dtype=dtype)
        out.reshape(-1).view(torch.uint8).copy_(self.data[offset : offset + n])
        return out


@dataclass(slots=True)
class MirrorStats:
    blocking_s: float = 0.0  # the steps' time in offer(): waiting for the previous generation, copying
    total_s: float = 0.0  # offer() to the exchange's end, summed over generations
    bytes_sent: int = 0
    generations: int = 0
    refused: list[str] = field(default_factory=list)  # why received mirrors were not kept


def peers(rank: int, world: int, nproc_per_node: int) -> tuple[int, int] | None:
    """(the rank this one sends to, the rank it receives from), or None in a world of one node."""
    if world <= nproc_per_node:
        return None
    return (rank + nproc_per_node) % world, (rank - nproc_per_node) % world


def _pack(tensors: Mapping[str, torch.Tensor], into: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, Any]]:
    offsets: dict[str, tuple[int, int, tuple[int, ...], torch.dtype]] = {}
    total = 0
    for key in sorted(tensors):
        t = tensors[key]
        n = t.numel() * t.element_size()
        offsets[key] = (total, n, tuple(t.shape), t.dtype)
        total += n
    data = into if into is not None and into.numel() == total else torch.empty(total, dtype=torch.uint8)
    for key, (offset, n, _, _) in offsets.items():
        data[offset : offset + n].copy_(tensors[key].contiguous().reshape(-1).view(torch.uint8))
    return data, offsets


class ShardMirror:
    """One rank's side of the ring (see the module's docstring). ``group``: a gloo group of the whole world, for the
    mirrors alone (its traffic never interleaves with training's collectives)."""

    def __init__(self, group: Any, *, rank: int, world: int, nproc_per_node: int, epoch: str) -> None:
        ring = peers(rank, world, nproc_per_node)
        if ring is None:
            raise ValueError("a world of one node has no other node to mirror to")
        self.group, self.rank, self.world, self.epoch = group, rank, world, epoch
        self.to, self.source = ring
        self.own: list[Generation] = []  # newest last, at most two
        self.held: Generation | None = None  # the peer's newest complete generation
        self.stats = MirrorStats()
        self._thread: threading.Thread | None = None
        self._spare: torch.Tensor | None = None  # the receive buffer of the next generation
        self.failed: str | None = None  # the exchange broke (a peer lost): no further generations in this epoch
        self._frozen = False  # a heal reads what is held: a generation that ends later is not kept

    def offer(
        self,
        step: int,
        tensors: Mapping[str, torch.Tensor],
        meta: dict[str, Any],
        abandon: Callable[[], bool] = lambda: False,
    ) -> bool:
        """Mirror this rank's shards at ``step`` (every rank of the world calls it at the same steps). Blocks while
        the previous generation is still in flight and while the shards are copied; False (nothing mirrored) once
        the ring broke or ``abandon()`` says the step failed meanwhile."""
        began = time.monotonic()
        if not self._wait(abandon):
            return False
        reuse = self.own.pop(0).data if len(self.own) == 2 else None
        data, offsets = _pack(tensors, reuse)
        mine = Generation(step, self.epoch, self.rank, offsets, dict(meta), data)
        self.own.append(mine)
        self.stats.blocking_s += time.monotonic() - began
        self._thread = threading.Thread(target=self._exchange, args=(mine, began), name="shard-mirror", daemon=True)
        self._thread.start()
        return True

    def _wait(self, abandon: Callable[[], bool]) -> bool:
        thread = self._thread
        while thread is not None and thread.is_alive():
            if abandon():
                return False
            thread.join(_WAIT_POLL_S)
        return self.failed is None

    def settle(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the generation in flight; True when none is (any more)."""
        if self._thread is not None:
            self._thread.join(timeout_s)
        return self._thread is None or not self._thread.is_alive()

    def _exchange(self, mine: Generation, began: float) -> None:
        try:
            header = pickle.dumps((mine.step, mine.epoch, mine.owner, mine.offsets, mine.meta))
            sizes = torch.tensor([len(header), mine.data.numel()], dtype=torch.int64)
            theirs = torch.empty(2, dtype=torch.int64)
            self._both(sizes, theirs)
            head_in = torch.empty(int(theirs[0]), dtype=torch.uint8)
            n = int(theirs[1])
            spare = self._spare if self._spare is not None and self._spare.numel() == n else None
            data_in = spare if spare is not None else torch.empty(n, dtype=torch.uint8)
            self._both(torch.frombuffer(bytearray(header), dtype=torch.uint8), head_in, mine.data, data_in)
            self.stats.bytes_sent += mine.data.numel() + len(header)
            self._keep(pickle.loads(head_in.numpy().tobytes()), data_in)
            self.stats.generations += 1
        except Exception as exc:  # a peer lost mid-exchange: what was received is partial and never used
            self.failed = f"{type(exc).__name__}: {exc}"
        finally:
            self.stats.total_s += time.monotonic() - began

    def _both(self, *pairs: torch.Tensor) -> None:
        """Send the even-indexed tensors to the ring's next rank while receiving the odd-indexed from its previous."""
        works = []
        for out, into in zip(pairs[0::2], pairs[1::2], strict=True):
            works.append(dist.irecv(into, group=self.group, group_src=self.source))
            works.append(dist.isend(out, group=self.group, group_dst=self.to))
        for work in works:
            work.wait()  # type: ignore[union-attr]  # isend/irecv: never None

    def freeze(self) -> None:
        """Keep what is held as it is from now on (a heal reads it; the ring is retired after)."""
        self._frozen = True

    def _keep(self, header: tuple[Any, ...], data: torch.Tensor) -> None:
        step, epoch, owner, offsets, meta = header
        if self._frozen:
            return
        announced = sum(n for _, n, _, _ in offsets.values())
        if epoch != self.epoch:
            self.stats.refused.append(f"step {step} from epoch {epoch}, this rank trains in {self.epoch}")
            self._spare = data
        elif announced != data.numel() or owner != self.source:
            self.stats.refused.append(f"step {step}: {data.numel()} bytes for {announced} announced, owner {owner}")
            self._spare = data
        else:
            self._spare = None if self.held is None else self.held.data
            self.held = Generation(step, epoch, owner, offsets, meta, data)

    def own_at(self, step: int) -> Generation | None:
        return next((g for g in self.own if g.step == step), None)
