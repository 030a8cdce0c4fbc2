"""The out-of-band failure notice: a thread that tells the hook, within milliseconds, that the step failed elsewhere.

Only the direct peers of a dead rank see gloo report a reset connection; a survivor whose all-reduce waits on
another survivor that already gave up would otherwise wait for the bucket timeout. And a vanished node (power loss,
partition, SIGSTOP) resets nothing at all. So every member follows its run's ``membership/`` keys with one etcd
watch and answers the hook's question (:meth:`FailureWatch.reason`, asked as each bucket goes in flight) from
memory, and nudges the hook (:meth:`FailureWatch.on_reason`) the moment a reason appears, so that a bucket already in
flight is released too:

- ``membership/notice/<epoch>``: a member of the current epoch saw its step fail (it writes the key first thing);
- ``membership/alive/<node>`` gone for a node of a current member: that node's daemon stopped refreshing its
  one-second lease (``agent/node_lease.py``); believed at once unless that daemon still greets (a lapse, see
  :data:`LAPSE_GRACE_S`).

It also counts the joiners that bid for the next epoch (:meth:`FailureWatch.joiners`): warm workers of a node that
asks to be admitted, which the group lets in at a step boundary it agrees on (``elasticd/worker/coordination.py``);
and the members' nodes that leave on SIGTERM (``membership/leaving/<node>``, :meth:`FailureWatch.leaving`), whose
workers leave the same way.

A healthy step costs nothing here: the watch wakes only when a key under ``membership/`` changes, and lease
refreshes change no key.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection

from elasticd.etcd.client import EtcdClient, EtcdError
from elasticd.keys import RunKeys
from elasticd.membership import Bid

# How long one watch call lasts before it is renewed (seconds); a change wakes it at once. Each renewal reads the
# notice, the leases, the bids and the leavers again: at 5 s that was half of a node's steady etcd traffic
# (bench/control_plane.py).
_WATCH_SLICE_S = 30.0
# After an etcd error, wait this long before watching again (seconds).
_RETRY_S = 0.5
# A lease seen gone within this long of this watch's own last etcd error is believed only if it stays gone that long
# (seconds). When etcd regains quorum it extends every lease by about one election timeout, and a node whose refreshes
# failed through the outage may miss that window by a second or two before its daemon grants a new lease and puts
# its key back (agent/node_lease.py): seen in the suite, two of three nodes taken for dead 1 s after quorum returned,
# and the group broke up. A node that really died meanwhile is found this much later.
OUTAGE_GRACE_S = 5.0
# A lease seen gone while its node's daemon still greets is believed only once it has stayed gone this long (seconds),
# looked at again every LAPSE_RECHECK_S. etcd that answers reads but is slow to write (its disk busy with a 1.2 GB
# checkpoint's write-back: bench/join_contention.py saw every node's lease refresh time out at once, and the group
# fail a step and re-form around the same two nodes) lets a running node's lease expire; its daemon grants a new one
# and puts its key back as soon as etcd answers again (agent/node_lease.py). A daemon that is gone (refused) or stopped
# (silent) is believed at once: a killed or vanished node is found as before.
LAPSE_GRACE_S = 5.0
LAPSE_RECHECK_S = 0.25


class FailureWatch:
    """Follows one epoch's notice key and its members' node leases; :meth:`reason` is the verdict."""

    def __init__(
        self,
        client: EtcdClient,
        keys: RunKeys,
        group: str,
        *,
        outage_grace_s: float = OUTAGE_GRACE_S,
        daemon_answers: Callable[[str], bool] = lambda _node: False,
        lapse_grace_s: float = LAPSE_GRACE_S,
    ) -> None:
        """``daemon_answers(node)``: does that node's daemon greet now (``verdicts.py``); without it every lease
        seen gone is believed at once."""
        self._client = client
        self._outage_grace_s = outage_grace_s
        self._daemon_answers = daemon_answers
        self._lapse_grace_s = lapse_grace_s
        self._gone_since: dict[str, float] = {}  # nodes whose lease is gone while their daemon greets: since when
        self._trusted_from = 0.0  # leases seen gone before this time (after an etcd error of ours) are not believed
        self._recheck_at: float | None = None  # a lease seen gone inside the grace: look again then
        self._keys = keys
        self._group = group
        self._lock = threading.Lock()
        self._epoch = 0
        self._nodes: frozenset[str] = frozenset()
        self._reason: str | None = None
        self._joiners = 0
        self._leaving: frozenset[str] = frozenset()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._on_reason: Callable[[], None] | None = None

    def on_reason(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (from the watch's thread; keep it short) whenever the current epoch gets a reason."""
        self._on_reason = callback

    def follow(self, epoch: int, nodes: Collection[str]) -> None:
        """Watch ``epoch`` (whose members run on ``nodes``) from now on; forgets the previous epoch's verdict."""
        with self._lock:
            self._epoch, self._nodes, self._reason, self._joiners = epoch, frozenset(nodes), None, 0
            self._leaving = frozenset()
            self._gone_since = {}
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="elasticd-hot-watch", daemon=True)
            self._thread.start()

    def reason(self) -> str | None:
        with self._lock:
            return self._reason

    def joiners(self) -> int:
        """Workers that asked to join the next epoch (bid with no old rank), as last seen."""
        with self._lock:
            return self._joiners

    def leaving(self) -> frozenset[str]:
        """Nodes of the current members that asked to leave, as last seen."""
        with self._lock:
            return self._leaving

    def close(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                before = self._client.revision()
                self._evaluate()
                wait_s = _WATCH_SLICE_S
                if self._recheck_at is not None:  # nothing may change in etcd meanwhile: wake to look again
                    wait_s = min(wait_s, max(self._recheck_at - time.monotonic(), 0.01))
                self._client.wait_for_change(self._keys.membership_prefix, before + 1, wait_s, prefix=True)
            except EtcdError:
                self._trusted_from = time.monotonic() + self._outage_grace_s
                self._stop.wait(_RETRY_S)

    def _believed(self, gone: list[str]) -> list[str]:
        """The nodes of ``gone`` (lease keys missing) taken for gone: every one whose daemon does not greet, and
        those whose lease has stayed gone for the lapse grace although their daemon greets."""
        now = time.monotonic()
        self._gone_since = {node: self._gone_since.get(node, now) for node in gone}
        believed = []
        for node in gone:
            if now - self._gone_since[node] >= self._lapse_grace_s or not self._daemon_answers(node):
                believed.append(node)
        if len(believed) < len(gone):  # a lapse: look again soon (nothing may change in etcd meanwhile)
            self._recheck_at = time.monotonic() + LAPSE_RECHECK_S
        return believed

    def _evaluate(self) -> None:
        with self._lock:
            epoch, nodes = self._epoch, self._nodes
        found = self._client.get(self._keys.membership_notice(self._group, epoch))
        reason = None if found is None else found[0].decode(errors="replace")
        self._recheck_at = None
        if reason is None and nodes:
            alive = {raw.decode() for _, raw, _ in self._client.get_prefix(self._keys.membership_alive_prefix)}
            gone = sorted(nodes - alive)
            if gone and time.monotonic() < self._trusted_from:
                self._recheck_at = self._trusted_from  # just after an outage: gone for good only if still gone then
            elif believed := self._believed(gone):
                reason = f"node liveness lease gone: {', '.join(believed)}"
        bids = self._client.get_prefix(self._keys.membership_bids_prefix(epoch + 1))
        joiners = sum(1 for _, raw, _ in bids if Bid.decode(raw).old_rank is None)
        leaving = {raw.decode() for _, raw, _ in self._client.get_prefix(self._keys.membership_leaving_prefix)}
        with self._lock:
            news = False
            if self._epoch == epoch:
                self._joiners = joiners
                self._leaving = frozenset(leaving & nodes)
                if reason is not None:
                    news = self._reason is None
                    self._reason = reason
        if news and self._on_reason is not None:
            self._on_reason()
