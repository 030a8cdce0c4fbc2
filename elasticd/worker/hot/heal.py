"""Healing: the members of a new group whose state is not the source's take it, from every member whose state is.

After a failure the survivors may be a step apart (a peer can die after one survivor's last all-reduce completed and
before another's did); a joiner has only freshly initialised objects. The source is the member with the most
committed steps (:func:`order_by_progress` makes it rank 0). :func:`heal` makes every member equal to it: parameters
and buffers of the prepared model, the optimizer's and the scheduler's state dicts, the objects the script
registered for checkpointing (as a restart loads them: ``registered.py``) and the
:class:`~elasticd.worker.state.TrainingState` (step count, data position, skipped batches). RNG streams are not
copied: they are per rank, and the worker library derives them from (seed, step, rank) after any resume.

What moves, and from where:
1. every member's fingerprint (``fingerprint.py``), in one all-gather. Members whose fingerprint equals the source's
   are **senders**, the others **receivers**. No receiver (a node loss, where the survivors stand at the same step
   boundary): nothing more happens, not a byte of state moves;
2. the source sends each receiver the pickled description (state-dict structure, tensor shapes and dtypes, training
   state, the registered objects' ``torch.save`` bytes; pickled as torch's own ``broadcast_object_list`` does,
   between members of one job), point to point;
3. one agreement (all-reduce) that every receiver's objects fit the source's, so that all members fail together
   instead of one waiting on the others;
4. the tensors in stripes from all senders at once, each piece checked on arrival (``stripes.py``).

Every operation has a bounded wait: a member that dies or hangs during the heal raises
:class:`~elasticd.worker.hot.errors.HealError` on the others instead of blocking them until the group's timeout, and
with ``abandon`` (the new epoch's failure notice, ``watch.py``) a member waiting on a live peer that already gave up
is released within ``link.ABANDON_POLL_S``: only the direct peers of a dead member see gloo report it. The error says
whether this member still holds a state to give (``holds_state``: False on a receiver, whose tensors may be half
written), so that the survivors can heal again from the members that hold it (``session.py``). On NCCL
(unverified, no GPU here) the transfer buffers live on the group's GPU (``backend.collective_device``).
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from elasticd.worker.hot.errors import HealError
from elasticd.worker.hot.fingerprint import fingerprint
from elasticd.worker.hot.link import DEFAULT_HEAL_TIMEOUT, HealLink
from elasticd.worker.hot.registered import capture, restore
from elasticd.worker.hot.stripes import Layout, receive_stripes, send_stripes
from elasticd.worker.state import TrainingState

# The tensors' bytes travel in pieces of at most this many bytes (``stripes.py``): few messages, and a sender dying
# mid-heal leaves at most a few pieces in flight.
DEFAULT_CHUNK_BYTES = 64 * 2**20

K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True, slots=True)
class HealReport:
    """What one member's heal moved. ``received``/``sent`` count this member's bytes on the wire (description and
    pieces, their padding and trailers); their sum is its share of ``elasticd_heal_bytes_total``."""

    rank: int
    source: int
    world_size: int
    receivers: tuple[int, ...]  # the ranks whose fingerprint differed from the source's: the only ones healed
    received: int
    sent: int
    tensors: int
    seconds: float

    @property
    def healed(self) -> bool:
        """This member took the source's state."""
        return self.rank in self.receivers

    @property
    def bytes_moved(self) -> int:
        return self.received + self.sent


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
    abandon: Callable[[], str | None] | None = None,
    before_piece: Callable[[int], None] | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> tuple[TrainingState, HealReport]:
    """Make this member's model, optimizer, scheduler and training state those of rank ``source`` (a collective).

    ``state`` is this member's training state (the one sent, on the source); the source's is returned. ``scheduler``
    may be None, on every member alike. ``registered``: the objects registered for checkpointing
    (``registered_objects(accelerator)``), loaded with the source's state as a restart would load them. ``group``
    defaults to the current default group; ``source`` is a rank in it. Only members whose fingerprint differs from
    the source's receive anything; every member whose fingerprint equals it sends a stripe of the tensors. Gradients
    are cleared on every member: the next step starts from none.

    ``abandon()``: a reason to give the heal up (another member failed it), asked while an operation waits; None
    waits each operation out to ``timeout``. ``before_piece(piece)`` is called before this member sends a piece (the
    fault injector's hook, ``worker/faults.py``). A :class:`HealError` raised on a receiver has ``holds_state`` False.
    """
    started = clock()
    if group is None:
        group = dist.group.WORLD
        if group is None:
            raise RuntimeError("no process group to heal over: re-form first")
    rank, world_size = group.rank(), group.size()
    if not 0 <= source < world_size:
        raise ValueError(f"source rank {source} is outside the world of {world_size}")
    if world_size == 1:
        return state, HealReport(rank, source, world_size, (), 0, 0, 0, clock() - started)
    link = HealLink(group, source, timeout, abandon)
    try:
        prints = link.gather(fingerprint(model, optimizer, scheduler, registered, state))
        receivers = tuple(r for r in range(world_size) if not torch.equal(prints[r], prints[source]))
        senders = [r for r in range(world_size) if r not in receivers]
        try:
            state, received, sent, count = _move_state(
                link, model, optimizer, scheduler, state, registered, receivers, senders, chunk_bytes, before_piece
            )
        except HealError as exc:
            exc.holds_state = rank not in receivers
            raise
    finally:
        link.close()
    for parameter in model.parameters():
        parameter.grad = None
    return state, HealReport(rank, source, world_size, receivers, received, sent, count, clock() - started)


