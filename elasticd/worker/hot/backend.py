"""What re-forming needs from each collective backend: retire the old group, form the new one, the workers' env.

:class:`~elasticd.worker.hot.reform.Reformer` is the same for every backend; :func:`groups_for` picks one of the
classes below by the backend of the group the job trains in:

- :class:`GlooGroups` (CPU): gloo in torch 2.13 cannot abort a pending collective (``abort()``, ``shutdown()`` and
  ``destroy_process_group()`` return while the operation waits for the group's timeout), so the old group is taken
  out of torch's registry and *kept referenced* (:class:`AbandonedGroups`) until no collective given up on in it is
  pending (``given_up.py``); dropping it earlier would run its destructor, which joins gloo's threads and blocks.
  The new group is formed over the store, once every member has reached it (:func:`await_members`).
- :class:`NcclGroups` (GPU). **Unverified: written from torch 2.13's code and NCCL's documents, never run here (no
  GPU); ``bench/gpu_check.sh`` is the check to run the day one is lent.** ``ncclCommAbort`` ends pending kernels,
  so the old group is aborted (``TORCH_NCCL_USE_COMM_NONBLOCKING=1`` keeps the abort itself from hanging). A pure
  shrink (members lost, none added, the survivors' order kept) goes through ``dist.shrink_group(...,
  SHRINK_ABORT)`` (``ncclCommShrink``, NCCL >= 2.27): no new bootstrap. Anything else gets a new communicator over
  the store (NCCL's unique id travels through it).

Whether to shrink is decided *for* the members, never by each alone: ``ncclCommShrink`` is collective, and a
survivor that shrinks while another forms a new communicator leaves both waiting. The caller passes the same
``previous_ranks`` to every member (from the membership decision) only when every member said it can shrink
(:meth:`Groups.can_shrink`); each member then checks the same condition (:func:`shrink_exclusions`).

:func:`worker_env` gives the daemon the environment a worker needs for hot recovery (the NCCL watchdog must keep the
process on an error: torch's default tears it down).
"""

from __future__ import annotations

import abc
import ctypes
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any, ClassVar

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from accelerate.utils import DistributedType
from torch._C._distributed_c10d import ErrorType

from elasticd import envvars
from elasticd.worker.hot.errors import ReformError, UnsupportedSetup
from elasticd.worker.hot.given_up import GIVEN_UP, GivenUp

# Where each member of a group about to form marks its arrival (outside torch's per-group key prefixes).
_ARRIVED_KEY = "elasticd_arrived/"
# How often the end of the run looks again for old groups to release, while the peers release theirs.
_DRAIN_POLL_S = 0.05
# torch's TORCH_NCCL_ASYNC_ERROR_HANDLING modes that end the process on an NCCL error or timeout (1: TearDown,
# 3: SkipCleanUp, torch's default); 0 (NoHandling) and 2 (CleanUpOnly: abort the communicators, keep the process)
# leave it to us.
_TEARS_DOWN = frozenset({"1", "3"})
# The NCCL error-handling mode we ask for: a failed or timed-out collective aborts its communicators and raises, the
# process lives on to re-form.
_NCCL_CLEAN_UP_ONLY = "2"


class AbandonedGroups:
    """Old gloo groups, each held until no collective given up on in it is pending (``given_up.py``)."""

    def __init__(self, given_up: GivenUp = GIVEN_UP, clock: Callable[[], float] = time.monotonic) -> None:
        self._given_up = given_up
        self._clock = clock
        self._held: list[dist.ProcessGroup] = []

    def keep(self, group: dist.ProcessGroup) -> None:
        self._held.append(group)

    def sweep(self) -> int:
        """Release the groups in which nothing given up on is pending; returns how many were released.

        Releasing one closes its connections, which ends what its peers still wait for in it."""
        kept = [group for group in self._held if self._given_up.pending(group)]
        released = len(self._held) - len(kept)
        self._held = kept  # the released groups' destructors run here: nothing of theirs is pending, it is quick
        return released

    def drain(self, timeout_s: float, interval_s: float = _DRAIN_POLL_S) -> int:
        """Sweep until no group is held or ``timeout_s`` has passed (the end of the run: the peers release theirs
        meanwhile); returns how many are still held."""
        deadline = self._clock() + timeout_s
        while True:
            self.sweep()
            if not self._held or self._clock() >= deadline:
                return len(self._held)
            time.sleep(interval_s)

    def __len__(self) -> int:
        return len(self._held)

    def leak(self) -> int:
        """At the end of the run, for the groups :meth:`drain` could not release: never destroy them (returns how
        many). Interpreter teardown would otherwise run their destructors, each waiting out a pending collective
        for the group's timeout (up to torch's 30 minutes for the first group). One extra reference each keeps them
        alive until the operating system reclaims the process (which the exit guard then ends: ``exit_guard.py``).
        """
        for group in self._held:
            keep_forever(group)
        leaked = len(self._held)
        self._held = []
        return leaked


