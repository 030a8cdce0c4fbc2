"""A node whose liveness lease is gone leaves the rendezvous state at once, not when its heartbeat expires.

torch drops a node from the shared state (participants, wait and redundancy lists) once its last heartbeat is older
than ``keep_alive_interval * keep_alive_max_attempt`` (3 s here): ``_BackendRendezvousStateHolder._sanitize``, run
on every read of the state. Until then a killed node holds its round: the survivors leave that round, wait in its
list for the next one, and the next one begins only when the dead node is no longer a participant. Measured here
(cold path, kill -9 of one of 3 nodes): rendezvous complete 2.8-3.0 s after the kill, of a 3.9-4.1 s recovery.

Every elasticd daemon holds its rendezvous name (torch's node descriptor, ``addr_pid_localid``) on its node's
liveness lease (``rdzv/alive/<name>``, ``agent/node_lease.py``), gone about a second after the daemon dies.
:class:`LapsedNodes` extends the holder's sanitizer: a node whose heartbeat is late (older than
:data:`SUSPECT_AFTER` keep-alive intervals: a live node renews it every interval) and whose name is not among the
live leases is removed as torch removes a dead one, from the same lists and with the same epilogue (the round
advances once its last participant is gone). As with torch's own sanitizer only this node's view changes; its next
write of the state carries it. Leases are read only while some node's heartbeat is late, and the wait of the
rendezvous loop looks again every :data:`POLL_S` meanwhile (:meth:`LapsedNodes.due_in`).

A live node whose lease lapsed (etcd away longer than the lease, a partition) but whose heartbeat still comes is
never late, so never removed; one that is removed and comes back joins the next round, as after torch's expiry.
torchrun with this handler has no leases and keeps torch's rule.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime

from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    RendezvousSettings,
    _BackendRendezvousStateHolder,
    _NodeDesc,
    _remove_participant_epilogue,
    _RendezvousState,
)

# Keep-alive intervals after its last heartbeat before a node's lease is looked at: a live node beats every interval
# (from its agent's timer thread), so a later one is either dead or descheduled, and the lease tells which.
SUSPECT_AFTER = 1.25
# How often the rendezvous loop wakes to read the leases again while a heartbeat is late.
POLL_S = 0.25


class LapsedNodes:
    """Installed on ``holder``: its sanitizer also removes late nodes whose lease is gone (``alive()``: the live
    names, None when they cannot be read, then torch's rule alone applies). ``on_removed(name)`` is told once per
    node."""

    def __init__(
        self,
        holder: _BackendRendezvousStateHolder,
        settings: RendezvousSettings,
        this_node: _NodeDesc,
        alive: Callable[[], frozenset[str] | None],
        on_removed: Callable[[str], None] = lambda _name: None,
        now: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self._holder = holder
        self._settings = settings
        self._node = this_node
        self._alive = alive
        self._on_removed = on_removed
        self._now = now
        self.removed: set[str] = set()
        self._torch_sanitize = holder._sanitize
        holder._sanitize = self.sanitize  # type: ignore[method-assign]  # this holder only

    def late(self, state: _RendezvousState) -> list[_NodeDesc]:
        cutoff = self._now() - self._settings.keep_alive_interval * SUSPECT_AFTER
        return [node for node, beat in state.last_heartbeats.items() if node != self._node and beat < cutoff]

    def sanitize(self) -> None:
        self._torch_sanitize()
        state = self._holder.state
        late = self.late(state)
        if not late:
            return
        live = self._alive()
        if live is None:
            return
        participant_removed = False
        for node in (n for n in late if repr(n) not in live):
            del state.last_heartbeats[node]
            if node in state.participants:
                del state.participants[node]
                participant_removed = True
            state.wait_list.discard(node)
            state.redundancy_list.discard(node)
            if repr(node) not in self.removed:
                self.removed.add(repr(node))
                self._on_removed(repr(node))
        if participant_removed:
            _remove_participant_epilogue(state, self._settings)

    def due_in(self) -> float | None:
        """Seconds until the leases should be read again (None: no heartbeat is late)."""
        return POLL_S if self.late(self._holder.state) else None
