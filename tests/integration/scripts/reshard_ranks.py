"""One rank of an FSDP2 job that changes its world size in place: 3 ranks mirror their shards around the ring, rank
2 is killed (-9), ranks 0 and 1 re-form at 2 from their own shards and rank 2's mirror, then a joiner (a new process)
takes its shard from them at 3. At each new size the same process trains on, and compares its weights with a fresh
model of that size loaded from the full state (bit for bit: same rows, same arithmetic).

    python reshard_ranks.py DIR ROLE RANK    (ROLE: member, joiner)

Run by tests/integration/test_shard_reshard.py; writes DIR/result-<rank>.json.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from elasticd.worker.hot.backend import GlooGroups
from elasticd.worker.hot.mirror import ShardMirror
from elasticd.worker.hot.mirror_pick import Holdings, pick
from elasticd.worker.hot.remesh import layout_of, remesh, replicated_state, sharded_tensors
from elasticd.worker.hot.shard_exchange import exchange

BATCH, LR = 12, 1e-2
FULL = StateDictOptions(full_state_dict=True)


def build(world: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    # row counts that split unevenly at 2 and 3 (33: 17+16 and 11+11+11; 7: 4+3 and 3+3+1)
    model = nn.Sequential(nn.Linear(16, 33), nn.ReLU(), nn.Linear(33, 7))
    mesh = init_device_mesh("cpu", (world,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


def train(model: nn.Module, opt: torch.optim.Optimizer, step: int, rank: int, world: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(BATCH, 16, generator=g), torch.randn(BATCH, 7, generator=g)
    n = BATCH // world
    loss = ((model(x[rank * n : (rank + 1) * n]) - y[rank * n : (rank + 1) * n]) ** 2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    params = model.named_parameters()
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in params}


def group(directory: Path, name: str, rank: int, world: int) -> None:
    dist.init_process_group("gloo", init_method=f"file://{directory / name}", rank=rank, world_size=world)


def reference(directory: Path, world: int, rank: int, name: str, steps: range) -> dict[str, torch.Tensor]:
    """A fresh model of ``world`` loaded from the full state ``name``, trained ``steps``: what in place must match."""
    saved = torch.load(directory / name, weights_only=False)
    model, opt = build(world)
    set_model_state_dict(model, saved["model"], options=FULL)
    set_optimizer_state_dict(model, opt, saved["optim"], options=FULL)
    for step in steps:
        train(model, opt, step, rank, world)
    return full_params(model)


def save_full(directory: Path, name: str, model: nn.Module, opt: torch.optim.Optimizer, rank: int) -> None:
    params, optim = full_params(model), get_optimizer_state_dict(model, opt, options=FULL)
    if rank == 0:
        torch.save({"model": params, "optim": optim}, directory / name)
    dist.barrier()


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def reshard_to(
    model: nn.Module,
    opt: Any,
    held: dict[str, dict[int, torch.Tensor]],
    old_world: int,
    holders: list[int | None],
    replicated_at: dict[str, Any] | None = None,
) -> int:
    """Every rank of the current default group: take the new shards from ``held`` and move onto the new mesh.
    ``replicated_at``: the optimizer's unsharded state at the step gone back to (default: the live one)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    layout = [layout_of(sharded_tensors(model, opt)) if rank == 0 else None]
    replicated = [(replicated_at or replicated_state(model, opt)) if rank == 0 else None]
    dist.broadcast_object_list(layout, src=0)  # a joiner's optimizer has no state yet: rank 0's layout is the group's
    dist.broadcast_object_list(replicated, src=0)
    assert layout[0] is not None and replicated[0] is not None
    local, received = exchange(held, layout[0], old_world, holders, rank, world)
    remesh(model, opt, init_device_mesh("cpu", (world,)), local, layout[0], replicated[0])
    return received


def _die_mid_exchange(ring: ShardMirror) -> None:
    """Rank 2, the lost node: killed (-9) after the header of its step-4 mirror, before its data, so rank 0 holds that
    generation in part. Its shards live on only in rank 0's mirror of step 3."""
    both = ring._both
    calls = []

    def then_die(*pairs: torch.Tensor) -> None:
        calls.append(pairs)
        if len(calls) == 2:  # (header, data): the header goes out whole, the data never
            both(*pairs[:2])
            os.kill(os.getpid(), signal.SIGKILL)
        both(*pairs)

    ring._both = then_die  # type: ignore[method-assign]


