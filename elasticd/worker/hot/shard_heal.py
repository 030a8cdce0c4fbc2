"""A sharded job's recovery in place: the mirror ring of each epoch, and the heal that moves the group's state onto
a new world size from what its members hold in memory.

After a loss the survivors keep their own shards; the lost ranks' shards are in their ring peers' mirrors
(``mirror.py``). The group goes back to the newest step whole in memory (``mirror_pick.py``: the survivors' live
state when the lost ranks' mirrors are of the step they stand at, an older generation otherwise), exchanges the rows
each new rank needs (``shard_exchange.py``) and moves its FSDP2 modules and optimizer onto a mesh of the new world
(``remesh.py``). The run's position, the LR scheduler and the objects registered for checkpointing come with the
step gone back to, from the member holding old shard 0 at it. A joiner holds nothing and takes its rows from the
members' live state at the agreed boundary, the same way.

No step whole in memory (two adjacent nodes lost at once, a generation missing), or a member whose last heal broke
part way (its shards may be half moved, its mirrors are of an epoch whose ranks no longer say whose rows they are):
the same processes move onto the new world with empty shards and load the newest committed checkpoint into them
(``_from_checkpoint``); only when there is none, :class:`NoMirror`, and the cold path.
"""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from elasticd.worker.batching import BatchPlan
from elasticd.worker.hot.backend import Groups, groups_for
from elasticd.worker.hot.errors import HotRecoveryError
from elasticd.worker.hot.link import DEFAULT_HEAL_TIMEOUT, HealLink
from elasticd.worker.hot.mirror import MirrorStats, ShardMirror, peers
from elasticd.worker.hot.mirror_pick import Holdings, pick
from elasticd.worker.hot.reform import DEFAULT_GROUP_TIMEOUT, update_accelerate
from elasticd.worker.hot.registered import capture, registered_objects, restore
from elasticd.worker.hot.remesh import layout_of, remesh, replicated_state, sharded_tensors
from elasticd.worker.hot.shard_comms import ResilientShardComms
from elasticd.worker.hot.shard_exchange import exchange
from elasticd.worker.hot.shard_rows import shard_rows
from elasticd.worker.state import TrainingState

# How long a heal waits for the mirror generation in flight when the change began (seconds): one whose peer died
# fails at once; one stuck on a frozen peer is left, and the generation before it used.
SETTLE_S = 2.0
# Mirror figures go to the daemon at most this often (seconds): a beat per generation would be one per step.
REPORT_EVERY_S = 1.0
# The mirrors' own gloo group: a bounded timeout, as every group the hot path forms.
MIRROR_GROUP_TIMEOUT = timedelta(minutes=2)


class NoMirror(HotRecoveryError):
    """No step of the group's state is whole in its members' memory."""


class ShardHealFailed(HotRecoveryError):
    """The heal broke part way (a member lost during it): this member's model may be half moved. The session takes
    the heal again in the next epoch (``session.py``), which then loads the newest commit (``ShardKeeper.broken``)."""

    holds_state = False  # as a receiver's :class:`~elasticd.worker.hot.errors.HealError`: it can only be healed


@dataclass(frozen=True, slots=True)
class Sharding:
    """How a sharded job mirrors: every ``every`` optimizer steps (0: never), ``nproc_per_node`` workers a node."""

    every: int
    nproc_per_node: int
    hybrid: Any = None  # HSDP: the (nodes, workers per node) mesh at start (worker/hybrid.py's HybridMesh)


class ShardedReformer:
    """Re-forms the default group for a sharded job; the model moves onto it in the heal (it needs the rows)."""

    def __init__(self, accelerator: Any, *, timeout: timedelta = DEFAULT_GROUP_TIMEOUT) -> None:
        self.accelerator = accelerator
        world = dist.group.WORLD if dist.is_initialized() else None
        self.groups: Groups = groups_for(world, timeout=timeout, environ=os.environ)

    def reform(self, store: dist.Store, rank: int, world_size: int, plan: BatchPlan | None = None) -> None:
        self.groups.replace(store, rank, world_size, None)
        update_accelerate(self.accelerator, rank, world_size, plan)


