"""Healing: every member of a new group takes the training state of one source member, over that group.

After a failure the survivors may be a step apart (a peer can die after one survivor's last all-reduce completed and
before another's did); a joiner has only freshly initialised objects. :func:`heal` makes them all equal to the
source (:func:`order_by_progress` puts the member with the most committed steps first, to be rank 0 and the source):
parameters and buffers of the prepared model, the optimizer's and the scheduler's state dicts, the objects the
script registered for checkpointing (as a restart loads them: ``registered.py``) and the
:class:`~elasticd.worker.state.TrainingState` (step count, data position, skipped batches). RNG streams are not
copied: they are per rank, and the worker library derives them from (seed, step, rank) after any resume.

The transfer is two small broadcasts (the length and the pickled description: state-dict structure, tensor shapes
and dtypes, training state, the registered objects' ``torch.save`` bytes; pickled as torch's own
``broadcast_object_list`` does, between members of one job),
one agreement that every member's objects fit the source's (so that all members fail together instead of one
waiting on the others), then the tensors packed into few flat buffers of one dtype each. Every collective has a
bounded wait: a member that dies or hangs during the heal raises :class:`~elasticd.worker.hot.errors.HealError` on
the others (fall back to the cold path) instead of blocking them until the group's timeout. On NCCL (unverified, no
GPU here) the transfer buffers live on the group's GPU (``backend.collective_device``).
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from elasticd.worker.hot.backend import collective_device
from elasticd.worker.hot.errors import HealError
from elasticd.worker.hot.registered import capture, restore
from elasticd.worker.state import TrainingState

# One collective of the heal may take this long before the member is given up on; a 600 MB state took 2.5 s on
# loopback gloo here, so this is far above a healthy transfer and far below the group's timeout.
DEFAULT_HEAL_TIMEOUT = timedelta(minutes=2)
# Tensors are packed into flat buffers of at most this many bytes (a single larger tensor gets a buffer of its own):
# few collectives, and a bounded extra copy of the state in memory at a time.
DEFAULT_CHUNK_BYTES = 64 * 2**20

K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True, slots=True)
class HealReport:
    """What one member's heal moved; the source's ``bytes_sent`` is the figure for ``elasticd_heal_bytes_total``."""

    rank: int
    source: int
    world_size: int
    payload_bytes: int  # what each receiver got: the description plus every tensor
    tensors: int
    seconds: float

    @property
    def bytes_sent(self) -> int:
        """The payload once per receiver, on the source (whatever tree the backend used); 0 on the others."""
        return self.payload_bytes * (self.world_size - 1) if self.rank == self.source else 0


@dataclass(frozen=True, slots=True)
class _Slot:
    """Where a tensor stood in a state dict: its index in the transfer."""

    index: int


def order_by_progress(steps: Mapping[K, int]) -> list[K]:
    """Members, the one with the most committed steps first (ties: the smallest key), to be ranks 0, 1, ..."""
    return sorted(steps, key=lambda member: (-steps[member], member))


def heal(
    source: int,
    model: torch.nn.Module,
    optimizer: Any,
    scheduler: Any,
    state: TrainingState,
    *,
    registered: Sequence[Any] = (),
    group: dist.ProcessGroup | None = None,
    timeout: timedelta = DEFAULT_HEAL_TIMEOUT,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    clock: Callable[[], float] = time.monotonic,
) -> tuple[TrainingState, HealReport]:
    """Make this member's model, optimizer, scheduler and training state those of rank ``source`` (a collective).

    ``state`` is this member's training state (the one sent, on the source); the source's is returned. ``scheduler``
    may be None, on every member alike. ``registered``: the objects registered for checkpointing
    (``registered_objects(accelerator)``), loaded with the source's state as a restart would load them. ``group``
    defaults to the current default group; ``source`` is a rank in it. Gradients are cleared on every member: the
    next step starts from none.
    """
    started = clock()
    if group is None:
        group = dist.group.WORLD
        if group is None:
            raise RuntimeError("no process group to heal over: re-form first")
    rank, world_size = group.rank(), group.size()
    if not 0 <= source < world_size:
        raise ValueError(f"source rank {source} is outside the world of {world_size}")
    link = _Link(group, source, timeout)
    model_tensors = [t for _, t in model.named_parameters()] + [t for _, t in model.named_buffers()]
    own = _describe(model, optimizer, scheduler, registered)
    if world_size == 1:
        return state, HealReport(rank, source, world_size, 0, 0, clock() - started)

    if rank == source:
        state_tensors: list[torch.Tensor] = []
        description = {
            **own,
            "training": state.to_meta(),
            "optimizer": _detach(optimizer.state_dict(), state_tensors),
            "scheduler": None if scheduler is None else _detach(scheduler.state_dict(), state_tensors),
            "registered_state": capture(registered),
            "state_tensors": [(tuple(t.shape), t.dtype) for t in state_tensors],
        }
        blob = link.bytes(pickle.dumps(description))
    else:
        blob = link.bytes(None)
        description = pickle.loads(blob)
        state_tensors = [torch.empty(shape, dtype=dtype) for shape, dtype in description["state_tensors"]]
    mismatch = "" if rank == source else _mismatch(own, description)
    link.agree(mismatch)

    sources = [t.detach() for t in model_tensors] + state_tensors
    payload = len(blob) + 8 + link.tensors(sources, chunk_bytes)  # 8: the length sent first
    if rank != source:
        optimizer.load_state_dict(_attach(description["optimizer"], state_tensors))
        if scheduler is not None:
            scheduler.load_state_dict(_attach(description["scheduler"], state_tensors))
        try:
            restore(registered, description["registered_state"])
        except Exception as exc:  # the types agreed: an object refused its own kind of state
            raise HealError(f"loading the objects registered for checkpointing failed: {exc}", source=source) from exc
        state = TrainingState.from_meta(description["training"])
    for parameter in model.parameters():
        parameter.grad = None
    count = len(model_tensors) + len(state_tensors)
    return state, HealReport(rank, source, world_size, payload, count, clock() - started)


class _Link:
    """The heal's collectives over one group, each with a bounded wait."""

    def __init__(self, group: dist.ProcessGroup, source: int, timeout: timedelta) -> None:
        # Collectives on the group object (what dist.broadcast calls underneath): ranks are the group's own, and
        # the group need not be in torch's registry.
        self.group = group
        self.source = source
        self.is_source = group.rank() == source
        self.timeout = timeout
        self.device = collective_device(group)

    def _wait(self, work: Any, what: str) -> None:
        try:
            work.wait(self.timeout)
        except Exception as exc:
            raise HealError(f"{what} failed: {exc}", source=self.source) from exc

    def _broadcast(self, tensor: torch.Tensor, what: str) -> None:
        try:
            options = dist.BroadcastOptions()
            options.rootRank = self.source
            work = self.group.broadcast([tensor], options)
        except Exception as exc:
            raise HealError(f"{what} failed: {exc}", source=self.source) from exc
        self._wait(work, what)

    def bytes(self, data: bytes | None) -> bytes:
        size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64, device=self.device)
        self._broadcast(size, "sending the state's description")
        buffer = (
            torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
            if data is not None
            else torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        )
        self._broadcast(buffer, "sending the state's description")
        return data if data is not None else buffer.cpu().numpy().tobytes()

    def agree(self, mismatch: str) -> None:
        """Every member learns whether any member cannot take the source's state; all raise together if so."""
        flag = torch.tensor([1 if mismatch else 0], dtype=torch.int32, device=self.device)
        try:
            options = dist.AllreduceOptions()
            options.reduceOp = dist.ReduceOp(dist.ReduceOp.MAX)
            work = self.group.allreduce([flag], options)
        except Exception as exc:
            raise HealError(f"agreeing on the state's shape failed: {exc}", source=self.source) from exc
        self._wait(work, "agreeing on the state's shape")
        if flag.item():
            detail = mismatch or "another member's objects do not match this one's"
            raise HealError(f"the state does not fit: {detail}", source=self.source)

    def tensors(self, tensors: list[torch.Tensor], chunk_bytes: int) -> int:
        """Broadcast ``tensors`` in flat buffers; receivers get them written into the same tensors. Bytes moved."""
        moved = 0
        for chunk in _chunks(tensors, chunk_bytes):
            dtype = chunk[0].dtype
            if self.is_source:
                flat = torch.cat([t.reshape(-1).to(self.device) for t in chunk])
            else:
                flat = torch.empty(sum(t.numel() for t in chunk), dtype=dtype, device=self.device)
            self._broadcast(flat, f"sending {len(chunk)} tensors of {dtype}")
            moved += flat.numel() * flat.element_size()
            if not self.is_source:
                offset = 0
                with torch.no_grad():
                    for target in chunk:
                        target.copy_(flat[offset : offset + target.numel()].view(target.shape))
                        offset += target.numel()
        return moved