def member(directory: Path, rank: int) -> dict[str, Any]:
    group(directory, "world3", rank, 3)
    model, opt = build(3)
    ring = ShardMirror(dist.new_group(backend="gloo"), rank=rank, world=3, nproc_per_node=1, epoch="e0")
    for step in range(5):
        if step == 4:  # every generation of steps 0-3 whole: the full state at step 3 for the reference
            assert ring.settle(30.0) and ring.failed is None, ring.failed
            save_full(directory, "full-3.pt", model, opt, rank)
            if rank == 2:
                _die_mid_exchange(ring)
        train(model, opt, step, rank, 3)
        ring.offer(
            step,
            {k: t.to_local() for k, t in sharded_tensors(model, opt).items()},
            {"replicated": replicated_state(model, opt)},
        )
    while rank == 2:
        time.sleep(1.0)  # killed by its own step-4 exchange
    assert ring.settle(30.0) and ring.failed is not None  # rank 2 died in the middle of step 4's exchange
    # -- 3 -> 2: the survivors, same processes, the old group left behind
    groups = GlooGroups(timedelta(seconds=60))
    groups.replace(dist.FileStore(str(directory / "world2"), 2), rank, 2, None)  # as the hot path re-forms
    mine = Holdings(rank, rank, tuple((g.step, g.epoch) for g in ring.own), None)
    if ring.held is not None:
        mine = Holdings(rank, rank, mine.own, (ring.held.owner, ring.held.step, ring.held.epoch))
    everyone: list[Any] = [None, None]
    dist.all_gather_object(everyone, mine)
    chosen = pick(everyone, 3, "e0")
    assert chosen is not None
    step, holders = chosen
    own = ring.own_at(step)
    assert own is not None
    held: dict[str, dict[int, torch.Tensor]] = {k: {rank: own.tensor(k)} for k in own.offsets}
    if ring.held is not None and holders[ring.held.owner] == rank:
        for k in ring.held.offsets:
            held[k][ring.held.owner] = ring.held.tensor(k)
    received = reshard_to(model, opt, held, 3, holders, own.meta["replicated"])
    for s in range(step + 1, step + 4):
        train(model, opt, s, rank, 2)
    at_2 = max_diff(full_params(model), reference(directory, 2, rank, "full-3.pt", range(step + 1, step + 4)))
    save_full(directory, "full-2.pt", model, opt, rank)
    # -- 2 -> 3: a joiner takes its shard from the live members
    groups.replace(dist.FileStore(str(directory / "world3-join"), 3), rank, 3, None)
    live = {k: {rank: t.to_local()} for k, t in sharded_tensors(model, opt).items()}
    reshard_to(model, opt, live, 2, [0, 1])
    return {"step": step, "holders": holders, "received": received, "at_2": at_2, **_at_3(directory, model, opt, 7)}


def _at_3(directory: Path, model: nn.Module, opt: Any, first: int) -> dict[str, Any]:
    rank = dist.get_rank()
    for s in range(first, first + 2):
        train(model, opt, s, rank, 3)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=str(directory / "dcp-3"))
    return {"at_3": max_diff(full_params(model), reference(directory, 3, rank, "full-2.pt", range(first, first + 2)))}


def joiner(directory: Path) -> dict[str, Any]:
    group(directory, "private", 0, 1)  # prepared warm in a world of its own, as a joining node's workers are
    model, opt = build(1)
    GlooGroups(timedelta(seconds=60)).replace(dist.FileStore(str(directory / "world3-join"), 3), 2, 3, None)
    received = reshard_to(model, opt, {}, 2, [0, 1])
    return {"received": received, **_at_3(directory, model, opt, 7)}


def main() -> None:
    directory, role, rank = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    result = member(directory, rank) if role == "member" else joiner(directory)
    (directory / f"result-{role}-{rank}.json").write_text(json.dumps(result))
    os._exit(0)  # the old groups' peers are gone: no teardown waits on them


if __name__ == "__main__":
    main()
