"""What an asynchronous save copies while training waits: accelerate's state as ``save_state`` would save it, in
host memory, so that the writer thread writes the state of the save's step while the next steps change the live one.

Replicated (DDP, one process): deep copies of ``save_accelerator_state``'s arguments, the custom objects and the RNG
states (:class:`HostCopy`, buffers reused between saves). Sharded (accelerate's FSDP2 with ``SHARDED_STATE_DICT``):
each rank's local shards of the model and optimizer state dicts, as accelerate's ``save_fsdp_model`` and
``save_fsdp_optimizer`` take them (``get_model_state_dict``, ``get_optimizer_state_dict``), staged into host buffers
that are reused from one save to the next; the writer thread then saves them through DCP (``dcp.save``, over a gloo
group of their own: a collective of the writer's never meets one of training's) into the directories and under the
keys accelerate's ``load_state`` reads (``pytorch_model_fsdp_<i>/`` as ``{"model": ...}``, ``optimizer_<i>/`` as
``{"optimizer": ...}``). Staging is torch's own (``_create_cpu_state_dict``, ``_copy_state_dict``: what DCP's
``BlockingAsyncStager`` does with ``cache_staged_state_dict``, whose pinned buffers a CPU-only torch cannot make);
the design is DCP's ``async_save`` (stage, then save in a thread) with the thread and its group ours, so that a
failure is reported as any write's and a write never holds up the process's exit.
"""

from __future__ import annotations

import copy
import datetime
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import accelerate.utils as accelerate_utils
import numpy as np
import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.data_loader import IterableDatasetShard
from accelerate.utils import DistributedType

# accelerate's random_states_{rank}.pkl holds torch_{device}_manual_seed for each device whose is_{device}_available().
RNG_DEVICES = ("cuda", "xpu", "mlu", "sdaa", "musa", "hpu", "neuron")
# accelerate's names of the sharded directories (FSDP_MODEL_NAME, OPTIMIZER_NAME), for model or optimizer ``i``.
MODEL_DIR, OPTIMIZER_DIR = "pytorch_model_fsdp_{}", "optimizer_{}"


class HostCopy:
    """Deep copies of state into host memory. Tensor buffers are reused from one snapshot to the next: a fresh 600 MB
    allocation page-faults in at ~2 GB/s, a reused one copies at ~10 GB/s (measured on CPU), so one checkpoint's
    worth of host memory (pinned, for GPU tensors) stays allocated between saves."""

    def __init__(self) -> None:
        self._free: dict[tuple[Any, ...], list[torch.Tensor]] = {}
        self._used: list[torch.Tensor] = []

    def recycle(self) -> None:
        """Make the buffers of the copies made so far reusable: only once nothing reads those copies any more."""
        for buffer in self._used:
            self._free.setdefault((buffer.shape, buffer.dtype), []).append(buffer)
        self._used = []

    def __call__(self, obj: Any, memo: dict[Any, torch.Tensor] | None = None) -> Any:
        """``obj`` with every tensor copied; identical views stay one tensor (so tied weights are deduplicated by
        safetensors exactly as in ``save_state``) and dict subclasses such as OrderedDict keep their type."""
        memo = {} if memo is None else memo
        if isinstance(obj, torch.Tensor):
            if obj.layout != torch.strided:  # sparse: no storage to share or buffer to reuse
                return obj.detach().to("cpu", copy=True)
            key = (obj.untyped_storage().data_ptr(), obj.storage_offset(), obj.shape, obj.stride(), obj.dtype)
            if key not in memo:
                memo[key] = self._tensor(obj.detach())
            return memo[key]
        if isinstance(obj, dict):
            out = copy.copy(obj)
            out.update((name, self(value, memo)) for name, value in obj.items())
            return out
        if type(obj) in (list, tuple):
            return type(obj)(self(value, memo) for value in obj)
        return copy.deepcopy(obj)

    def _tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        if not tensor.is_contiguous():
            return tensor.to("cpu", copy=True)
        free = self._free.get((tensor.shape, tensor.dtype))
        buffer = free.pop() if free else torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
        self._used.append(buffer)
        return buffer.copy_(tensor)


def rng_state(step: int) -> dict[str, Any]:
    """This process's RNG states, under the keys ``save_accelerator_state`` writes (XLA is never snapshotted)."""
    states = {"step": step, "random_state": random.getstate(), "numpy_random_seed": np.random.get_state()}
    states["torch_manual_seed"] = torch.get_rng_state()
    for device in RNG_DEVICES:
        if getattr(accelerate_utils, f"is_{device}_available")():
            states[f"torch_{device}_manual_seed"] = getattr(torch, device).get_rng_state_all()
    return states


class Frozen:
    """Stands in for a stateful object, or a dataloader, in accelerate's save functions, as of the snapshot."""

    def __init__(self, state: Any, dataset: Any = None, sampler: Any = None, stateful: bool = False) -> None:
        self._state, self._sampler = state, sampler
        self.dataset, self.use_stateful_dataloader = dataset, stateful

    def state_dict(self) -> Any:
        return self._state

    def get_sampler(self) -> Any:
        return self._sampler


