"""Who decides the next membership epoch, and how the others wait for it (``session.py``; ``membership.py`` decides).

Every member of the epoch before bids; then **one** of them decides: the first member, in the old rank order, that is
not gone (``Verdicts.is_gone``: its record, its node's liveness key, taken out, its port; what answers at once) —
usually the old rank 0, or whoever follows a dead rank 0. A stopped decider is gone once its node's lease expires. It
counts the bids (one small answer) as they come and reads them all only when every old member may have bid, or at
most every :data:`FULL_READ_S` while they still come in (a member may be dead without bidding: the decision probes
those). The others wait on the epoch key alone, and look again every :data:`WAIT_SLICE_S` whether their decider still
lives: a decider that died (or was taken out) hands the decision to the next member in line.

So a change costs etcd O(N): N bids, a few reads of them by one node, and the decision that every member reads
once. Before, every member decided: each bid woke every member, who read every bid again, O(N²) per change (at 64
simulated nodes a node loss took 6.7 s to decide, and 256 never decided: ``bench/control_plane.py``).

Two deciders at once (a member judged dead that is not) are safe: the decision is one compare-and-set, and the
slower one reads the winner's. A decider that finds too few members left (:class:`~elasticd.membership.BelowMinimum`)
raises and its worker goes cold; its process gone, the next member in line finds the same and does likewise.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from elasticd.membership import Epoch, Membership

# The longest a decider waits for the next bid before it tries again anyway (a member that died without bidding is
# found by the decision's probes, not by a change in etcd; seconds).
RETRY_S = 0.25
# The decider reads every bid at most this often while bids still come in (seconds).
FULL_READ_S = 0.1
# A member that does not decide waits this long for the decision before it looks again whether its decider lives
# (seconds).
WAIT_SLICE_S = 1.0


class DecideTimeout(TimeoutError):
    """The epoch was not decided within the time allowed."""

    def __init__(self, epoch: int, timeout_s: float | None) -> None:
        within = "in time" if timeout_s is None else f"within {timeout_s:g} s"
        super().__init__(f"epoch {epoch} was not decided {within}")


def decider_of(previous: Sequence[str], me: str, is_gone: Callable[[str], bool]) -> str:
    """The member that decides: the first of ``previous`` (in old rank order) that is ``me`` or not gone."""
    for member in previous:
        if member == me or not is_gone(member):
            return member
    return me


def decide(
    membership: Membership,
    target: int,
    previous: Sequence[str],
    me: str,
    is_gone: Callable[[str], bool],
    attempt: Callable[[], Epoch | None],
    timeout_s: float,
    *,
    clock: Callable[[], float] = time.monotonic,
) -> Epoch:
    """The decision of epoch ``target``: made here if this member (``me``) is the decider, else waited for.

    ``is_gone(member)``: the verdict that picks the decider (every member asks the same, so they agree).
    ``attempt()`` tries to decide now (``Membership.try_decide`` with the caller's rules): the decision, the winner's,
    or None while a live member has not bid. Raises :class:`DecideTimeout` after ``timeout_s``, and whatever
    ``attempt`` raises (``BelowMinimum``)."""
    deadline = clock() + timeout_s
    while True:
        if decider_of(previous, me, is_gone) == me:
            return _as_decider(membership, target, len(previous), attempt, deadline, clock)
        remaining = deadline - clock()
        if remaining <= 0:
            raise DecideTimeout(target, timeout_s)
        found = membership.wait(target, min(WAIT_SLICE_S, remaining))
        if found is not None:
            return found


def _as_decider(
    membership: Membership,
    target: int,
    expected: int,
    attempt: Callable[[], Epoch | None],
    deadline: float,
    clock: Callable[[], float],
) -> Epoch:
    """Count the bids at most every :data:`FULL_READ_S` (a wake per bid would be N looks), read them all when the
    count says every member may be in, when it grew, or every :data:`RETRY_S` anyway."""
    last_count, last_try = -1, float("-inf")
    while True:
        looked = clock()
        count, before = membership.count_bids(target)  # a bid written after this count wakes the wait below
        now = clock()
        if (count != last_count and (count >= expected or now - last_try >= FULL_READ_S)) or now - last_try >= RETRY_S:
            last_count, last_try = count, now
            decision = attempt()
            if decision is not None:
                return decision
        remaining = deadline - clock()
        if remaining <= 0:
            raise DecideTimeout(target, None)
        if count == last_count:  # nothing new since the last look: wait for a bid (or the retry)
            membership.wait_for_bids(target, before, min(RETRY_S, remaining))
        time.sleep(max(looked + FULL_READ_S - clock(), 0.0))  # at most one look per FULL_READ_S
