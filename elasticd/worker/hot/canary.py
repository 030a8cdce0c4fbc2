"""The private torch and accelerate surfaces the hot path relies on, and a check that they are still there.

Hot recovery on torch 2.13 has no public API to move a prepared model to another process group, so it reaches into
DDP's reducer and accelerate's shared state. :data:`SURFACES` lists every such attribute with a check of what we use
it for (present, callable with the parameters we pass, or still doing what we rely on, read from its source).
:func:`require_surfaces` runs at the start of the hot path and raises one error naming every attribute that moved
and the versions the list was checked with, so an upgrade that breaks hot recovery fails at start (and in the canary
test), never in the middle of a recovery. A surface only one backend's path uses names that backend; the NCCL ones
are read from torch's code and were never exercised here (no GPU).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import accelerate
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from accelerate import Accelerator
from accelerate.checkpointing import load_custom_state
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.scheduler import AcceleratedScheduler
from accelerate.state import AcceleratorState, PartialState
from torch.nn.parallel import DistributedDataParallel

from elasticd.worker.hot.errors import SurfaceChanged

# The releases the surfaces below were read from and the hot path was tested with (major.minor).
CHECKED_WITH = {"torch": "2.13", "accelerate": "1.15"}


@dataclass(frozen=True, slots=True)
class Surface:
    """One private attribute: ``name`` as a reader would look it up, ``use`` what the hot path does with it."""

    name: str
    use: str
    check: Callable[[], str | None]  # None when it is as expected, else what is wrong
    backend: str | None = None  # the one backend whose path uses it; None: every backend's


def _has(owner: object, attribute: str) -> Callable[[], str | None]:
    def check() -> str | None:
        return None if callable(getattr(owner, attribute, None)) else "missing"

    return check


def _params(function: Callable[[], object] | None, expected: tuple[str, ...]) -> str | None:
    if function is None or not callable(function):
        return "missing"
    try:
        found = tuple(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return "its signature cannot be read"
    return None if found == expected else f"parameters {found}, expected {expected}"


def _source_mentions(function: object, *needles: str) -> str | None:
    if function is None:
        return "missing"
    try:
        source = inspect.getsource(function)  # type: ignore[arg-type]  # TypeError caught below
    except (OSError, TypeError):
        return "its source cannot be read"
    absent = [n for n in needles if n not in source]
    return None if not absent else f"no longer contains {', '.join(repr(n) for n in absent)}"


def _update_process_group() -> str | None:
    method = getattr(DistributedDataParallel, "_update_process_group", None)
    problem = _params(method, ("self", "new_process_group"))
    return problem or _source_mentions(method, "self.reducer._reset_state()", "self.reducer._update_process_group(")


def _shared_state(cls: type) -> Callable[[], str | None]:
    def check() -> str | None:
        if not isinstance(getattr(cls, "_shared_state", None), dict):
            return "missing or not a dict"
        # instances are views of the class-level dict: num_processes and process_index live in it
        return _source_mentions(vars(cls).get("__init__"), "self.__dict__ = self._shared_state")

    return check


def _custom_objects() -> str | None:
    # the list register_for_checkpointing extends and save_state/load_state walk; registered.py copies their round
    # trip (torch.save, then torch.load onto the CPU into load_state_dict)
    return (
        _source_mentions(vars(Accelerator).get("__init__"), "self._custom_objects = []")
        or _source_mentions(Accelerator.register_for_checkpointing, "self._custom_objects.extend(")
        or _source_mentions(load_custom_state, 'map_location="cpu"', "obj.load_state_dict(")
    )


def _reducer() -> type | None:
    return getattr(dist, "Reducer", None)


def _abort_process_group() -> str | None:
    function = getattr(c10d, "_abort_process_group", None)
    problem = _params(function, ("group",))
    # aborts every group's communicators and clears torch's registry without a shutdown (which could wait on a
    # dead peer)
    return problem or _source_mentions(function, ".abort()", "_update_default_pg(None)")


def _shrink_group() -> str | None:
    if not isinstance(getattr(c10d, "SHRINK_ABORT", None), int):
        return "SHRINK_ABORT is missing"
    return _params(getattr(dist, "shrink_group", None), ("ranks_to_exclude", "group", "shrink_flags", "pg_options"))


def _backend_shrinking() -> str | None:
    backend = getattr(torch._C._distributed_c10d, "Backend", None)
    if not isinstance(getattr(backend, "supports_shrinking", None), property):
        return "Backend.supports_shrinking is missing"
    return _has(dist.ProcessGroup, "_get_backend")()


SURFACES: tuple[Surface, ...] = (
    Surface(
        "torch.nn.parallel.DistributedDataParallel._update_process_group",
        "moves the prepared model to the new group and resets its reducer",
        _update_process_group,
    ),
    Surface(
        "torch.nn.parallel.DistributedDataParallel._has_rebuilt_buckets",
        "set after the bucket re-sync, as DDP's own forward pass would",
        lambda: _source_mentions(vars(DistributedDataParallel).get("__init__"), "self._has_rebuilt_buckets"),
    ),
    Surface(
        "torch.distributed.Reducer._push_all_rebuilt_params",
        "bucket re-sync: every parameter counts as rebuilt, in parameter order",
        lambda: _has(_reducer(), "_push_all_rebuilt_params")(),
    ),
    Surface(
        "torch.distributed.Reducer._rebuild_buckets",
        "bucket re-sync: rebuilds now, broadcasting rank 0's bucket indices",
        lambda: _has(_reducer(), "_rebuild_buckets")(),
    ),
    Surface(
        "accelerate.state.PartialState._shared_state",
        "num_processes and process_index of the new group",
        _shared_state(PartialState),
    ),
    Surface(
        "accelerate.state.AcceleratorState._shared_state",
        "num_processes and process_index of the new group (a second copy)",
        _shared_state(AcceleratorState),
    ),
    Surface(
        "accelerate.optimizer.AcceleratedOptimizer._is_overflow",
        "skips the optimizer step of a failed step, and with it the scheduler's",
        lambda: (
            _source_mentions(vars(AcceleratedOptimizer).get("__init__"), "self._is_overflow")
            or _source_mentions(getattr(AcceleratedOptimizer.step_was_skipped, "fget", None), "self._is_overflow")
            or _source_mentions(AcceleratedScheduler.step, "step_was_skipped")
        ),
    ),
    Surface(
        "accelerate.Accelerator.step",
        "the micro-batch counter that decides when to sync, restarted at a new world size",
        lambda: _source_mentions(getattr(Accelerator, "_do_sync", None), "self.step"),
    ),
    Surface(
        "accelerate.Accelerator._custom_objects",
        "the objects registered for checkpointing: rolled back after a discarded step, healed to every member",
        _custom_objects,
    ),
    Surface(
        "torch.distributed.distributed_c10d._abort_process_group",
        "retires the old NCCL group: ncclCommAbort on its communicators, no shutdown",
        _abort_process_group,
        backend="nccl",
    ),
    Surface(
        "torch.distributed.distributed_c10d.SHRINK_ABORT",
        "shrink_group(excluded, shrink_flags=SHRINK_ABORT) after a node loss on NCCL",
        _shrink_group,
        backend="nccl",
    ),
    Surface(
        "torch.distributed.ProcessGroup._get_backend",
        "asks the NCCL backend whether it can shrink (supports_shrinking) before announcing it",
        _backend_shrinking,
        backend="nccl",
    ),
    Surface(
        "accelerate.state.PartialState.use_distributed",
        "a GPU joiner's world of one shows more processes so that prepare() wraps DDP (expect_world)",
        lambda: _source_mentions(getattr(PartialState.use_distributed, "fget", None), "self.num_processes > 1"),
        backend="nccl",
    ),
)


def problems(backend: str | None = None) -> list[str]:
    """One line per surface that moved: the attribute, what is wrong, and what the hot path uses it for.

    ``backend``: only the surfaces the hot path on that backend uses; None: all of them (the canary test)."""
    found = []
    for surface in SURFACES:
        if backend is not None and surface.backend not in (None, backend):
            continue
        try:
            problem = surface.check()
        except Exception as exc:  # a check that cannot even run is a moved surface too
            problem = f"check failed: {exc!r}"
        if problem is not None:
            found.append(f"{surface.name}: {problem} (used to: {surface.use})")
    return found


def versions_line() -> str:
    checked = ", ".join(f"{name} {version}.x" for name, version in CHECKED_WITH.items())
    return f"checked with {checked}; this process has torch {torch.__version__}, accelerate {accelerate.__version__}"


def require_surfaces(backend: str | None = None) -> None:
    """Raise :class:`SurfaceChanged` naming every private attribute that moved, and the versions checked; on
    ``backend``'s path only, when given."""
    found = problems(backend)
    if found:
        lines = "\n  ".join(found)
        raise SurfaceChanged(
            f"hot recovery relies on private torch/accelerate attributes that moved ({versions_line()}):\n  {lines}"
        )