def freeze_loader(loader: Any, host: HostCopy) -> Frozen:
    stateful = bool(getattr(loader, "use_stateful_dataloader", False))
    # accelerate pickles the sampler object itself; a shallow copy freezes its epoch and seed.
    sampler = copy.copy(loader.get_sampler()) if isinstance(loader.dataset, IterableDatasetShard) else None
    return Frozen(host(loader.state_dict()) if stateful else None, loader.dataset, sampler, stateful)


@dataclass
class Snapshot:
    """One save's state in host memory: ``save_accelerator_state``'s arguments, the custom objects, the RNG states
    and, for a sharded model, each rank's staged shards by the directory they go to."""

    state: dict[str, Any]
    custom: list[Frozen]
    rng: dict[str, Any]
    shards: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    group: Any = None  # the gloo group the shards are written over: the world's they were taken in


def is_sharded(acc: Accelerator) -> bool:
    """Does ``save_state`` write DCP shards here (FSDP2, ``SHARDED_STATE_DICT``)?"""
    plugin = getattr(acc.state, "fsdp_plugin", None)
    if acc.distributed_type != DistributedType.FSDP or plugin is None or plugin.fsdp_version != 2:
        return False
    return str(getattr(plugin.state_dict_type, "name", plugin.state_dict_type)) == "SHARDED_STATE_DICT"


class Snapshotter:
    """Takes :class:`Snapshot` s of one accelerator's state; one at a time (``recycle`` once it is written)."""

    def __init__(self, timeout_s: float) -> None:
        self.host = HostCopy()
        self._staged: dict[str, dict[str, Any]] = {}  # the sharded host buffers, by directory
        self._timeout_s = timeout_s
        self._group: Any = None

    def take(self, acc: Accelerator, sharded: bool) -> Snapshot:
        """The state as of now (under FSDP a collective call: every rank at the same step)."""
        host = self.host
        # accelerate's save() is a no-op on the other ranks: they write only their RNG file, so copy nothing else.
        writes = acc.is_main_process or (acc.project_configuration.save_on_each_node and acc.is_local_main_process)
        owned = (acc._models, acc._optimizers, acc._schedulers, acc._dataloaders, acc._custom_objects)
        models, optimizers, schedulers, loaders, custom = owned if writes else ([], [], [], [], [])
        if sharded:  # as save_state under FSDP: the models and optimizers go to DCP, not save_accelerator_state
            models, optimizers = [], []
        state = {
            "model_states": [host(acc.get_state_dict(m, unwrap=False)) for m in models],
            "optimizers": [Frozen(host(o.state_dict())) for o in optimizers],
            "schedulers": [Frozen(host(s.state_dict())) for s in schedulers],
            "dataloaders": [freeze_loader(d, host) for d in loaders],
            "scaler": Frozen(host(acc.scaler.state_dict())) if writes and acc.scaler is not None else None,
            "step": acc.step,
        }
        shards = self._stage_shards(acc) if sharded else []
        custom_state = [Frozen(host(o.state_dict())) for o in custom]
        return Snapshot(state, custom_state, rng_state(acc.step), shards, self._group if sharded else None)

    def _stage_shards(self, acc: Accelerator) -> list[tuple[str, dict[str, Any]]]:
        from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        if self._group is None:  # every rank, at its first sharded save
            self._group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=self._timeout_s))
        live: list[tuple[str, dict[str, Any]]] = [
            (MODEL_DIR.format(i), {"model": get_model_state_dict(m)}) for i, m in enumerate(acc._models)
        ]
        live += [
            (OPTIMIZER_DIR.format(i), {"optimizer": get_optimizer_state_dict(acc._models[i], o)})
            for i, o in enumerate(acc._optimizers)
        ]
        staged = []
        for name, state in live:
            buffers = self._staged.get(name)
            if buffers is None or _shape(buffers) != _shape(state):  # the first save, or the state changed shape
                buffers = self._staged[name] = _create_cpu_state_dict(state, pin_memory=torch.cuda.is_available())
            staged.append((name, _copy_state_dict(state, buffers)))
        return staged

    def write_shards(self, snapshot: Snapshot, partial: Path) -> None:
        """The writer thread: save each staged state dict through DCP into its directory of ``partial``."""
        import torch.distributed.checkpoint as dcp

        for name, state in snapshot.shards:
            dcp.save(state, storage_writer=dcp.FileSystemWriter(partial / name), process_group=snapshot.group)

    def regroup(self) -> None:
        """The group re-formed in place: the next sharded save writes over a group of the new world (one in flight
        keeps its own), into buffers of the new shards' shapes."""
        self._group = None
        self._staged = {}

    def recycle(self) -> None:
        """The last snapshot is written (or given up): its buffers may be reused."""
        self.host.recycle()


def _shape(state: Any) -> Any:
    """The structure of a state dict: its keys, and each tensor's shape and dtype (a staging buffer fits it)."""
    if isinstance(state, dict):
        return tuple((key, _shape(value)) for key, value in state.items())
    if isinstance(state, (list, tuple)):
        return tuple(_shape(value) for value in state)
    if isinstance(state, torch.Tensor):
        return (tuple(state.shape), state.dtype)
    return type(state).__name__
