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
is released within ``_ABANDON_POLL_S``: only the direct peers of a dead member see gloo report it. The error says
whether this member still holds a state to give (``holds_state``: False on a receiver, whose tensors may be half
written), so that the survivors can heal again from the members that hold it (``session.py``). On NCCL
(unverified, no GPU here) the transfer buffers live on the group's GPU (``backend.collective_device``).
"""

from __future__ import annotations

import pickle
import queue
import threading
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from elasticd.worker.hot.backend import collective_device
from elasticd.worker.hot.errors import HealAbandoned, HealError
from elasticd.worker.hot.fingerprint import fingerprint
from elasticd.worker.hot.given_up import GIVEN_UP
from elasticd.worker.hot.registered import capture, restore
from elasticd.worker.hot.stripes import DESCRIPTION_TAG, Layout, receive_stripes, send_stripes
from elasticd.worker.state import TrainingState

# One collective of the heal may take this long before the member is given up on; a 600 MB state took 2.5 s on
# loopback gloo here, so this is far above a healthy transfer and far below the group's timeout.
DEFAULT_HEAL_TIMEOUT = timedelta(minutes=2)
# The tensors' bytes travel in pieces of at most this many bytes (``stripes.py``): few messages, and a sender dying
# mid-heal leaves at most a few pieces in flight.
DEFAULT_CHUNK_BYTES = 64 * 2**20
# While a heal's operation waits on a peer, it looks this often (seconds) whether the epoch was given up elsewhere.
_ABANDON_POLL_S = 0.05

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
    link = _Link(group, source, timeout, abandon)
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
    link: _Link,
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


class _Link:
    """The heal's operations over one group, each with a bounded wait (``stripes.Link`` and the collectives)."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        source: int,
        timeout: timedelta,
        abandon: Callable[[], str | None] | None = None,
    ) -> None:
        # Operations on the group object (what dist.broadcast calls underneath): ranks are the group's own, and
        # the group need not be in torch's registry.
        self.group = group
        self.source = source
        self.timeout = timeout
        self.abandon = abandon
        self.device = collective_device(group)
        self._waiter = None if abandon is None else _Waiter(timeout)

    def wait(self, work: Any, what: str) -> None:
        if self._waiter is None or self.abandon is None:
            try:
                work.wait(self.timeout)
            except Exception as exc:
                GIVEN_UP.hold(work, self.group)  # timed out, it may still be pending: held until it has ended
                raise HealError(f"{what} failed: {exc}", source=self.source) from exc
            return
        finished, failures = self._waiter.submit(work)
        while not finished.wait(_ABANDON_POLL_S):
            reason = self.abandon()
            if reason is not None:
                GIVEN_UP.hold(work, self.group)  # gloo cannot cancel it: held until it has ended (given_up.py)
                raise HealAbandoned(f"{what} was given up: {reason}", source=self.source)
        if failures:
            GIVEN_UP.hold(work, self.group)  # a wait that timed out leaves it pending: held until it has ended
            raise HealError(f"{what} failed: {failures[0]}", source=self.source) from failures[0]

    def close(self) -> None:
        if self._waiter is not None:
            self._waiter.close()

    def _issue(self, issue: Callable[[], Any], what: str) -> Any:
        try:
            return issue()
        except Exception as exc:
            raise HealError(f"{what} failed: {exc}", source=self.source) from exc

    def send(self, tensor: torch.Tensor, peer: int, tag: int, what: str) -> Any:
        return self._issue(lambda: self.group.send([tensor], peer, tag), what)

    def recv(self, tensor: torch.Tensor, peer: int, tag: int, what: str) -> Any:
        return self._issue(lambda: self.group.recv([tensor], peer, tag), what)

    def gather(self, value: torch.Tensor) -> list[torch.Tensor]:
        """Every member's ``value`` (same shape everywhere), by rank."""
        what = "agreeing on the state's fingerprint"
        mine = value.to(self.device)
        out = [torch.empty_like(mine) for _ in range(self.group.size())]
        self.wait(self._issue(lambda: self.group.allgather([out], [mine]), what), what)
        return [t.cpu() for t in out]

    def send_bytes(self, data: bytes, receivers: Sequence[int]) -> int:
        """Send ``data`` (its length first) to every receiver. Bytes sent."""
        what = "sending the state's description"
        size = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
        works = [self.send(size, r, DESCRIPTION_TAG, what) for r in receivers]
        works += [self.send(buffer, r, DESCRIPTION_TAG + 1, what) for r in receivers]
        for work in works:
            self.wait(work, what)
        return (len(data) + 8) * len(receivers)

    def recv_bytes(self, sender: int) -> bytes:
        what = "receiving the state's description"
        size = torch.empty(1, dtype=torch.int64, device=self.device)
        self.wait(self.recv(size, sender, DESCRIPTION_TAG, what), what)
        buffer = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        self.wait(self.recv(buffer, sender, DESCRIPTION_TAG + 1, what), what)
        return buffer.cpu().numpy().tobytes()

    def agree(self, problem: str, verdict: str) -> None:
        """Every member learns whether any member has a ``problem``; all raise together (``verdict``) if so."""
        what = f"agreeing on the heal ({verdict}?)"
        flag = torch.tensor([1 if problem else 0], dtype=torch.int32, device=self.device)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp(dist.ReduceOp.MAX)
        self.wait(self._issue(lambda: self.group.allreduce([flag], options), what), what)
        if flag.item():
            raise HealError(f"{verdict}: {problem or 'another member reported it'}", source=self.source)


class _Waiter:
    """Waits out the heal's operations one after the other on a thread of its own, while the heal's thread looks for
    a reason to give up (``_Link.wait``): gloo's point-to-point work has no future and no working ``is_completed()``,
    and a wait that times out closes the connection to the peer ("Application timeout caused pair closure"). The heal
    waits for its operations in the order it submits them, so one thread serves them all."""

    def __init__(self, timeout: timedelta) -> None:
        self._timeout = timeout
        self._jobs: queue.SimpleQueue[tuple[Any, threading.Event, list[Exception]] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, work: Any) -> tuple[threading.Event, list[Exception]]:
        """Wait for ``work``: the event is set when it completed or failed (then its error is in the list)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="elasticd-heal-wait", daemon=True)
            self._thread.start()
        finished, failures = threading.Event(), list[Exception]()
        self._jobs.put((work, finished, failures))
        return finished, failures

    def close(self) -> None:
        """The thread ends after the operation it waits for now, if any (one given up on: at its timeout)."""
        if self._thread is not None:
            self._jobs.put(None)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            work, finished, failures = job
            try:
                work.wait(self._timeout)
            except Exception as exc:
                failures.append(exc)
            finally:
                finished.set()


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
