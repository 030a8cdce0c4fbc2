"""Close a re-forming round as soon as every node alive in the rendezvous has joined it: no last call to sit out.

torch's rendezvous, once ``min_nodes`` have joined a round, waits the last call (elasticd: 2 s) for more before it
closes it. That wait is for nodes still starting when a job begins. When a running job re-forms (a node was lost, one
joins, a worker failed) every node that can take part is already known to the rendezvous: each live daemon keeps a
heartbeat in its state (the round's participants, the wait list for the next round, the redundancy list), and a dead
one's heartbeat has expired out of it. So a node that has formed a round before closes the round at once when every
node with a heartbeat is a participant, nobody waits for the next round and the count is within bounds, and that
has held for a short grace (:data:`CLOSE_GRACE_S`). A node that shows up later waits in the list for the next round,
as it would after a last call. The round is
closed by torch's own action (ranks assigned by torch), through the state's compare-and-set, so a node that joined
concurrently makes the close fail and be decided again.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from datetime import timedelta

from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    _Action,
    _RendezvousContext,
    _RendezvousJoinOp,
    _RendezvousOpExecutor,
)

StateHandler = Callable[[_RendezvousContext, float], _Action]

# Seconds every live node must have been in a forming round before a node closes it: far more than the few etcd
# round trips between a node leaving the old round and joining the new one, even on a loaded host; far less than the
# last call (2 s) it replaces.
CLOSE_GRACE_S = 0.3


def everyone_in(ctx: _RendezvousContext) -> bool:
    """Whether the forming round in ``ctx`` holds every node the rendezvous knows to be alive, this one included,
    and enough of them: then waiting longer can only bring nodes that are not there yet."""
    state = ctx.state
    participants = state.participants
    return (
        not state.complete
        and not state.closed
        and ctx.node in participants
        and ctx.settings.min_nodes <= len(participants) <= ctx.settings.max_nodes
        and state.deadline is not None  # torch's last call is running: min_nodes were reached
        and not state.wait_list
        and not state.redundancy_list
        and all(node in participants for node in state.last_heartbeats)
    )


class CloseWhenEveryoneIsIn:
    """torch's join operation, which closes the round once :func:`everyone_in` has held for ``grace_s`` and
    ``enabled()``.

    The grace covers a node caught between leaving the old round and adding itself to the new one: for those few
    etcd round trips it has no heartbeat in the state, and a close in that moment would leave it for the next round.
    """

    def __init__(
        self,
        join: StateHandler,
        enabled: Callable[[], bool],
        on_close: Callable[[int, int], None],
        *,
        grace_s: float = CLOSE_GRACE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._join = join
        self._enabled = enabled
        self._on_close = on_close  # (round, participants)
        self._grace_s = grace_s
        self._clock = clock
        self._since: tuple[int, frozenset[object], float] | None = None  # (round, participants, first seen all in)

    def __call__(self, ctx: _RendezvousContext, deadline: float) -> _Action:
        action = self._join(ctx, deadline)
        if action is not _Action.SYNC or not self._enabled() or not everyone_in(ctx):
            self._since = None
            return action
        key = (ctx.state.round, frozenset(ctx.state.participants))
        now = self._clock()
        if self._since is None or self._since[:2] != key:
            self._since = (*key, now)
        if now - self._since[2] < self._grace_s:
            return action
        self._on_close(ctx.state.round, len(ctx.state.participants))
        return _Action.MARK_RENDEZVOUS_COMPLETE

    def due_in(self) -> float | None:
        """Seconds until the grace of a round that has everyone in ends (None: no such round in sight)."""
        if self._since is None:
            return None
        return max(self._since[2] + self._grace_s - self._clock(), 0.0)


class ReformingExecutor(_RendezvousOpExecutor):
    """The handler's operation executor: torch's, with joins that close early and waits that wake on change."""

    def __init__(
        self,
        inner: _RendezvousOpExecutor,
        wrap_join: Callable[[StateHandler], StateHandler],
        waiting: Callable[[], AbstractContextManager[None]],
    ) -> None:
        self._inner = inner
        self._wrap_join = wrap_join
        self._waiting = waiting  # a context manager factory: StateWakeup.active

    def run(
        self,
        state_handler: StateHandler,
        deadline: float,
        update_deadline: Callable[[timedelta], float] | None = None,
    ) -> None:
        if isinstance(state_handler, _RendezvousJoinOp):
            state_handler = self._wrap_join(state_handler)
        with self._waiting():
            self._inner.run(state_handler, deadline, update_deadline)