def await_members(store: dist.Store, rank: int, world_size: int) -> None:
    """Return once every member of the group about to form has reached ``store``; ``DistStoreError`` after the
    store's timeout otherwise.

    A backend's own formation waits for a missing member for the *group's* timeout, not the store's: gloo's waits
    for a peer's address use the group's (measured: a 1 s store under an 8 s group waited 8 s), which is 10 minutes
    for a group hot recovery forms. A member that died or fell back between the decision and the formation would
    hold the others that long; this holds them for the store's timeout (``session.FORM_TIMEOUT``), and then they
    take the cold path."""
    if world_size < 2:
        return
    store.set(f"{_ARRIVED_KEY}{rank}", "1")
    store.wait([f"{_ARRIVED_KEY}{r}" for r in range(world_size)])


def keep_forever(obj: object) -> None:
    """Never destroy ``obj``, not even at interpreter teardown: one extra reference that nothing releases.

    For what a failed step leaves behind in gloo (the Work of a collective given up on): its destructor may run after
    the collective failed and throw gloo's stored ``IoException``, which aborts the process ("terminate called after
    throwing an instance of 'gloo::IoException'", seen at the end of runs that recovered in place)."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


def shrink_exclusions(old_size: int, old_rank: int, previous_ranks: Sequence[int], rank: int) -> list[int] | None:
    """The ranks of the old group to exclude when the new group is a pure shrink of it, else None.

    ``previous_ranks[r]`` is the old rank of the member that becomes rank ``r`` (the same list on every member).
    A pure shrink keeps the survivors in their old order (``ncclCommShrink`` numbers them so) and loses at least
    one member. Raises ValueError when the list contradicts this member's own old and new rank (a caller's bug).
    """
    if not 0 <= rank < len(previous_ranks) or previous_ranks[rank] != old_rank:
        raise ValueError(f"previous ranks {list(previous_ranks)} do not put old rank {old_rank} at new rank {rank}")
    if len(set(previous_ranks)) != len(previous_ranks) or not all(0 <= r < old_size for r in previous_ranks):
        raise ValueError(f"previous ranks {list(previous_ranks)} are not distinct ranks of a group of {old_size}")
    if len(previous_ranks) >= old_size or list(previous_ranks) != sorted(previous_ranks):
        return None
    kept = set(previous_ranks)
    return [r for r in range(old_size) if r not in kept]


class Groups(abc.ABC):
    """How one backend's groups are left and formed. Subclasses set the class attributes."""

    name: ClassVar[str]
    # accelerate's view of a setup this backend serves
    distributed_types: ClassVar[tuple[DistributedType, ...]]
    # what a worker's environment needs for hot recovery on this backend (set by the daemon, see worker_env)
    env: ClassVar[Mapping[str, str]] = {}

    def __init__(self, timeout: timedelta) -> None:
        self.timeout = timeout
        self.store: dist.Store | None = None  # the current default group's (see replace)

    def can_shrink(self, group: dist.ProcessGroup) -> bool:
        """Whether this member can take part in shrinking ``group`` (announced to the membership decision)."""
        return False

    def replace(
        self, store: dist.Store, rank: int, world_size: int, previous_ranks: Sequence[int] | None
    ) -> tuple[dist.ProcessGroup, str]:
        """Leave the current default group and return the new one and how it was made (``"new"`` or ``"shrink"``).

        Raises :class:`ReformError` when the new group cannot be made.
        """
        old = dist.group.WORLD if dist.is_initialized() else None
        if old is not None:
            self.retire(old)
        # The default group's store must outlive the call: torch keeps only the C++ side of a store written in Python
        # (elasticd's etcd store), and every later new_group (the shard mirrors', a sharded save's) calls into its
        # Python side ("INTERNAL ASSERT FAILED ... Not implemented" once it is collected).
        self.store = store
        try:
            await_members(store, rank, world_size)
            self.form(store, rank, world_size)
        except Exception as exc:
            raise ReformError(f"forming the group failed: {exc}", rank=rank, world_size=world_size) from exc
        group = dist.group.WORLD
        assert group is not None
        return group, "new"

    @abc.abstractmethod
    def retire(self, group: dist.ProcessGroup) -> None:
        """Take ``group`` out of use (gloo: keep it referenced; NCCL: abort its communicators)."""

    @abc.abstractmethod
    def form(self, store: dist.Store, rank: int, world_size: int) -> None:
        """A new default group of this backend over ``store`` (a collective of the new members)."""


