"""Re-forming the process group in place: a new membership, the same processes, the same prepared objects.

:meth:`Reformer.reform` takes a store that every member of the new group reaches (a fresh ``PrefixStore`` per
membership epoch over elasticd's etcd store in production, a ``TCPStore`` in tests), this process's new rank and
the new world size, and leaves the user's objects ready for the next step at that size:

1. the old default group is retired and a new default group formed over the store, as the backend requires
   (``backend.py``: gloo's old group is *kept referenced* in :class:`AbandonedGroups`; NCCL's is aborted, or shrunk
   when the caller passes ``previous_ranks`` of a pure shrink — NCCL is unverified, see there);
2. the hook's :class:`~elasticd.worker.hot.comm_hook.GroupHolder` and the prepared ``DistributedDataParallel``
   (``_update_process_group``) move to it;
3. DDP's gradient buckets are re-synchronised: a survivor's reducer holds the layout it rebuilt from the gradient
   order of its first steps, a joiner's fresh reducer the initial one, and an all-reduce of mismatched layouts mixes
   unrelated gradients. Every member pushes all parameters as "rebuilt" and rebuilds now, which also broadcasts
   rank 0's bucket indices, so the layouts agree and no rebuild (a collective) is left for the next forward pass.
   The rebuilt layout follows parameter order, so later buckets no longer overlap with backward compute;
4. accelerate's ``num_processes`` and ``process_index`` are set in *both* shared-state dicts (``PartialState`` and
   ``AcceleratorState`` each keep a copy; ``_reset_state()`` is no use, the loop holds the old objects), and the
   gradient accumulation of the new batch plan goes through accelerate's public setter.

:func:`start_private_world` gives a joiner a default group of its own before ``Accelerator()`` so that accelerate
adopts it and wraps the model in DDP; the joiner then re-forms into the running group like any member.

Why an old gloo group is never destroyed for real: dropping the last reference to a gloo group runs its destructor,
which joins gloo's threads; with a collective the hook abandoned still pending (gloo in torch 2.13 cannot abort one)
that blocks whichever line of the training loop happens to drop it until the old group's timeout (measured: 19 s
of a 20 s timeout). Abandoned groups are released once that timeout has certainly passed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from accelerate.state import AcceleratorState, PartialState

from elasticd.privates.check import require
from elasticd.worker.batching import BatchPlan
from elasticd.worker.hot.backend import AbandonedGroups, Groups, groups_for
from elasticd.worker.hot.comm_hook import GroupHolder
from elasticd.worker.hot.errors import ReformError, SurfaceChanged, UnsupportedSetup

# The timeout of each group we form. It bounds how long a formation waits for a member that never comes, and how
# long a collective abandoned by the hook holds one of gloo's threads (and keeps its group alive here): minutes, not
# torch's 30-minute gloo default, and far above any healthy collective.
DEFAULT_GROUP_TIMEOUT = timedelta(minutes=10)

__all__ = ["AbandonedGroups", "Formation", "Reformer", "expect_world", "start_private_world", "update_accelerate"]


@dataclass(frozen=True, slots=True)
class Formation:
    """The group this process now trains in."""

    group: dist.ProcessGroup
    rank: int
    world_size: int
    seconds: float  # from the call to the group being usable: formation, DDP and accelerate updates
    method: str = "new"  # "new": a new group over the store; "shrink": the old one shrunk in place (NCCL)


class Reformer:
    """Moves one process's prepared model, hook and accelerate state to each new group."""

    def __init__(
        self,
        accelerator: Any,
        model: torch.nn.parallel.DistributedDataParallel,
        holder: GroupHolder,
        *,
        groups: Groups | None = None,
        timeout: timedelta = DEFAULT_GROUP_TIMEOUT,
        clock: Callable[[], float] = time.monotonic,
        environ: Mapping[str, str] = os.environ,
    ) -> None:
        """``groups`` defaults to the one for the backend of the current default group (``backend.groups_for``)."""
        if groups is None:
            groups = groups_for(
                dist.group.WORLD if dist.is_initialized() else None, timeout=timeout, environ=environ, clock=clock
            )
        require(groups.name, SurfaceChanged)
        if accelerator.distributed_type not in groups.distributed_types:
            raise UnsupportedSetup(
                f"accelerate's {accelerator.distributed_type}",
                f"hot recovery on {groups.name} re-forms plain DDP ({', '.join(groups.distributed_types)})",
            )
        if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
            raise UnsupportedSetup(
                "this model wrapper", f"expected DistributedDataParallel, got {type(model).__name__}"
            )
        self.accelerator = accelerator
        self.model = model
        self.holder = holder
        self.groups = groups
        self.timeout = timeout
        self._clock = clock

    def can_shrink(self) -> bool:
        """Whether this member can shrink the current group in place (to announce to the membership decision)."""
        return dist.is_initialized() and dist.group.WORLD is not None and self.groups.can_shrink(dist.group.WORLD)

    def reform(
        self,
        store: dist.Store,
        rank: int,
        world_size: int,
        plan: BatchPlan | None = None,
        *,
        previous_ranks: Sequence[int] | None = None,
    ) -> Formation:
        """Leave the current group and train as ``rank`` of ``world_size`` in a new one formed over ``store``.

        Every member of the new group calls this with the same store and world size (a collective). ``plan`` is
        the batch plan for the new world (:func:`~elasticd.worker.batching.plan_batches`), whose accumulation is
        set; None keeps accelerate's. ``previous_ranks[r]``, the old rank of new rank ``r`` (the same list on every
        member), lets a backend that can shrink the old group in place do so when the change is a pure shrink; pass
        it only when every member's :meth:`can_shrink` said yes. Raises :class:`ReformError` when the group cannot be
        formed or the buckets cannot be agreed: hot recovery is then over for this process (fall back to the cold
        path).
        """
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside the world of {world_size}")
        if plan is not None and plan.world_size != world_size:
            raise ValueError(f"the batch plan is for a world of {plan.world_size}, not {world_size}")
        started = self._clock()
        group, method = self.groups.replace(store, rank, world_size, previous_ranks)
        self.holder.set(group)
        self.model._update_process_group(group)
        self._resync_buckets(rank, world_size)
        self._update_accelerate(rank, world_size, plan)
        return Formation(group, rank, world_size, self._clock() - started, method)

    def _resync_buckets(self, rank: int, world_size: int) -> None:
        reducer = self.model.reducer
        reducer._push_all_rebuilt_params()
        try:
            # False (and no collective, on every member alike) where DDP never rebuilds: find_unused_parameters
            # without a static graph keeps the initial layout, which every member then still has.
            rebuilt = reducer._rebuild_buckets()
        except Exception as exc:
            raise ReformError(f"agreeing on DDP's buckets failed: {exc}", rank=rank, world_size=world_size) from exc
        self.model._has_rebuilt_buckets = bool(rebuilt)  # what DDP's own forward would have recorded

    def _update_accelerate(self, rank: int, world_size: int, plan: BatchPlan | None) -> None:
        update_accelerate(self.accelerator, rank, world_size, plan)


