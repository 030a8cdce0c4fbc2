"""A stopped node, known before its lease expires: the hot path greets the next node's daemon every quarter second.

A node whose processes are stopped (SIGSTOP, a frozen VM) resets no connection, so the group learns of it only when
its daemon's liveness lease expires (``agent/node_lease.py``): etcd clamps a lease's TTL to 1.5 election timeouts
rounded up to whole seconds, which is 2 s at etcd's default timing, and checks expiries every 500 ms
(``bench/recovery.py --etcd-profile default``: the vanished node took 2.15 s). Its kernel still accepts
connections, though, and a daemon's probe listener greets every one from a thread that does nothing else
(``liveness_probe.greet``): no greeting means the process does not run.

So one worker per node (local rank 0) greets the daemon of the node after its own in the epoch's sorted node list
(a ring: every node is watched by one other, whatever the number of nodes) every :data:`INTERVAL_S`. After
:data:`SILENT_AFTER_S` of silent greetings in a row it reports the node (the session writes the epoch's failure
notice, which fails the step everywhere); the members deciding the next epoch greet that daemon themselves before
they count its members dead (``session.py``), so no single worker's view removes a node. A refused or unreachable
daemon is not this watch's verdict: a refused one is gone (its lease follows within a second), an unreachable one
may be a partition, which the daemons' own agreement handles (``agent/agreement.py``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection

from elasticd.liveness_probe import Probe, greet

# How often the next node's daemon is greeted, and how long each greeting may take (seconds).
INTERVAL_S = 0.25
# Silent greetings in a row for this long (seconds) make the node reported: three to four greetings, far above the
# millisecond a running daemon's listener thread takes to answer, and below etcd's shortest lease at its defaults.
SILENT_AFTER_S = 0.75


class SilenceWatch:
    """Greets one node's daemon; reports it once when it stays silent (see the module docstring)."""

    def __init__(
        self,
        daemon_address: Callable[[str], str | None],
        report: Callable[[str], None],
        *,
        interval_s: float = INTERVAL_S,
        silent_after_s: float = SILENT_AFTER_S,
        greeter: Callable[[str, float], Probe] = greet,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``daemon_address(node)``: where that node's daemon greets (None: not known yet); ``report(text)``: the
        watched node stayed silent (called once per :meth:`follow`, from the watch's thread)."""
        self._address = daemon_address
        self._report = report
        self._interval_s = interval_s
        self._silent_after_s = silent_after_s
        self._greet = greeter
        self._clock = clock
        self._lock = threading.Lock()
        self._target: str | None = None
        self._generation = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def successor(own: str, nodes: Collection[str]) -> str | None:
        """The node after ``own`` in sorted order, the first after the last; None when ``own`` is alone."""
        ring = sorted(set(nodes) | {own})
        if len(ring) < 2:
            return None
        return ring[(ring.index(own) + 1) % len(ring)]

    def follow(self, own: str, nodes: Collection[str]) -> None:
        """Watch the node after ``own`` among ``nodes`` from now on (an epoch's nodes)."""
        with self._lock:
            self._target = self.successor(own, nodes)
            self._generation += 1
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="elasticd-hot-silence", daemon=True)
            self._thread.start()

    def close(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        silent_since: float | None = None  # when the first of the silent greetings in a row was sent
        reported = False
        watched: tuple[str | None, int] = (None, -1)
        pause = self._interval_s
        while not self._stop.wait(pause):
            pause = self._interval_s
            with self._lock:
                target, generation = self._target, self._generation
            if (target, generation) != watched:
                watched, silent_since, reported = (target, generation), None, False
            address = None if target is None or reported else self._address(target)
            if address is None:
                continue
            sent = self._clock()
            if self._greet(address, self._interval_s) is not Probe.SILENT:
                silent_since = None
                continue
            pause = 0.0  # the greeting itself waited the interval
            silent_since = sent if silent_since is None else silent_since
            silent_s = self._clock() - silent_since
            if silent_s >= self._silent_after_s:
                reported = True
                self._report(f"node {target}'s daemon is silent ({silent_s:.2f}s): stopped")
