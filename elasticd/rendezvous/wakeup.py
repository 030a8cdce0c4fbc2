"""Wake torch's rendezvous loop when the shared state changes or a deadline in it falls due, not on 1 s polls.

torch's dynamic rendezvous waits for the other nodes by sleeping a fixed second (``_delay(seconds=1)`` in
``_DistributedRendezvousOpExecutor.run``) and re-reading the state, which its state holder may even serve from a
1 s cache. A round re-forming after a node loss goes through several such waits in a row (the dead member's
keep-alive expiring, each survivor adding itself, the last call ending, the others reading the completion), each
costing half a second on the median and up to a whole one: ~2 s of a node loss's recovery are polling.

:class:`StateWakeup` replaces that sleep, for the thread that runs one of our handler's operations: it ends when
the state key changes in etcd (a watch from the revision that thread last read, so no write is missed) or when the
next time-based event of the state is due (a member's keep-alive expiring, the last-call deadline, our own
keep-alive), and never later than torch's second. The next read then bypasses the holder's cache. Other threads,
and torch's own handlers in the same process, keep torch's sleep. What it relies on in torch is listed in
``elasticd/privates/torch_surfaces.py``; when any of the daemon's entries moved, :func:`install` leaves torch as it is
(the ``torch_timing`` fallback).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta

from torch.distributed.elastic.rendezvous import dynamic_rendezvous
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    RendezvousSettings,
    _BackendRendezvousStateHolder,
    _NodeDesc,
    _RendezvousState,
)

from elasticd.etcd.client import EtcdClient, EtcdError
from elasticd.privates.check import problems
from elasticd.privates.surface import Process
from elasticd.privates.torch_surfaces import TORCH

# Seconds past a due time at which to re-read: torch compares with ``<`` / ``<=`` against ``datetime.now()``.
DUE_MARGIN_S = 0.01

# read with getattr: a torch without it gets torch's timing (install() refuses), not an ImportError
_torch_delay: Callable[..., None] | None = getattr(dynamic_rendezvous, "_delay", None)
_active = threading.local()
_install_lock = threading.Lock()


def surface_problems() -> list[str]:
    """What moved among torch's private names the daemon relies on, this module's included (empty: none)."""
    return [str(moved) for moved in problems(TORCH, process=Process.DAEMON)]


def install() -> bool:
    """Route torch's rendezvous waits through :func:`_delay` (idempotent). False, and torch untouched, when the
    parts it relies on moved (see :func:`surface_problems`)."""
    with _install_lock:
        if getattr(dynamic_rendezvous, "_delay", None) is _delay:
            return True
        if surface_problems():
            return False
        dynamic_rendezvous._delay = _delay
        return True


def _delay(seconds: float | tuple[float, float]) -> None:
    """torch's ``_delay``; a whole-second poll in a thread with an active :class:`StateWakeup` waits on it."""
    wakeup: StateWakeup | None = getattr(_active, "wakeup", None)
    if wakeup is None or isinstance(seconds, tuple):
        assert _torch_delay is not None  # install() replaced it: it was there
        _torch_delay(seconds=seconds)
        return
    wakeup.wait(float(seconds))


class StateWakeup:
    """Waits of one handler's rendezvous operations, ended by a change of the state key or a due time.

    ``revision()`` is the state's mod_revision as the calling thread last read it (None: not known, sleep instead),
    ``holder`` the handler's state holder whose cache is bypassed after each wait, ``also_due()`` the seconds until
    a due time the state does not hold (None: none).
    """

    def __init__(
        self,
        client: EtcdClient,
        key: str,
        revision: Callable[[], int | None],
        holder: _BackendRendezvousStateHolder,
        node: _NodeDesc,
        settings: RendezvousSettings,
        *,
        also_due: Callable[[], float | None] = lambda: None,
        sleep: Callable[[float], None] = time.sleep,
        now: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self._client = client
        self._key = key
        self._revision = revision
        self._holder = holder
        self._node = node
        self._settings = settings
        self._also_due = also_due  # seconds until a due time of the handler's own (quorum.py's grace)
        self._sleep = sleep
        self._now = now
        # why each wait ended, for tests and the curious: "change", "due" (a time in the state), "poll" (torch's 1 s)
        self.woken: dict[str, int] = {"change": 0, "due": 0, "poll": 0}

    @contextmanager
    def active(self) -> Iterator[None]:
        """Torch's rendezvous waits in the calling thread go through this wakeup until the block ends."""
        previous = getattr(_active, "wakeup", None)
        _active.wakeup = self
        try:
            yield
        finally:
            _active.wakeup = previous

    def wait(self, max_s: float) -> None:
        """Until the state changes, its next due time, or ``max_s`` seconds; then force the next read."""
        due = [s for s in (self.due_in(self._holder.state), self._also_due()) if s is not None]
        timeout_s = min([*due, max_s])
        revision = self._revision()
        changed = False
        if revision is None:
            self._sleep(timeout_s)
        else:
            try:
                changed = self._client.wait_for_change(self._key, revision + 1, timeout_s)
            except EtcdError:
                self._sleep(timeout_s)  # etcd away: torch's next read reports it
        self.woken["change" if changed else "poll" if timeout_s >= max_s else "due"] += 1
        # torch would serve the next read from a cache up to 1 s old, so the loop would see nothing new
        self._holder._last_sync_time = -1

    def due_in(self, state: _RendezvousState) -> float | None:
        """Seconds until the next time in ``state`` at which torch's decision may change (None: none ahead)."""
        now = self._now()
        interval = self._settings.keep_alive_interval
        expiry = interval * self._settings.keep_alive_max_attempt
        times: list[datetime] = []
        if state.deadline is not None and not state.complete:
            times.append(state.deadline)  # the last call ends: a participant marks the round complete
        for node, beat in state.last_heartbeats.items():
            times.append(beat + (interval if node == self._node else expiry))  # our keep-alive; theirs expiring
        # A time already past was seen by the decision that made us wait: only times ahead can change it.
        ahead = [t for t in times if t > now]
        if not ahead:
            return None
        return (min(ahead) - now) / timedelta(seconds=1) + DUE_MARGIN_S
