"""Who of a group's members is dead or out, as the members deciding the next epoch judge it (``session.py``).

A member that did not bid for the next epoch is **dead** when its liveness port refuses a connection (the process is
gone: the kernel answers at once), when its node's liveness key is gone (its daemon stopped refreshing it), when its
node took it out of the epoch (a hang's culprit), or when its node's daemon, greeted by the decider itself, stays
silent (connected, never greeted: the node is stopped; ``liveness_probe.greet``, ``silence.py``). Never on a timer on
its steps. A verdict of dead is kept: a member declared dead does not come back to the same group.

Each member's record (``membership/member/<name>``: its node and liveness address) and each node's daemon address
(its registry record's ``probe``) are read from etcd once and kept.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterable
from typing import Any

from elasticd.etcd.client import EtcdClient
from elasticd.keys import RunKeys
from elasticd.liveness_probe import Probe, greet, probe

# A decider greets the daemon of a member that did not bid this long (seconds) before it takes the silence for a
# stopped node: a running daemon's listener answers within milliseconds.
DECIDE_GREET_TIMEOUT_S = 0.5
# The failure watch greets the daemon of a node whose lease it saw gone this long (seconds) before it believes the
# lease (``watch.py``): a running daemon's listener answers within milliseconds, as the silence watch expects.
LAPSE_GREET_TIMEOUT_S = 0.25
# More member records than this missing are read in one request (not N).
_ONE_BY_ONE = 8


class Verdicts:
    """The liveness verdicts of one group's members (``group``: the group's name in the run's keys)."""

    def __init__(self, client: EtcdClient, keys: RunKeys, group: str) -> None:
        self._client = client
        self._keys = keys
        self._group = group
        self._records: dict[str, dict[str, Any]] = {}
        self._dead: set[str] = set()
        self._daemons: dict[str, str] = {}  # node -> where its daemon greets

    def is_dead(self, member: str, epoch: int) -> bool:
        """:meth:`is_gone`, or its node's daemon gone or stopped (the greeting): what a decision counts dead."""
        dead = self.is_gone(member, epoch)  # True at once for a member judged dead before
        if not dead:
            record = self.record(member)
            dead = record is not None and self.daemon_gone(str(record["node"]))
        if dead:
            self._dead.add(member)
        return dead

    def is_gone(self, member: str, epoch: int) -> bool:
        """Dead by what answers at once: no record, its node's liveness key gone, taken out of ``epoch``, or its port
        refuses; not the daemon's greeting, which waits up to 0.5 s for a stopped node (whose liveness key then goes
        within its TTL). What the members that do not decide ask of their decider (``decide.py``)."""
        if member in self._dead:
            return True
        record = self.record(member)
        if record is None:
            gone = True  # every member publishes before the first step: its record is gone with etcd's data
        else:
            alive = self._client.get(self._keys.membership_alive(str(record["node"]))) is not None
            gone = not alive or self.is_out(member, epoch) or probe(str(record["addr"])) is Probe.REFUSED
        if gone:
            self._dead.add(member)
        return gone

    def is_out(self, member: str, epoch: int) -> bool:
        """Did ``member``'s node take it out of ``epoch`` (a culprit of the group's hang agreement)?"""
        record = self.record(member)
        node = str(record["node"]) if record is not None else None
        out = None if node is None else self._client.get(self._keys.membership_out(self._group, epoch, node))
        return out is not None

    def out_of(self, epoch: int) -> Callable[[str], bool]:
        """:meth:`is_out` for every member at once: the nodes taken out of ``epoch`` read in one range read (a
        decision asks it of every bidder: N reads each time, seen to take 40 s at 256 nodes)."""
        prefix = self._keys.membership_out_prefix(self._group, epoch)
        nodes = {key[len(prefix) :] for key in self._client.keys_under(prefix)}

        def out(member: str) -> bool:
            record = self.record(member) if nodes else None
            return record is not None and str(record["node"]) in nodes

        return out

    def daemon_address(self, node: str) -> str | None:
        """Where ``node``'s daemon greets (its registry record, as first read), None when it has no record with one."""
        if node not in self._daemons:
            self._read_daemon(node)
        return self._daemons.get(node)

    def current_daemon_address(self, node: str) -> str | None:
        """Where ``node``'s daemon greets now: its registry record read again. A node that came back (a restarted
        daemon, the same node id) listens on another port, and its old address refuses."""
        self._daemons.pop(node, None)
        self._read_daemon(node)
        return self._daemons.get(node)

    def daemon_gone(self, node: str) -> bool:
        """Is ``node``'s daemon gone (refused at its current address) or stopped (connected, never greeted)? Not for
        an unreachable one: a partition."""
        return self._greet_current(node, DECIDE_GREET_TIMEOUT_S) in (Probe.REFUSED, Probe.SILENT)

    def daemon_answers(self, node: str, timeout_s: float = LAPSE_GREET_TIMEOUT_S) -> bool:
        """Does ``node``'s daemon greet now (at its current address)? False without a known address."""
        return self._greet_current(node, timeout_s) is Probe.ACCEPTED

    def _greet_current(self, node: str, timeout_s: float) -> Probe | None:
        """Greet ``node``'s daemon at the address kept; a refusal is judged at its current address (the registry
        read again: a node that came back listens on another port). None: no record to judge by (the node's lease
        decides)."""
        address = self.daemon_address(node)
        if address is None:
            return None
        answer = greet(address, timeout_s)
        if answer is Probe.REFUSED:
            current = self.current_daemon_address(node)
            if current is None:
                return None
            if current != address:
                answer = greet(current, timeout_s)
        return answer

    def _read_daemon(self, node: str) -> None:
        """``node``'s registry record alone (every member asks about a few nodes: reading all N records each was
        O(N²) for the group)."""
        found = self._client.get(self._keys.node(node))
        try:
            record = json.loads(found[0]) if found is not None else None
        except ValueError:
            record = None
        if isinstance(record, dict) and record.get("probe"):
            self._daemons[node] = str(record["probe"])

    def _read_records(self, members: list[str]) -> None:
        """The records of ``members`` in one read (a new group's members' nodes: one request, not N; only those not
        kept: reading all of the run's was N records for each member's first change, O(N²) for the group)."""
        keys = {self._keys.membership_member(m): m for m in members}
        for key, raw in self._client.get_many(list(keys)).items():
            with contextlib.suppress(ValueError):
                record = json.loads(raw)
                if isinstance(record, dict) and "node" in record:
                    self._records.setdefault(keys[key], record)

    def record(self, member: str) -> dict[str, Any] | None:
        if member not in self._records:
            found = self._client.get(self._keys.membership_member(member))
            if found is None:
                return None
            self._records[member] = json.loads(found[0])
        return self._records[member]

    def nodes_of(self, members: Iterable[str]) -> set[str]:
        members = list(members)
        missing = [m for m in members if m not in self._records]
        if len(missing) > _ONE_BY_ONE:
            self._read_records(missing)
        nodes: set[str] = set()
        for member in members:
            record = self.record(member)
            if record is not None:
                nodes.add(str(record["node"]))
        return nodes