class ShardKeeper:
    """One rank's side of a sharded job's hot path (see the module's docstring)."""

    def __init__(
        self,
        accelerator: Any,
        model: Any,
        optimizer: Any,
        scheduler: Any,
        comms: ResilientShardComms,
        sharding: Sharding,
        failed: Callable[[], bool],
        reload: Callable[[], TrainingState | None] = lambda: None,
    ) -> None:
        """``failed()``: has the current step failed (a mirror in flight is then not waited for); ``reload()``: load
        the newest committed checkpoint into the prepared objects, in place (a collective; None: there is none)."""
        self.accelerator, self.model, self.optimizer, self.scheduler = accelerator, model, optimizer, scheduler
        self.comms = comms
        self.sharding = sharding
        self.every = sharding.every
        self.nproc_per_node = sharding.nproc_per_node
        self._failed = failed
        self._reload = reload
        sharded_tensors(model, optimizer)  # raises UnsupportedSetup for what cannot move in place (HSDP, TP)
        self.ring: ShardMirror | None = None
        self.label = ""
        self.stats = MirrorStats()  # over the whole run: every epoch's ring adds to it
        self._reported = MirrorStats()  # what report() said so far
        self._reported_at = 0.0
        # the last heal broke part way: the next one, whoever holds what, loads the newest commit into every member
        self.broken = False

    # -- the ring ------------------------------------------------------------------------------------------------

    def start_epoch(self, label: str) -> None:
        """Every rank of the (new) world: a ring of mirrors for epoch ``label`` (a collective: a new gloo group)."""
        self._retire_ring()
        self.label = label
        rank, world = dist.get_rank(), dist.get_world_size()
        if self.every < 1 or peers(rank, world, self.nproc_per_node) is None:
            return  # mirrors off, or one node: nobody to mirror to
        group = dist.new_group(backend="gloo", timeout=MIRROR_GROUP_TIMEOUT)
        self.ring = ShardMirror(group, rank=rank, world=world, nproc_per_node=self.nproc_per_node, epoch=label)

    def after_step(self, state: TrainingState) -> dict[str, Any] | None:
        """At a completed optimizer step: mirror this rank's shards every ``every`` steps; the figures of
        :meth:`report`."""
        if self.ring is not None and state.step % self.every == 0:
            tensors = {k: t.to_local() for k, t in sharded_tensors(self.model, self.optimizer).items()}
            self.ring.offer(state.step, tensors, self._meta(state), abandon=self._failed)
        return self.report()

    def _meta(self, state: TrainingState) -> dict[str, Any]:
        """What comes back with a step's shards: the run's position and the small state the shards lack."""
        return {
            "state": state.to_meta(),
            "scheduler": None if self.scheduler is None else copy.deepcopy(self.scheduler.state_dict()),
            "registered": capture(registered_objects(self.accelerator)),
            "replicated": replicated_state(self.model, self.optimizer),
            # the hyperparameters the scheduler set (its load_state_dict does not set them back): a joiner's are
            # its constructor's, a rolled-back member's a later step's
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups],
        }

    def report(self) -> dict[str, Any] | None:
        """The mirror generations completed since the last report, as sums; None more often than every
        ``REPORT_EVERY_S`` or when there is none (the daemon's metrics: ``agent/reconfig.py``)."""
        now = time.monotonic()
        if now - self._reported_at < REPORT_EVERY_S:
            return None
        total = MirrorStats()
        _add(total, self.stats)
        if self.ring is not None:
            _add(total, self.ring.stats)
        seen = self._reported
        generations = total.generations - seen.generations
        if generations <= 0:
            return None
        self._reported, self._reported_at = total, now
        return {
            "generations": generations,
            "blocking_s": round(max(0.0, total.blocking_s - seen.blocking_s), 6),
            "total_s": round(max(0.0, total.total_s - seen.total_s), 6),
            "bytes": total.bytes_sent - seen.bytes_sent,
        }

    def settle(self) -> None:
        """Wait (a bounded time) for the generation in flight: at a planned change, so a leaver's is whole."""
        if self.ring is not None:
            self.ring.settle(SETTLE_S)

    def _retire_ring(self) -> None:
        ring, self.ring = self.ring, None
        if ring is not None:
            ring.freeze()
            _add(self.stats, ring.stats)

    # -- the heal ------------------------------------------------------------------------------------------------

    def heal(
        self,
        state: TrainingState,
        old_rank: int | None,
        old_world: int,
        old_label: str,
        label: str,
        abandon: Callable[[], str | None] | None = None,
        before_send: Callable[[], None] = lambda: None,
    ) -> tuple[TrainingState, int]:
        """Every member of the new default group (re-formed already): the group's state at the newest step whole in
        memory, moved onto the new world. ``old_rank``: this member's rank in the epoch left (None: a joiner);
        ``old_world``: that epoch's size (a joiner's 0: the members say); ``old_label``/``label``: the epochs left
        and entered; ``abandon()``: a reason to give up a wait on a peer (the new epoch's failure notice);
        ``before_send()``: called as the rows are about to move (the fault injector's hook, ``kill@heal=``). Returns
        the state trained on from here and the bytes this rank received. Raises :class:`NoMirror` when no step is
        whole and no checkpoint is committed, :class:`ShardHealFailed` when the heal broke part way."""
        world = dist.group.WORLD
        if world is None:
            raise ShardHealFailed("no process group to heal over: re-form first")
        link = HealLink(world, 0, DEFAULT_HEAL_TIMEOUT, abandon)
        try:
            healed = self._heal(link, state, old_rank, old_world, old_label, label, before_send)
        except NoMirror:
            raise
        except Exception as exc:
            self.broken = True
            raise ShardHealFailed(f"the sharded heal failed: {type(exc).__name__}: {exc}") from exc
        finally:
            link.close()
        self.broken = False
        return healed

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
        ring = self.ring
        if ring is not None:
            ring.settle(SETTLE_S)
            ring.freeze()  # what it holds from here is what the heal uses: no late generation replaces it
        rank, world = dist.get_rank(), dist.get_world_size()
        mine = self._holdings(ring, rank, old_rank, state, old_label)
        everyone = link.gather_objects((mine, old_world, self.broken), "agreeing on the shards held")
        old_world = max(w for _, w, _ in everyone)
        broken = any(b for _, _, b in everyone)
        chosen = None if broken else pick([h for h, _, _ in everyone if h.old_rank >= 0], old_world, old_label)
        if chosen is None:
            return self._from_checkpoint(link, rank, world, old_label, label)
        step, holders = chosen
        held, meta = self._pieces(ring, old_rank, state, step, holders, rank)
        meta = link.broadcast_object(meta, int(holders[0] or 0), "sending the step's small state")
        before_send()
        local, received = exchange(held, meta["layout"], old_world, holders, rank, world, wait=link.wait)
        return self._finish(local, meta, world, label), received

    def _finish(self, local: dict[str, torch.Tensor], meta: dict[str, Any], world: int, label: str) -> TrainingState:
        """Every heal's end: this rank's rows onto the new mesh, the small state of the step gone back to (from
        ``meta``), the new epoch's ring. Returns the state trained on from here."""
        self._move(local, meta, world, label)
        for group, settings in zip(self.optimizer.param_groups, meta["param_groups"], strict=True):
            group.update(settings)
        if self.scheduler is not None and meta["scheduler"] is not None:
            self.scheduler.load_state_dict(meta["scheduler"])
        restore(registered_objects(self.accelerator), meta["registered"])
        self.start_epoch(label)  # retires the old ring first
        return TrainingState.from_meta(meta["state"])

    def _move(self, local: dict[str, torch.Tensor], meta: dict[str, Any], world: int, label: str) -> None:
        device = next(iter(local.values())).device if local else torch.device("cpu")
        # A name of its own: DTensor caches sharding decisions by mesh equality, which ignores the rank, so a mesh
        # equal to an earlier one (the same size again after a loss and a join) would bring back that mesh and this
        # rank's coordinate in it (seen: two ranks saving the same rows)
        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=(f"elasticd_{label.rsplit('#', 1)[-1]}",))
        remesh(self.model, self.optimizer, mesh, local, meta["layout"], meta["replicated"])
        self.comms.register(self.model)  # the rebuilt parameter groups start with FSDP's default collectives

    def _from_checkpoint(
        self, link: HealLink, rank: int, world: int, old_label: str, label: str
    ) -> tuple[TrainingState, int]:
        """No step whole in memory: move onto the new world with empty shards and load the newest committed
        checkpoint into them, in place (DCP reshards it); the survivors keep their processes."""
        meta: dict[str, Any] | None = None
        if rank == 0:
            live = sharded_tensors(self.model, self.optimizer)
            meta = {"layout": layout_of(live), "replicated": replicated_state(self.model, self.optimizer)}
        shared = link.broadcast_object(meta, 0, "sending the shards' layout")
        layout = shared["layout"]
        local = {
            key: torch.empty((self._rows(shape[0], world, rank), *shape[1:]), dtype=layout.dtypes[key])
            for key, shape in layout.shapes.items()
        }
        self._move(local, shared, world, label)
        state = self._reload()
        if state is None:
            raise NoMirror(f"no step of epoch {old_label}'s state is whole in memory, and no checkpoint is committed")
        self._retire_ring()
        self.start_epoch(label)
        return state, 0

    def _rows(self, n: int, world: int, rank: int) -> int:
        """How many of a tensor's ``n`` rows ``rank`` holds in a world of ``world``."""
        return shard_rows(n, world, rank).count

    def _holdings(
        self, ring: ShardMirror | None, rank: int, old_rank: int | None, state: TrainingState, label: str
    ) -> Holdings:
        if old_rank is None:
            return Holdings(rank, -1, (), None)  # a joiner holds nothing
        own = {(state.step, label)}  # the live shards: a failed step was discarded, so they are of this step
        mirror = None
        if ring is not None:
            own |= {(g.step, g.epoch) for g in ring.own}
            if ring.held is not None:
                mirror = (ring.held.owner, ring.held.step, ring.held.epoch)
        return Holdings(rank, old_rank, tuple(sorted(own)), mirror)

    def _pieces(
        self,
        ring: ShardMirror | None,
        old_rank: int | None,
        state: TrainingState,
        step: int,
        holders: list[int | None],
        rank: int,
    ) -> tuple[dict[str, dict[int, torch.Tensor]], dict[str, Any] | None]:
        """The old shards this rank contributes at ``step`` (its own, a mirror), and, on the member holding old
        shard 0, what comes with them (the others: None, replaced by the broadcast)."""
        held: dict[str, dict[int, torch.Tensor]] = {}
        meta: dict[str, Any] | None = None
        if old_rank is not None and holders[old_rank] == rank:
            if step == state.step:
                live = sharded_tensors(self.model, self.optimizer)
                for key, t in live.items():
                    held.setdefault(key, {})[old_rank] = t.to_local()
                meta = {**self._meta(state), "layout": layout_of(live)}
            else:
                gen = ring.own_at(step) if ring is not None else None
                assert gen is not None, f"pick chose step {step}, which this rank does not hold"
                for key in gen.offsets:
                    held.setdefault(key, {})[old_rank] = gen.tensor(key)
                meta = {**gen.meta, "layout": layout_of(sharded_tensors(self.model, self.optimizer))}
        if ring is not None and ring.held is not None and holders[ring.held.owner] == rank:
            mirror = ring.held
            for key in mirror.offsets:
                held.setdefault(key, {})[mirror.owner] = mirror.tensor(key)
            if meta is None:
                meta = {**mirror.meta, "layout": layout_of(sharded_tensors(self.model, self.optimizer))}
        return held, (meta if holders[0] == rank else None)

    def close(self) -> None:
        self._retire_ring()


def _add(total: MirrorStats, part: MirrorStats) -> None:
    total.blocking_s += part.blocking_s
    total.total_s += part.total_s
    total.bytes_sent += part.bytes_sent
    total.generations += part.generations
    total.refused += part.refused
