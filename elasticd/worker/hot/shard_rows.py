"""Which rows of a sharded tensor each rank holds, and what a change of world size must move between ranks.

FSDP2 shards every parameter (and AdamW's moments with it) on dim 0 the way ``torch.chunk`` does: with ``n`` rows
over ``W`` ranks, each shard has ``ceil(n / W)`` rows and the last ones may be short or empty (``_chunk_with_empty``
in torch's ``_fully_shard/_fsdp_common.py``; a DTensor's ``Shard(0)`` splits alike). A change of world size keeps
every row where it is wanted and moves only the overlap of an old shard with another rank's new one: a pure function
of the shapes, the two world sizes and who holds each old shard, computed alike on every rank, so no plan is sent.

A shard's *holder* is the new rank that has it in memory: its owner when the owner survives, the rank that keeps
its mirror (``mirror.py``) when it does not, or nobody (then the state must come from a checkpoint).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Rows:
    start: int
    stop: int  # exclusive

    @property
    def count(self) -> int:
        return max(0, self.stop - self.start)

    def overlap(self, other: Rows) -> Rows:
        return Rows(max(self.start, other.start), max(max(self.start, other.start), min(self.stop, other.stop)))


def shard_rows(n: int, world: int, rank: int) -> Rows:
    """The rows of an ``n``-row tensor that ``rank`` of ``world`` holds (``torch.chunk`` on dim 0)."""
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in a world of {world}")
    per = -(-n // world) if n else 0
    start = min(n, rank * per)
    return Rows(start, min(n, start + per))


@dataclass(frozen=True, slots=True)
class Move:
    """Rows ``rows`` of tensor ``name``: from the holder of old shard ``old_shard`` (new rank ``src``) to new rank
    ``dst``. ``src == dst`` is a copy inside one rank."""

    name: str
    old_shard: int
    src: int
    dst: int
    rows: Rows


class MissingShard(Exception):
    """An old shard that some new rank needs is held by nobody: the state must come from a checkpoint."""


def plan(
    rows_of: Mapping[str, int],
    old_world: int,
    new_world: int,
    holders: Sequence[int | None],
) -> list[Move]:
    """Every move that gives each of ``new_world`` ranks its new shard of every tensor in ``rows_of`` (name -> number
    of rows), from old shards ``0..old_world-1`` held by ``holders[j]`` (a new rank, or None). Ordered by name, then
    destination, then old shard: every rank packs and unpacks in this order."""
    if len(holders) != old_world:
        raise ValueError(f"{len(holders)} holders for {old_world} old shards")
    moves: list[Move] = []
    for name in sorted(rows_of):
        n = rows_of[name]
        for dst in range(new_world):
            wanted = shard_rows(n, new_world, dst)
            for j in range(old_world):
                part = wanted.overlap(shard_rows(n, old_world, j))
                if part.count == 0:
                    continue
                src = holders[j]
                if src is None:
                    raise MissingShard(f"rows {part.start}-{part.stop} of {name} (old shard {j}) are held by no rank")
                moves.append(Move(name, j, src, dst, part))
    return moves


def bytes_between(moves: Sequence[Move], row_bytes: Mapping[str, int]) -> dict[tuple[int, int], int]:
    """Bytes each (source, destination) pair of different ranks sends: the sizes of the flat buffers exchanged."""
    sizes: dict[tuple[int, int], int] = {}
    for m in moves:
        if m.src != m.dst:
            sizes[(m.src, m.dst)] = sizes.get((m.src, m.dst), 0) + m.rows.count * row_bytes[m.name]
    return sizes
