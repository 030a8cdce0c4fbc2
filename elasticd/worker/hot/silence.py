"""A stopped or killed node, known before its lease expires: the hot path greets the next node's daemon every 0.1 s.

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
they count its members dead (``verdicts.py``), so no single worker's view removes a node.

A **refused** greeting is reported at once, once the node's registry record, read again, still names that address
(a node that came back listens on another port): nobody listens on the daemon's port, the daemon is gone, and its
workers go with it (``parentdeath.py``). That is the fast verdict on a killed node: a worker holding gigabytes closes
its sockets only once the kernel has torn its memory down, measured on this box at 0.22 s for a 3.5 GB process after
SIGKILL (0.06 s for 1 GB), and on the 1.2 GB benchmark job (``bench/recovery.py --scenarios node_loss_large``) the
survivors once learned of a kill only from the node's lease, 1.5 s later, while the small daemon's port was closed
within milliseconds. An unreachable daemon is not this watch's verdict: it may be a partition, which the daemons' own
agreement handles (``agent/agreement.py``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection

from elasticd.liveness_probe import Probe, greet

# How often the next node's daemon is greeted (seconds): a killed one is known within this (a refused connection
# returns at once). Ten connections a second to one daemon's listener thread cost nothing measurable.
INTERVAL_S = 0.1
# How long each greeting may take (seconds): far above the millisecond a running daemon's listener takes, and long
# enough for a daemon whose other threads hold the GIL for a while.
GREETING_TIMEOUT_S = 0.25
# Silent greetings in a row for this long (seconds) make the node reported: three to four greetings, far above the
# millisecond a running daemon's listener thread takes to answer, and below etcd's shortest lease at its defaults.
SILENT_AFTER_S = 0.75


class SilenceWatch:
    """Greets one node's daemon; reports it once when it stays silent (see the module docstring)."""

    def __init__(
        self,
        daemon_address: Callable[[str], str | None],
        report: Callable[[str, str], None],
        *,
        current_address: Callable[[str], str | None] | None = None,
        interval_s: float = INTERVAL_S,
        greeting_timeout_s: float = GREETING_TIMEOUT_S,
        silent_after_s: float = SILENT_AFTER_S,
        greeter: Callable[[str, float], Probe] = greet,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``daemon_address(node)``: where that node's daemon greets (None: not known yet); ``report(node, text)``:
        the watched node's daemon stayed silent or refused (called once per :meth:`follow`, from the watch's
        thread); ``current_address(node)``: that node's daemon address read again, asked before a refusal is
        reported (a node that came back listens on another port; default: ``daemon_address``)."""
        self._address = daemon_address
        self._current_address = current_address or daemon_address
        self._report = report
        self._interval_s = interval_s
        self._greeting_timeout_s = greeting_timeout_s
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
            if target is None or address is None:
                continue
            sent = self._clock()
            answer = self._greet(address, self._greeting_timeout_s)
            if answer is Probe.REFUSED:
                current = self._current_address(target)
                if current is None:
                    continue  # no record to judge by: the node's lease decides
                if current != address:
                    continue  # the node came back on another port: greet that one from the next round
                reported = True
                self._report(target, f"node {target}'s daemon refused the greeting: gone")
                continue
            if answer is not Probe.SILENT:
                silent_since = None
                continue
            pause = 0.0  # the greeting itself waited its timeout
            silent_since = sent if silent_since is None else silent_since
            silent_s = self._clock() - silent_since
            if silent_s >= self._silent_after_s:
                reported = True
                self._report(target, f"node {target}'s daemon is silent ({silent_s:.2f}s): stopped")
