"""The out-of-band failure notice: a thread that tells the hook, within milliseconds, that the step failed elsewhere.

Only the direct peers of a dead rank see gloo report a reset connection; a survivor whose all-reduce waits on
another survivor that already gave up would otherwise wait for the bucket timeout. And a vanished node (power loss,
partition, SIGSTOP) resets nothing at all. So every member follows its run's membership keys with etcd watches and
answers the hook's question (:meth:`FailureWatch.reason`, asked as each bucket goes in flight) from memory, and nudges
the hook (:meth:`FailureWatch.on_reason`) the moment a reason appears, so that a bucket already in flight is released
too:

- ``membership/notice/<group>/<epoch>``: a member of the current epoch saw its step fail (it writes the key first);
- ``membership/alive/<node>`` gone for a node of a current member: that node's daemon stopped refreshing its
  one-second lease (``agent/node_lease.py``); believed at once unless that daemon still greets (a lapse, see
  :data:`LAPSE_GRACE_S`).

It also counts the joiners of the next epoch (``membership/joiners/<epoch>/``, :meth:`FailureWatch.joiners`): warm
workers of a node that asks to be admitted, which the group lets in at a step boundary it agrees on
(``elasticd/worker/coordination.py``); and the members' nodes that leave on SIGTERM (``membership/leaving/<node>``,
:meth:`FailureWatch.leaving`), whose workers leave the same way.

**What it costs** (``bench/control_plane.py``). The keys are read once, at one revision, and from then on followed
through the watches' events, kept in memory: a change costs each member one event. It watches these four prefixes
only, never the bids (an epoch's N bids would wake N members N times each, and each wake re-read O(N) keys: at 64
nodes a node loss took 6.7 s to decide, and 256 never decided). A healthy step costs nothing: lease refreshes change no
key. The watches are renewed from the last revision seen every :data:`_WATCH_SLICE_S` (a stream that a failover
replaced silently is thus replaced too); after an etcd error or a compaction everything is read again. A stream on a
member that went silent (its link down) is found dead by the client's pings within ~9 s (``etcd/client.py``), and the
read that follows moves to another member (after one request timeout on the silent one).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Collection
from typing import Any

from elasticd.etcd.client import EtcdClient, EtcdError
from elasticd.etcd.watches import Compacted, WatchEvent
from elasticd.keys import RunKeys

# How long the watches last before they are renewed from the last revision seen (seconds); four small requests.
_WATCH_SLICE_S = 30.0
_FOLLOWED = object()  # put on the event queue by follow(): judge the new epoch now
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
        # what etcd holds, as last seen (the watch thread's alone): live nodes, leaving nodes, this group's notices
        # by epoch, joiners by epoch
        self._alive: set[str] = set()
        self._all_leaving: set[str] = set()
        self._notices: dict[int, str] = {}
        self._joining: dict[int, set[str]] = {}
        self._events: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._read_at = 0  # the revision of the last full read

    def on_reason(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (from the watch's thread; keep it short) whenever the current epoch gets a reason."""
        self._on_reason = callback

    def follow(self, epoch: int, nodes: Collection[str]) -> None:
        """Watch ``epoch`` (whose members run on ``nodes``) from now on; forgets the previous epoch's verdict."""
        with self._lock:
            self._epoch, self._nodes, self._reason, self._joiners = epoch, frozenset(nodes), None, 0
            self._leaving = frozenset()
            self._gone_since = {}
        self._events.put(_FOLLOWED)
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
        self._events.put(_FOLLOWED)  # wakes the thread, which ends

    def _run(self) -> None:
        start: int | None = None  # the revision to watch from; None: read everything again first
        while not self._stop.is_set():
            try:
                if start is None:
                    start = self._read() + 1
                    self._evaluate()
                start = self._follow_events(start)
            except EtcdError:
                start = None
                self._trusted_from = time.monotonic() + self._outage_grace_s
                self._stop.wait(_RETRY_S)

    def _read(self) -> int:
        """Read the four prefixes at one revision (a watch from the next one misses nothing); returns it."""
        keys = self._keys
        items, revision = self._client.read_prefix(keys.membership_alive_prefix)
        alive = {key.rsplit("/", 1)[1] for key, _, _ in items}
        leaving = {
            key.rsplit("/", 1)[1] for key in self._client.keys_under(keys.membership_leaving_prefix, revision=revision)
        }
        notices = {
            int(key.rsplit("/", 1)[1]): raw.decode(errors="replace")
            for key, raw, _ in self._client.get_prefix(keys.membership_notices_prefix(self._group), revision)
        }
        joining: dict[int, set[str]] = {}
        for key in self._client.keys_under(keys.membership_joiners_root, revision=revision):
            epoch, member = key[len(keys.membership_joiners_root) :].split("/", 1)
            joining.setdefault(int(epoch), set()).add(member)
        self._alive, self._all_leaving, self._notices, self._joining = alive, leaving, notices, joining
        self._read_at = revision
        return revision

    def _follow_events(self, start: int) -> int | None:
        """Apply the watches' events from revision ``start`` on, judging after each batch, until the slice ends
        (returns the revision to renew from) or a watch fails (None: read again)."""
        keys = self._keys
        prefixes = [
            keys.membership_alive_prefix,
            keys.membership_leaving_prefix,
            keys.membership_notices_prefix(self._group),
            keys.membership_joiners_root,
        ]
        ids = self._client.watch_prefixes(prefixes, start, self._events.put)
        renew_at = time.monotonic() + _WATCH_SLICE_S
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                wake_at = renew_at if self._recheck_at is None else min(renew_at, self._recheck_at)
                try:
                    item = self._events.get(timeout=max(wake_at - now, 0.0))
                except queue.Empty:
                    if time.monotonic() >= renew_at:
                        return start
                    self._evaluate()  # a lapse to look at again
                    continue
                if isinstance(item, BaseException):
                    failure = self._client.watch_failure(item)
                    if isinstance(failure, Compacted):
                        return None
                    raise failure
                if item is not _FOLLOWED:
                    start = max(start, self._apply(item) + 1)
                self._evaluate()
            return start
        finally:
            self._client.cancel_watches(ids)

    def _apply(self, events: list[WatchEvent]) -> int:
        """Apply one watch response's events to what is kept; returns the last revision among them (0: none)."""
        keys = self._keys
        notices = keys.membership_notices_prefix(self._group)
        last = 0
        for event in events:
            if event.revision <= self._read_at:
                continue  # a cancelled watch's, older than the read: what was read already holds it
            key, put = event.key, not event.deleted
            last = max(last, event.revision)
            if key.startswith(keys.membership_alive_prefix):
                _put_or_drop(self._alive, key[len(keys.membership_alive_prefix) :], put)
            elif key.startswith(keys.membership_leaving_prefix):
                _put_or_drop(self._all_leaving, key[len(keys.membership_leaving_prefix) :], put)
            elif key.startswith(notices):
                epoch = int(key[len(notices) :])
                if put:
                    self._notices[epoch] = event.value.decode(errors="replace")
                else:
                    self._notices.pop(epoch, None)
            elif key.startswith(keys.membership_joiners_root):
                epoch_text, member = key[len(keys.membership_joiners_root) :].split("/", 1)
                _put_or_drop(self._joining.setdefault(int(epoch_text), set()), member, put)
        return last

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
        """Judge the current epoch from what is kept (no etcd read)."""
        with self._lock:
            epoch, nodes = self._epoch, self._nodes
        for old in [e for e in self._joining if e <= epoch]:
            del self._joining[old]  # joiners of an epoch in force or past are in or were left out
        for old in [e for e in self._notices if e < epoch]:
            del self._notices[old]
        reason = self._notices.get(epoch)
        self._recheck_at = None
        if reason is None and nodes:
            gone = sorted(nodes - self._alive)
            if gone and time.monotonic() < self._trusted_from:
                self._recheck_at = self._trusted_from  # just after an outage: gone for good only if still gone then
            elif believed := self._believed(gone):
                reason = f"node liveness lease gone: {', '.join(believed)}"
        joiners = len(self._joining.get(epoch + 1, ()))
        leaving = self._all_leaving & nodes
        with self._lock:
            news = False
            if self._epoch == epoch:
                self._joiners = joiners
                self._leaving = frozenset(leaving)
                if reason is not None:
                    news = self._reason is None
                    self._reason = reason
        if news and self._on_reason is not None:
            self._on_reason()


def _put_or_drop(kept: set[str], name: str, put: bool) -> None:
    if put:
        kept.add(name)
    else:
        kept.discard(name)