def _move_state(
    link: HealLink,
    model: torch.nn.Module,
    optimizer: Any,
    scheduler: Any,
    state: TrainingState,
    registered: Sequence[Any],
    receivers: tuple[int, ...],
    senders: list[int],
    chunk_bytes: int,
    before_piece: Callable[[int], None] | None,
) -> tuple[TrainingState, int, int, int]:
    """Steps 2-4 of the module's docstring: the state this member goes on with, bytes received and sent, tensors."""
    rank, source = link.group.rank(), link.source
    received = sent = count = 0
    if receivers:
        own = _describe(model, optimizer, scheduler, registered)
        state_tensors: list[torch.Tensor] = []
        description: dict[str, Any] | None = None
        if rank in receivers:
            blob = link.recv_bytes(source)
            received += len(blob) + 8  # 8: the length sent first
            description = pickle.loads(blob)
            state_tensors = [torch.empty(shape, dtype=dtype) for shape, dtype in description["state_tensors"]]
        else:
            # a sender's own state is the source's (equal fingerprints): its tensors are in the same order
            optimizer_state = _detach(optimizer.state_dict(), state_tensors)
            scheduler_state = None if scheduler is None else _detach(scheduler.state_dict(), state_tensors)
            if rank == source:
                blob = pickle.dumps(
                    {
                        **own,
                        "training": state.to_meta(),
                        "optimizer": optimizer_state,
                        "scheduler": scheduler_state,
                        "registered_state": capture(registered),
                        "state_tensors": [(tuple(t.shape), t.dtype) for t in state_tensors],
                    }
                )
                sent += link.send_bytes(blob, receivers)
        link.agree("" if description is None else _mismatch(own, description), "the state does not fit")
        model_tensors = [t for _, t in model.named_parameters()] + [t for _, t in model.named_buffers()]
        tensors = [t.detach() for t in model_tensors] + state_tensors
        layout = Layout.of(tensors, chunk_bytes)
        count = len(tensors)
        problem = ""
        if description is None:
            sent += send_stripes(link, tensors, layout, senders, rank, receivers, before_piece)
        else:
            try:
                received += receive_stripes(link, tensors, layout, senders)
            except HealError as exc:  # a piece that failed its checksum, a sender gone: all members learn it
                problem = str(exc)
        link.agree(problem, "a receiver did not get the state")
        if description is not None:
            state = _load(description, state_tensors, optimizer, scheduler, registered, source)
    return state, received, sent, count


def _load(
    description: Mapping[str, Any],
    state_tensors: list[torch.Tensor],
    optimizer: Any,
    scheduler: Any,
    registered: Sequence[Any],
    source: int,
) -> TrainingState:
    """A receiver takes the source's optimizer, scheduler and registered objects' state; the source's progress."""
    optimizer.load_state_dict(_attach(description["optimizer"], state_tensors))
    if scheduler is not None:
        scheduler.load_state_dict(_attach(description["scheduler"], state_tensors))
    try:
        restore(registered, description["registered_state"])
    except Exception as exc:  # the types agreed: an object refused its own kind of state
        raise HealError(f"loading the objects registered for checkpointing failed: {exc}", source=source) from exc
    return TrainingState.from_meta(description["training"])


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
