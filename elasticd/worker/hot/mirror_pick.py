"""Which step a sharded group can go back to from memory after a loss, and which survivor holds each old shard.

Every survivor reports what it holds (:class:`Holdings`): its own generations and the mirror it keeps. The group
goes back to the newest step at which every old shard is whole in one survivor's memory: the survivor's own copy,
or the mirror of a lost rank. Only generations of the epoch being left count: a mirror from before an earlier
re-formation has another world's shard layout (a stale mirror), and one received in part was never kept
(``mirror.py``). No such step: None, and the group loads its newest committed checkpoint instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Holdings:
    new_rank: int
    old_rank: int
    own: tuple[tuple[int, str], ...]  # (step, epoch) of this rank's own generations
    mirror: tuple[int, int, str] | None  # (owner's old rank, step, epoch) of the mirror it keeps, if any


def pick(held: Sequence[Holdings], old_world: int, epoch: str) -> tuple[int, list[int | None]] | None:
    """(the step to go back to, the new rank holding each old shard at that step), or None."""
    steps = {s for h in held for s, e in h.own if e == epoch}
    for step in sorted(steps, reverse=True):
        holders: list[int | None] = [None] * old_world
        for h in held:
            if (step, epoch) in h.own:
                holders[h.old_rank] = h.new_rank
        for h in held:
            if h.mirror is not None and h.mirror[1:] == (step, epoch) and holders[h.mirror[0]] is None:
                holders[h.mirror[0]] = h.new_rank
        if all(r is not None for r in holders):
            return step, holders
    return None
