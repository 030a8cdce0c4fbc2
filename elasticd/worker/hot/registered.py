"""Objects registered with ``accelerator.register_for_checkpointing``, carried through recovery in place.

A restart brings them back through accelerate's ``load_state``: rank 0's ``state_dict()`` written with
``torch.save`` and read on every rank with ``torch.load(map_location="cpu")`` into ``load_state_dict``. Recovery in
place keeps the processes, so it must leave them the same way itself (DESIGN.md §3), at two moments:

- **a discarded step**: the step's all-reduce failed and its optimizer step was skipped, but the script's own code
  after ``optimizer.step()`` ran anyway (a step counter incremented, an EMA updated from unchanged weights).
  :class:`Rollback` keeps their state when the failed-step guard skips the optimizer step, before that code runs,
  and puts it back at the step boundary;
- **a heal** (a joiner, a member a step behind): ``heal.py`` sends the source's :func:`capture` and every receiver
  :func:`restore`\\ s it.

Both go through :func:`capture` and :func:`restore`, the same ``torch.save``/``torch.load`` round trip a restart
takes, so tensors and plain Python values come back exactly as a restart from that step would give them.

Why a snapshot only when a step fails, never every step: a registered object may be as large as the model (an EMA
copy), and a copy per step would cost a model-sized memory copy on every healthy step. Every way a step is
discarded is known before ``optimizer.step()`` returns: the failure is recorded while one of the step's buckets
is in flight (a failed or timed-out all-reduce, a peer's failure notice: DDP's backward waits for every bucket), or
on the training thread between two steps (a failed checkpoint agreement fails the *next* step, before its
backward). What the script changes in a registered object before ``optimizer.step()`` of a failed step (in its
forward pass) is not undone.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from typing import Any

import torch


def registered_objects(accelerator: Any) -> list[Any]:
    """The objects the script registered for checkpointing, in registration order (accelerate's checkpoint
    files are numbered by it)."""
    return list(getattr(accelerator, "_custom_objects", ()))


def capture(objects: Sequence[Any]) -> bytes:
    """Every object's ``state_dict()``, serialised as accelerate's ``save_state`` writes it (``torch.save``)."""
    buffer = io.BytesIO()
    torch.save([obj.state_dict() for obj in objects], buffer)
    return buffer.getvalue()


def restore(objects: Sequence[Any], blob: bytes) -> None:
    """Load a :func:`capture` into ``objects`` as accelerate's ``load_state`` would (on the CPU, then
    ``load_state_dict``). Raises ``ValueError`` when it holds another number of objects."""
    # weights_only=False, as accelerate loads them: any picklable value, from a member of the same job
    states = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=False)
    if len(states) != len(objects):
        raise ValueError(f"{len(states)} registered objects were captured, this process has {len(objects)}")
    for obj, state in zip(objects, states, strict=True):
        obj.load_state_dict(state)


class Rollback:
    """The registered objects' state from before a failed step's post-step code, put back at its boundary."""

    def __init__(self, objects: Callable[[], Sequence[Any]]) -> None:
        """``objects`` is asked each time: a script may register objects after the hot path is armed."""
        self._objects = objects
        self._kept: tuple[Sequence[Any], bytes] | None = None

    def keep(self) -> None:
        """The current step is discarded: keep the objects' state (once per step; later calls keep the first)."""
        if self._kept is None:
            objects = self._objects()
            if objects:
                self._kept = (objects, capture(objects))

    def restore(self) -> bool:
        """At the boundary of a discarded step: put the kept state back. False when nothing was kept."""
        if self._kept is None:
            return False
        (objects, blob), self._kept = self._kept, None
        restore(objects, blob)
        return True