def update_accelerate(accelerator: Any, rank: int, world_size: int, plan: BatchPlan | None) -> None:
    """Tell accelerate the new rank and world size (both shared-state dicts) and the new plan's accumulation."""
    for shared in (PartialState._shared_state, AcceleratorState._shared_state):
        shared["num_processes"] = world_size
        shared["process_index"] = rank
    if plan is not None:
        accelerator.gradient_accumulation_steps = plan.accumulation
    # accelerate counts micro-batches to know when to sync; a step restarts the count at any world size
    accelerator.step = 0


def start_private_world(
    *, backend: str = "gloo", timeout: timedelta = DEFAULT_GROUP_TIMEOUT, device_id: torch.device | None = None
) -> dist.ProcessGroup:
    """A joiner's default group of one (over an in-memory store), to create before ``Accelerator()``.

    accelerate adopts an initialised default group instead of forming one from the environment; it still needs to
    see a distributed launch (``LOCAL_RANK`` set, as torchrun and elasticd do) to wrap the model in DDP, and on a GPU
    more than one process (:func:`expect_world`). ``device_id``: this process's GPU, for ``backend="nccl"``.
    """
    if dist.is_initialized():
        raise RuntimeError("a process group exists already: a joiner starts its private world before anything else")
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout, device_id=device_id)
    group = dist.group.WORLD
    assert group is not None
    return group


def expect_world(world_size: int) -> None:
    """Make accelerate see ``world_size`` processes: a GPU joiner calls it after ``Accelerator()``, before
    ``prepare()``.

    On a GPU accelerate wraps the model in DDP only when it sees more than one process (``use_distributed``), and a
    joiner's private world has one; on the CPU it wraps anyway. The re-formation sets the real figures.
    """
    if world_size < 2:
        raise ValueError(f"a joiner expects a world of at least 2, got {world_size}")
    for shared in (PartialState._shared_state, AcceleratorState._shared_state):
        shared["num_processes"] = world_size
