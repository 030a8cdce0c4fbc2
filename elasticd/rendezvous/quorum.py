"""Close a re-forming round as soon as every node alive in the rendezvous has joined it: no last call to sit out.

torch's rendezvous, once ``min_nodes`` have joined a round, waits the last call (elasticd: 2 s) for more before it
closes it. That wait is for nodes still starting when a job begins. When a running job re-forms (a node was lost, one
joins, a worker failed) every node that can take part is already known to the rendezvous: each live daemon keeps a
heartbeat in its state (the round's participants, the wait list for the next round, the redundancy list), and a dead
one's heartbeat has expired out of it. So a node that has formed a round before closes the round at once when every
node with a heartbeat is a participant, nobody waits for the next round and the count is within bounds. A node
that shows up a moment later waits in the list for the next round, as it would after a last call. The round is
closed by torch's own action (ranks assigned by torch), through the state's compare-and-set, so a node that joined
concurrently makes the close fail and be decided again.
"""

from __future__ import annotations

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
    """torch's join operation, which closes the round early when :func:`everyone_in` and ``enabled()``."""

    def __init__(self, join: StateHandler, enabled: Callable[[], bool], on_close: Callable[[int, int], None]) -> None:
        self._join = join
        self._enabled = enabled
        self._on_close = on_close  # (round, participants)

    def __call__(self, ctx: _RendezvousContext, deadline: float) -> _Action:
        action = self._join(ctx, deadline)
        if action is _Action.SYNC and self._enabled() and everyone_in(ctx):
            self._on_close(ctx.state.round, len(ctx.state.participants))
            return _Action.MARK_RENDEZVOUS_COMPLETE
        return action


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
