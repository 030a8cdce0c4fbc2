"""Each rank's new shards at a new world size, assembled from the old shards the ranks hold in memory.

The moves come from :func:`~elasticd.worker.hot.shard_rows.plan`, computed alike on every rank. Between two ranks
everything one sends the other travels as one flat byte buffer (gloo sends one message per call, so a tensor per
call would pay its latency hundreds of times); both sides know its size from the plan. All receives and sends are
posted before any is waited on, so no order of ranks can deadlock.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from elasticd.worker.hot.remesh import ShardLayout
from elasticd.worker.hot.shard_rows import Move, bytes_between, plan, shard_rows

# Old shards a rank holds: key -> old shard index -> that shard's rows (its own, or a mirror of a lost rank's).
Held = Mapping[str, Mapping[int, torch.Tensor]]


def _piece(held: Held, m: Move, layout: ShardLayout, old_world: int) -> torch.Tensor:
    first = shard_rows(layout.shapes[m.name][0], old_world, m.old_shard).start
    return held[m.name][m.old_shard][m.rows.start - first : m.rows.stop - first]


def exchange(
    held: Held,
    layout: ShardLayout,
    old_world: int,
    holders: list[int | None],
    me: int,
    new_world: int,
    group: Any = None,
    wait: Callable[[Any, str], None] = lambda work, _what: work.wait(),
) -> tuple[dict[str, torch.Tensor], int]:
    """This rank's (``me`` of ``new_world``) new rows of every key of ``layout``, and the bytes it received.

    ``holders[j]``: the new rank holding old shard ``j`` (None: nobody; raises ``MissingShard`` when it is needed).
    ``group``: the new world's group (default: torch's default group); ranks are its group ranks. ``wait(work,
    what)`` waits for one send or receive (the heal's: one it can give up, ``link.py``)."""
    moves = plan(layout.rows(), old_world, new_world, holders)
    sizes = bytes_between(moves, layout.row_bytes())
    inbound = {src: torch.empty(n, dtype=torch.uint8) for (src, dst), n in sizes.items() if dst == me}
    outbound = {}
    for (src, dst), _n in sizes.items():
        if src == me:
            parts = [_piece(held, m, layout, old_world) for m in moves if m.src == me and m.dst == dst]
            outbound[dst] = torch.cat([p.contiguous().reshape(-1).view(torch.uint8) for p in parts])
    works = [dist.irecv(buf, group=group, group_src=src) for src, buf in sorted(inbound.items())]
    works += [dist.isend(buf, group=group, group_dst=dst) for dst, buf in sorted(outbound.items())]
    out = {}
    for key, shape in layout.shapes.items():
        rows = shard_rows(shape[0], new_world, me)
        out[key] = torch.empty((rows.count, *shape[1:]), dtype=layout.dtypes[key])
    for work in works:
        wait(work, "moving shard rows")
    offsets = dict.fromkeys(inbound, 0)
    row_bytes = layout.row_bytes()
    for m in moves:
        if m.dst != me:
            continue
        start = shard_rows(layout.shapes[m.name][0], new_world, me).start
        target = out[m.name][m.rows.start - start : m.rows.stop - start]
        if m.src == me:
            target.copy_(_piece(held, m, layout, old_world))
            continue
        n = m.rows.count * row_bytes[m.name]
        raw = inbound[m.src][offsets[m.src] : offsets[m.src] + n]
        target.reshape(-1).view(torch.uint8).copy_(raw)  # the target's rows are contiguous: a view, any alignment
        offsets[m.src] += n
    return out, sum(b.numel() for b in inbound.values())