class GlooGroups(Groups):
    name = "gloo"
    distributed_types = (DistributedType.MULTI_CPU,)

    def __init__(self, timeout: timedelta, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(timeout)
        self.abandoned = AbandonedGroups(clock=clock)

    def retire(self, group: dist.ProcessGroup) -> None:
        self.abandoned.sweep()
        dist.destroy_process_group()  # out of torch's registry; the object lives on in self.abandoned
        self.abandoned.keep(group)

    def form(self, store: dist.Store, rank: int, world_size: int) -> None:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=self.timeout)


class NcclGroups(Groups):
    """UNVERIFIED (no GPU here): see the module's docstring."""

    name = "nccl"
    distributed_types = (DistributedType.MULTI_GPU,)
    env = {
        envvars.TORCH_NCCL_ASYNC_ERROR_HANDLING: _NCCL_CLEAN_UP_ONLY,
        envvars.TORCH_NCCL_USE_COMM_NONBLOCKING: "1",
    }

    def __init__(
        self,
        timeout: timedelta,
        *,
        environ: Mapping[str, str],
        device: torch.device | None = None,
    ) -> None:
        """``environ``: the process's environment (torch reads the NCCL settings from it); ``device``: this process's
        GPU, by default the current CUDA device. Raises :class:`UnsupportedSetup` when NCCL cannot serve here."""
        super().__init__(timeout)
        require_nccl(environ)
        self.device = device if device is not None else torch.device("cuda", torch.cuda.current_device())

    def can_shrink(self, group: dist.ProcessGroup) -> bool:
        if getattr(dist, "shrink_group", None) is None or not hasattr(c10d, "SHRINK_ABORT"):
            return False
        try:
            backend = group._get_backend(self.device)
            if not getattr(backend, "supports_shrinking", False):  # NCCL < 2.27 (no ncclCommShrink) in this build
                return False
            # the watchdog may have aborted the communicator after an error already: nothing left to shrink (torch
            # 2.13 binds get_error on some builds only; without it a shrink of an aborted group fails, as a ReformError)
            get_error = getattr(backend, "get_error", None)
            if get_error is not None and get_error() != ErrorType.SUCCESS:
                return False
            # torch gives the shrunk group a clone of the old group's store, after the communicator was shrunk and
            # the old group destroyed: a store that cannot clone (a Python store without clone(); elasticd's etcd
            # store clones, on a connection of its own) would fail the shrink past the point of return
            group.get_group_store().clone()  # type: ignore[attr-defined]  # not in torch's stubs
        except Exception:
            return False
        return True

    def replace(
        self, store: dist.Store, rank: int, world_size: int, previous_ranks: Sequence[int] | None
    ) -> tuple[dist.ProcessGroup, str]:
        old = dist.group.WORLD if dist.is_initialized() else None
        if old is None or previous_ranks is None:
            return super().replace(store, rank, world_size, previous_ranks)
        excluded = shrink_exclusions(old.size(), old.rank(), previous_ranks, rank)
        if excluded is None:
            return super().replace(store, rank, world_size, previous_ranks)
        try:
            group = dist.shrink_group(excluded, shrink_flags=c10d.SHRINK_ABORT)
        except Exception as exc:
            raise ReformError(
                f"shrinking the group (excluding {excluded}) failed: {exc}", rank=rank, world_size=world_size
            ) from exc
        if (group.rank(), group.size()) != (rank, world_size):
            raise ReformError(
                f"the shrunk group made this member rank {group.rank()} of {group.size()}",
                rank=rank,
                world_size=world_size,
            )
        return group, "shrink"

    def retire(self, group: dist.ProcessGroup) -> None:
        # ncclCommAbort on every communicator of every group (the hot path allows no other group), then torch's
        # registry is cleared; unlike destroy_process_group, no shutdown that could wait on a dead peer
        c10d._abort_process_group()

    def form(self, store: dist.Store, rank: int, world_size: int) -> None:
        # device_id: the communicator is created now (a member that never comes fails the formation, not the first
        # step) and the group is bound to this GPU, which shrink_group needs later
        dist.init_process_group(
            "nccl", store=store, rank=rank, world_size=world_size, timeout=self.timeout, device_id=self.device
        )


