"""Running the tables' checks at start, and applying their fallbacks.

- ``elasticd start`` (:func:`check_daemon`, once torch is loaded and before the agent and the rendezvous handler are
  imported): its own entries and every ``refuse_to_start`` one (:func:`daemon_surfaces`). One event says what was
  checked (``private_surfaces_checked``) or what moved and the fallbacks (``private_surfaces_moved``); a moved
  ``refuse_to_start`` entry stops the daemon with exit 2 and one line. The other fallbacks are applied where the
  name is used: the rendezvous wake-up (``wakeup.install``), the hot path at arm (:func:`require`), the worker's
  saves and flight recorder (:func:`check_worker`).
- the worker library's ``attach`` (:func:`check_worker`): the entries a worker uses, but the hot path's, which its
  arm checks for the backend it runs on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from elasticd.errors import UsageError
from elasticd.privates.accelerate_surfaces import ACCELERATE
from elasticd.privates.surface import CHECKED_WITH, Fallback, Process, Surface
from elasticd.privates.torch_surfaces import TORCH

SURFACES: tuple[Surface, ...] = (*TORCH, *ACCELERATE)


@dataclass(frozen=True, slots=True)
class Moved:
    """An entry whose check failed, and what is wrong."""

    surface: Surface
    problem: str

    def __str__(self) -> str:
        return f"{self.surface.name}: {self.problem} (used to: {self.surface.use})"


class SurfacesMoved(UsageError):
    """Private torch/accelerate names elasticd cannot do without moved: the installed releases are not usable."""

    def __init__(self, moved: list[Moved]) -> None:
        super().__init__(moved_message("elasticd", moved))
        self.moved = moved


def problems(
    surfaces: Iterable[Surface] = SURFACES,
    *,
    fallback: Fallback | None = None,
    process: Process | None = None,
    backend: str | None = None,
) -> list[Moved]:
    """The entries of ``surfaces`` whose check fails; only those with ``fallback``, used by ``process``, or on
    ``backend``'s path, when given (None: any)."""
    found = []
    for surface in surfaces:
        if fallback is not None and surface.fallback is not fallback:
            continue
        if process is not None and surface.process is not process:
            continue
        if backend is not None and surface.backend not in (None, backend):
            continue
        try:
            problem = surface.check()
        except Exception as exc:  # a check that cannot even run is a moved name too
            problem = f"check failed: {exc!r}"
        if problem is not None:
            found.append(Moved(surface, problem))
    return found


def versions_line() -> str:
    """The releases the tables were checked with, and this process's."""
    import accelerate
    import torch

    checked = ", ".join(f"{name} {version}.x" for name, version in CHECKED_WITH.items())
    return f"checked with {checked}; this process has torch {torch.__version__}, accelerate {accelerate.__version__}"


def moved_message(who: str, moved: list[Moved]) -> str:
    """One line: ``who`` relies on these private names, which moved, and the releases checked with."""
    return f"{who} relies on private torch/accelerate names that moved ({versions_line()}): " + "; ".join(
        map(str, moved)
    )


def require(backend: str, error: Callable[[str], Exception]) -> None:
    """The hot path's check at arm: raise ``error(message)`` naming every moved name it relies on, on
    ``backend``'s path (its fallback is cold recovery: the caller falls back on that error)."""
    moved = problems(fallback=Fallback.COLD_RECOVERY, backend=backend)
    if moved:
        raise error(moved_message("hot recovery", moved))


def daemon_surfaces() -> list[Surface]:
    """What ``elasticd start`` checks: the daemon's own entries, and every entry whose move refuses to start (a worker's
    too: better one line from the daemon than workers failing one after the other). The workers' other entries are
    checked where they are used, by the worker's ``attach`` (:func:`check_worker`) and the hot path's arm
    (:func:`require`), each reporting what moved. Checking them in the daemon imported what only workers use (FSDP and
    its DTensor package, accelerate's ``Accelerator``): ~1.3 s of CPU at every daemon start, measured here."""
    return [s for s in SURFACES if s.process is Process.DAEMON or s.fallback is Fallback.REFUSE_TO_START]


def check_daemon(log: Any) -> list[Moved]:
    """``elasticd start``'s check (:func:`daemon_surfaces`): log one event (checked, or moved); raise
    :class:`SurfacesMoved` when a ``refuse_to_start`` entry moved. Returns what moved with a fallback the daemon or
    its workers apply."""
    mine = daemon_surfaces()
    return _report(log, problems(mine), "daemon", len(mine))


def check_worker(log: Any) -> frozenset[Fallback]:
    """``attach``'s check: log ``private_surfaces_moved`` when something moved; raise :class:`SurfacesMoved` when
    a ``refuse_to_start`` entry moved. Returns the fallbacks the worker applies (the hot path's is its arm's)."""
    mine = [s for s in SURFACES if s.process is Process.WORKER and s.fallback is not Fallback.COLD_RECOVERY]
    moved = problems(mine)
    if moved:
        _report(log, moved, "worker", len(mine))
    return frozenset(m.surface.fallback for m in moved)


def _report(log: Any, moved: list[Moved], process: str, checked: int) -> list[Moved]:
    if not moved:
        log.info("private_surfaces_checked", process=process, checked=checked, versions=versions_line())
        return moved
    log.warning(
        "private_surfaces_moved",
        process=process,
        checked=checked,
        moved=[str(m) for m in moved],
        fallbacks=sorted({str(m.surface.fallback) for m in moved}),
        versions=versions_line(),
    )
    refused = [m for m in moved if m.surface.fallback is Fallback.REFUSE_TO_START]
    if refused:
        raise SurfacesMoved(refused)
    return moved