def _chunks(tensors: list[torch.Tensor], chunk_bytes: int) -> Iterable[list[torch.Tensor]]:
    """Consecutive runs of one dtype, each at most ``chunk_bytes`` unless a single tensor is larger."""
    chunk: list[torch.Tensor] = []
    size = 0
    for tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if chunk and (tensor.dtype != chunk[0].dtype or size + nbytes > chunk_bytes):
            yield chunk
            chunk, size = [], 0
        chunk.append(tensor)
        size += nbytes
    if chunk:
        yield chunk


def _describe(model: torch.nn.Module, optimizer: Any, scheduler: Any, registered: Sequence[Any]) -> dict[str, Any]:
    """What must match between source and receivers: the model's tensors, the optimizer's groups, the scheduler and
    the objects registered for checkpointing."""
    tensors = [*model.named_parameters(), *model.named_buffers()]
    return {
        "model": [(name, tuple(t.shape), str(t.dtype)) for name, t in tensors],
        "param_groups": [len(g["params"]) for g in optimizer.state_dict()["param_groups"]],
        "has_scheduler": scheduler is not None,
        "registered": [type(obj).__qualname__ for obj in registered],
    }


def _mismatch(own: Mapping[str, Any], source: Mapping[str, Any]) -> str:
    if own["model"] != source["model"]:
        theirs = {name: (shape, dtype) for name, shape, dtype in source["model"]}
        mine = {name: (shape, dtype) for name, shape, dtype in own["model"]}
        differing = sorted(set(theirs.items()) ^ set(mine.items()))
        names = ", ".join(sorted({name for name, _ in differing})[:5])
        return f"the model's parameters differ from the source's ({names})"
    if own["param_groups"] != source["param_groups"]:
        return f"optimizer parameter groups {own['param_groups']}, the source has {source['param_groups']}"
    if own["has_scheduler"] != source["has_scheduler"]:
        return "a scheduler on one side only"
    if own["registered"] != source["registered"]:
        return f"objects registered for checkpointing {own['registered']}, the source has {source['registered']}"
    return ""


def _detach(value: Any, tensors: list[torch.Tensor]) -> Any:
    """``value`` with each tensor replaced by its :class:`_Slot`; the tensors are appended to ``tensors``."""
    if isinstance(value, torch.Tensor):
        tensors.append(value.detach())
        return _Slot(len(tensors) - 1)
    if isinstance(value, dict):
        return {key: _detach(item, tensors) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return _rebuilt(value, [_detach(item, tensors) for item in value])
    return value


def _attach(value: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(value, _Slot):
        return tensors[value.index]
    if isinstance(value, dict):
        return {key: _attach(item, tensors) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return _rebuilt(value, [_attach(item, tensors) for item in value])
    return value


def _rebuilt(original: list[Any] | tuple[Any, ...], items: list[Any]) -> Any:
    if hasattr(original, "_fields"):  # a named tuple takes its fields as arguments
        return type(original)(*items)
    return type(original)(items)
