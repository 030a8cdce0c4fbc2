"""HSDP the elastic way: each node shards the model across its own workers, and the nodes are replicas of each other.

accelerate's hybrid shard (``parallelism_config_dp_replicate_size`` above 1) fixes the replica count in the config
file; an elastic run has as many replicas as it has nodes, round by round. Under elasticd a hybrid config gives the
workers ``ELASTICD_HYBRID_SHARD`` (``accelerate_env.py``), and here, before ``prepare``, the worker library builds a
mesh of (nodes, workers per node) and hands accelerate the node's dimension only: ``fully_shard`` shards each module
across the node's workers (a 1-D mesh), and the gradient shards are averaged across the replicas by
:class:`ReplicaReduce`, FSDP2's public all-reduce hook (``set_all_reduce_hook``), run after its reduce-scatter. This
is torchft's HSDP (FSDP inside a replica group, the replicas' all-reduce its own) rather than FSDP2's native 2-D
mesh, whose replica all-reduce is a plain blocking ``dist.all_reduce`` nothing can give up on: here the hot path
waits for it as for FSDP's own collectives (``hot/shard_comms.py``), so a lost node is a lost replica.

Torch elastic numbers a node's workers contiguously (group rank x local world size + local rank), so the mesh's rows
are nodes. Checkpoints are DCP's, indifferent to the mesh: each node writes the same chunks and DCP keeps one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from elasticd import envvars
from elasticd.errors import ElasticdError
from elasticd.worker.fsdp import is_fsdp, take_fsdp_path

REPLICATE, SHARD = "dp_replicate", "dp_shard"


class HybridError(ElasticdError):
    """The world does not split into whole nodes (a worker lost alone): no hybrid mesh fits it."""


def asked_for_hybrid() -> bool:
    return os.environ.get(envvars.HYBRID_SHARD, "") == "1"


@dataclass(frozen=True, slots=True)
class HybridMesh:
    """The (nodes, workers per node) mesh of one world, its dimensions' names."""

    mesh: DeviceMesh
    names: tuple[str, str] = (REPLICATE, SHARD)

    @property
    def shard(self) -> DeviceMesh:
        return self.mesh[self.names[1]]

    @property
    def replicas(self) -> int:
        return int(self.mesh.size(0))

    @property
    def replica_group(self) -> dist.ProcessGroup:
        return self.mesh[self.names[0]].get_group()


def hybrid_mesh(device_type: str, world: int, per_node: int, tag: str = "") -> HybridMesh:
    """The mesh of ``world`` ranks, ``per_node`` a node (a collective: its groups are new). ``tag`` names the
    dimensions apart from an earlier mesh of the same shape (DTensor caches decisions by mesh equality, which
    ignores the rank: ``hot/shard_heal.py``)."""
    if per_node < 1 or world % per_node:
        raise HybridError(f"{world} workers do not make whole nodes of {per_node}")
    names = (f"{REPLICATE}{tag}", f"{SHARD}{tag}")
    return HybridMesh(init_device_mesh(device_type, (world // per_node, per_node), mesh_dim_names=names), names)


def take_sharded_path(accelerator: Any, log: Any = None) -> HybridMesh | None:
    """Before ``prepare``: accelerate's FSDP2 path on a CPU host (``fsdp.py``), then, under a hybrid config, the
    node's mesh (:func:`take_hybrid_path`)."""
    take_fsdp_path(accelerator, log)
    return take_hybrid_path(accelerator, log)


def take_hybrid_path(accelerator: Any, log: Any = None) -> HybridMesh | None:
    """Before ``prepare``, under a hybrid config with FSDP: give accelerate the node's dimension of a (nodes,
    workers per node) mesh, so that ``fully_shard`` shards across the node; None when not asked."""
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.state import AcceleratorState

    if not asked_for_hybrid() or not is_fsdp(accelerator):
        return None
    world = int(accelerator.num_processes)
    per_node = int(os.environ.get(envvars.LOCAL_WORLD_SIZE, world))
    hybrid = hybrid_mesh(accelerator.device.type, world, per_node)

    class NodeSharded(ParallelismConfig):
        """accelerate's sizes, with FSDP's dimension the node's alone (the replicas reduce through the hook)."""

        @property
        def fsdp_dim_names(self) -> list[str]:
            return [SHARD]

    state = AcceleratorState()
    state.parallelism_config = NodeSharded(dp_replicate_size=hybrid.replicas, dp_shard_size=per_node)
    state.device_mesh = hybrid.mesh
    if log is not None and accelerator.is_main_process:
        log.info("hybrid_shard", nodes=hybrid.replicas, per_node=per_node)
    return hybrid


class ReplicaReduce:
    """FSDP2's all-reduce hook: a module's reduced gradient shard, averaged over the replicas (the nodes).

    ``run(what, issue, group)``: how a collective is issued and waited for (the hot path's, which gives up on a lost
    peer); None: a plain blocking all-reduce."""

    def __init__(self, hybrid: HybridMesh, run: Any = None) -> None:
        self.group = hybrid.replica_group
        self.replicas = hybrid.replicas
        self.run = run

    def __call__(self, shard: Any) -> None:
        if self.replicas == 1:
            return
        if self.run is None:
            dist.all_reduce(shard, group=self.group)
        else:
            group = self.group
            self.run("replica all-reduce", lambda: dist.all_reduce(shard, group=group, async_op=True), group)
        shard.div_(self.replicas)


def install_replicas(hybrid: HybridMesh | None, model: Any) -> None:
    """After ``prepare``: the replicas' plain all-reduce on an HSDP model (nothing for any other)."""
    if hybrid is not None:
        install(model, ReplicaReduce(hybrid))


def install(model: Any, hook: ReplicaReduce) -> None:
    """The hook on every FSDP module of ``model`` (again after each re-formation: rebuilt groups have none)."""
    for module in model.modules():
        if hasattr(module, "set_all_reduce_hook"):
            module.set_all_reduce_hook(hook)
