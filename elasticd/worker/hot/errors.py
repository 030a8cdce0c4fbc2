"""What can go wrong on the hot path, as exceptions that carry data.

Each one means the same thing to the caller: hot recovery cannot go on in this process, fall back to the cold path
(restart from the newest committed checkpoint). None of them is a user mistake, except :class:`UnsupportedSetup`,
which names the part of the setup at start so the user learns it before the first failure.
"""

from __future__ import annotations

from elasticd.errors import ElasticdError


class HotRecoveryError(ElasticdError):
    """Base: the process group could not be carried over in place."""


class UnsupportedSetup(HotRecoveryError):
    """A part of the training setup that the hot path cannot carry over (``what`` names it)."""

    def __init__(self, what: str, detail: str) -> None:
        super().__init__(f"hot recovery does not support {what}: {detail}")
        self.what = what


class ReformError(HotRecoveryError):
    """The new process group could not be formed (a member died or never came during the re-formation)."""

    def __init__(self, message: str, *, rank: int, world_size: int) -> None:
        super().__init__(f"re-forming the process group as rank {rank} of {world_size}: {message}")
        self.rank = rank
        self.world_size = world_size


class HealError(HotRecoveryError):
    """Copying the state from the source rank failed, or the state does not fit this process's objects.

    ``holds_state``: this member still holds a state it may give to others (its own, untouched, or the source's).
    False on a receiver whose heal failed: pieces may have been written into its tensors, so it can only be healed
    again, never be a source (``session.py`` retries the heal from the members that hold the state)."""

    def __init__(self, message: str, *, source: int, holds_state: bool = True) -> None:
        super().__init__(f"healing from rank {source}: {message}")
        self.source = source
        self.holds_state = holds_state


class HealAbandoned(HealError):
    """The heal was given up while this member waited in it: another member failed it (the epoch's notice)."""


class SurfaceChanged(HotRecoveryError):
    """A private torch or accelerate name the hot path relies on is missing or changed (``elasticd/privates/``)."""
