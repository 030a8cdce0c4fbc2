"""An HSDP job's recovery in place: a lost node is a lost replica (``worker/hybrid.py``).

Each node holds a whole replica, sharded across its workers; the shard a worker holds is its place in its node
(its coordinate: rank modulo the workers per node). After a node is lost every survivor still holds its coordinate's
shard of the same step (a failed step was discarded everywhere), so the heal moves nothing but the mesh: the group
builds a (nodes, workers per node) mesh of the new world, moves the FSDP2 modules onto its node dimension in place
(``remesh.py``) and the replicas' all-reduce onto its replica dimension. No mirrors: the other nodes are the copies.

A member whose coordinate changed (the new rank order put it elsewhere in its node) and a joiner take their
coordinate's shard, point to point, from the lowest-ranked old member that holds it. Members that stand at
different steps, a member whose last heal broke, a coordinate nobody holds, or a world that is not whole nodes (a
worker lost alone): the same in-place move with empty shards and the newest commit loaded into them
(``ShardKeeper._from_checkpoint``); a world that is not whole nodes falls back to the cold path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from elasticd.worker.hot.link import HealLink
from elasticd.worker.hot.remesh import layout_of, remesh, sharded_tensors
from elasticd.worker.hot.shard_heal import NoMirror, ShardKeeper
from elasticd.worker.hot.shard_rows import shard_rows
from elasticd.worker.hybrid import HybridError, ReplicaReduce, hybrid_mesh, install
from elasticd.worker.state import TrainingState

SHARD_TAG = 9_100  # the point-to-point tag of a coordinate's shard


class HybridKeeper(ShardKeeper):
    """One rank's side of an HSDP job's hot path (see the module's docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.every = 0  # no mirrors: the other nodes are replicas
        install(self.model, ReplicaReduce(self.hybrid, self.comms.run))

    @property
    def hybrid(self) -> Any:
        return self.sharding.hybrid

    def _heal(
        self,
        link: HealLink,
        state: TrainingState,
        old_rank: int | None,
        old_world: int,
        old_label: str,
        label: str,
        before_send: Callable[[], None],
    ) -> tuple[TrainingState, int]:
        rank, world, per_node = dist.get_rank(), dist.get_world_size(), self.nproc_per_node
        if world % per_node:
            raise NoMirror(f"{world} workers do not make whole nodes of {per_node}: no replica layout fits")
        held = None if old_rank is None or self.broken else old_rank % per_node
        everyone = link.gather_objects((held, state.step), "agreeing on the replicas' shards")
        steps = {step for coordinate, step in everyone if coordinate is not None}
        holder: dict[int, int] = {}
        for r, (coordinate, _step) in enumerate(everyone):
            if coordinate is not None:
                holder.setdefault(coordinate, r)
        if len(steps) != 1 or len(holder) != per_node:
            return self._from_checkpoint(link, rank, world, old_label, label)
        meta = None
        if rank == 0:
            meta = {**self._meta(state), "layout": layout_of(sharded_tensors(self.model, self.optimizer))}
        meta = link.broadcast_object(meta, 0, "sending the step's small state")
        before_send()
        local, received = self._shards(link, everyone, holder, meta["layout"], rank, world)
        return self._finish(local, meta, world, label), received

    def _shards(
        self,
        link: HealLink,
        everyone: list[Any],
        holder: dict[int, int],
        layout: Any,
        rank: int,
        world: int,
    ) -> tuple[dict[str, torch.Tensor], int]:
        """This rank's shard of its new coordinate: its own, or received from the coordinate's holder; the bytes
        received. Every holder sends to each rank that needs its coordinate and does not hold it."""
        per_node = self.nproc_per_node
        needs = [r for r in range(world) if everyone[r][0] != r % per_node]
        keys = sorted(layout.shapes)
        if rank in needs:
            coordinate = rank % per_node
            sizes = [self._rows(layout.shapes[k][0], world, rank) * layout.row_bytes()[k] for k in keys]
            buffer = torch.empty(sum(sizes), dtype=torch.uint8)
            what = f"receiving shard {coordinate} from rank {holder[coordinate]}"
            link.wait(link.recv(buffer, holder[coordinate], SHARD_TAG, what), what)
            local, offset = {}, 0
            for key, size in zip(keys, sizes, strict=True):
                shape = layout.shapes[key]
                local[key] = torch.empty((self._rows(shape[0], world, rank), *shape[1:]), dtype=layout.dtypes[key])
                local[key].reshape(-1).view(torch.uint8).copy_(buffer[offset : offset + size])  # any alignment
                offset += size
            return local, buffer.numel()
        own = {k: t.to_local() for k, t in sharded_tensors(self.model, self.optimizer).items()}
        receivers = [r for r in needs if holder[r % per_node] == rank]
        if receivers:
            flat = torch.cat([own[k].contiguous().reshape(-1).view(torch.uint8) for k in keys])
            what = "sending a replica's shard"
            works = [link.send(flat, r, SHARD_TAG, what) for r in receivers]
            for work in works:
                link.wait(work, what)
        return own, 0

    def _rows(self, n: int, world: int, rank: int) -> int:
        return shard_rows(n, self.nproc_per_node, rank % self.nproc_per_node).count

    def _move(self, local: dict[str, torch.Tensor], meta: dict[str, Any], world: int, label: str) -> None:
        device = next(iter(local.values())).device if local else torch.device("cpu")
        try:
            hybrid = hybrid_mesh(device.type, world, self.nproc_per_node, tag=f"_{label.rsplit('#', 1)[-1]}")
        except HybridError as exc:
            raise NoMirror(str(exc)) from exc
        remesh(self.model, self.optimizer, hybrid.shard, local, meta["layout"], meta["replicated"])
        self.comms.register(self.model)  # the rebuilt parameter groups start with FSDP's default collectives
        install(self.model, ReplicaReduce(hybrid, self.comms.run))