def require_nccl(environ: Mapping[str, str]) -> None:
    """Raise :class:`UnsupportedSetup` naming why hot recovery cannot run on NCCL in this process."""
    if not dist.is_nccl_available():
        raise UnsupportedSetup("NCCL here", f"this torch build ({torch.__version__}) has no NCCL")
    if not torch.cuda.is_available():
        raise UnsupportedSetup("NCCL here", "no CUDA device is visible to this process")
    mode = environ.get(envvars.TORCH_NCCL_ASYNC_ERROR_HANDLING, "3")  # torch's default when unset
    if mode.strip() in _TEARS_DOWN:
        raise UnsupportedSetup(
            f"{envvars.TORCH_NCCL_ASYNC_ERROR_HANDLING}={mode}",
            f"torch then ends the process on an NCCL error; set {_NCCL_CLEAN_UP_ONLY} (the daemon's default) or 0",
        )


GROUPS: Mapping[str, type[Groups]] = {cls.name: cls for cls in (GlooGroups, NcclGroups)}


def groups_for(
    group: dist.ProcessGroup | None,
    *,
    timeout: timedelta,
    environ: Mapping[str, str],
    clock: Callable[[], float] = time.monotonic,
) -> Groups:
    """The :class:`Groups` for the backend ``group`` (the job's default group) runs on.

    Raises :class:`UnsupportedSetup` for a backend hot recovery cannot re-form, or when its needs are not met.
    """
    if group is None:
        raise UnsupportedSetup("a job without a process group", "prepare the model in a distributed launch first")
    return groups_named(dist.get_backend(group), timeout=timeout, environ=environ, clock=clock)


def groups_named(
    backend: str,
    *,
    timeout: timedelta,
    environ: Mapping[str, str],
    clock: Callable[[], float] = time.monotonic,
) -> Groups:
    """:func:`groups_for` by the backend's name as ``dist.get_backend`` spells it."""
    if backend == GlooGroups.name:
        return GlooGroups(timeout, clock)
    if backend == NcclGroups.name:
        return NcclGroups(timeout, environ=environ)
    known = " or ".join(GROUPS)
    raise UnsupportedSetup(f"the {backend!r} backend", f"hot recovery re-forms {known} groups")


def worker_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables to add to a worker's environment ``environ`` for hot recovery on any backend it may use.

    Only those ``environ`` does not set: a user's explicit choice wins (:class:`NcclGroups` then refuses a mode that
    ends the process, so the job learns it at start and falls back to cold restarts). Harmless where unused: torch
    reads the NCCL ones only when it creates an NCCL group.
    """
    wanted: dict[str, str] = {}
    for cls in GROUPS.values():
        wanted.update(cls.env)
    return {name: value for name, value in wanted.items() if name not in environ}


def collective_device(group: Any) -> torch.device:
    """Where a tensor must live for a collective on ``group``: its bound GPU for NCCL, else the CPU."""
    bound = getattr(group, "bound_device_id", None)
    if bound is not None:
        return torch.device(bound)
    if group.name() == NcclGroups.name:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
