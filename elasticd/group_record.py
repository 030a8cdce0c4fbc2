"""Reading the group that trains in place: ``membership/group`` as its rank 0 worker publishes it, and whether that
group is still alive.

A group that recovers in place (``--recovery hot``) publishes itself so that a node starting meanwhile joins it
instead of restarting everyone through a rendezvous. Two sides read the record: the daemon of a starting node
(``agent/joining.py``: join it?) and that node's workers (``worker/hot_path.py``: is it still there to join?). The
reader lives here, below both, with the liveness check it needs (``liveness_probe.py``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import StrEnum

from elasticd.etcd.client import EtcdClient
from elasticd.keys import RunKeys
from elasticd.liveness_probe import Probe, greet
from elasticd.membership import Epoch


@dataclass(frozen=True, slots=True)
class GroupToJoin:
    """A group that trains in place, as its rank 0 published it."""

    name: str  # the group's name (its round's first fencing token)
    round: int
    nodes: tuple[str, ...]


def read_group(client: EtcdClient, keys: RunKeys) -> GroupToJoin | None:
    """The group that trains in place now, as its rank 0 last published it (None: none, or not a record this version
    wrote)."""
    found = client.get(keys.membership_group)
    if found is None:
        return None
    try:
        record = json.loads(found[0])
        return GroupToJoin(str(record["group"]), int(record["round"]), tuple(str(n) for n in record["nodes"]))
    except (ValueError, KeyError, TypeError):
        return None


def group_nodes(client: EtcdClient, keys: RunKeys) -> list[str] | None:
    """The nodes of the group that trains in place now (None: no such group)."""
    group = read_group(client, keys)
    return None if group is None else list(group.nodes)


class Reach(StrEnum):
    """What a node sees of the group that trains in place (:func:`group_reach`)."""

    ALIVE = "alive"  # a worker of its current epoch accepted a connection
    GONE = "gone"  # it does not train in place any more (the token moved on, its workers refuse)
    OUT_OF_REACH = "out_of_reach"  # etcd says it trains (a member's node is alive), but no member answers from here
    # no member greets: one's process exists but says nothing (stopped, wedged, or starved of CPU for a moment); a
    # silent group admits nobody, so a joiner gives up on it once the silence lasts (worker/hot_path.py)
    SILENT = "silent"


# What a joiner may wait on: a silent group is given the benefit of the doubt (its joiner gives up if the silence
# lasts: worker/hot_path.py's JoinWatch).
JOINABLE = frozenset({Reach.ALIVE, Reach.SILENT})


def group_reach(client: EtcdClient, keys: RunKeys, group: str, round_: int) -> Reach:
    """Does ``group`` (of ``round_``) still train in place, and can this node reach it? Its round holds the run's
    fencing token, and a worker of its current epoch greets by its name on its liveness port (a worker that exited
    refuses at once, and so does another process that took its port since); no answer at all from members whose
    node's liveness lease holds is a partition between here and them, not their end; a connection accepted but never
    greeted is a member that is stopped or wedged (SILENT, when no member greets)."""
    token = client.get(keys.lineage_token)
    if token is None or _round_of(token[0]) != str(round_):
        return Reach.GONE  # the run restarted cold since (or etcd lost its data)
    found = client.get(keys.membership_epoch)
    epoch = Epoch.decode(found[0]) if found is not None else None
    records = {key.rsplit("/", 1)[-1]: raw for key, raw, _ in client.get_prefix(f"{keys.membership_prefix}members/")}
    if epoch is not None and _round_of(epoch.token.encode()) == str(round_):
        members = list(epoch.members)
    else:
        members = [name for name in records if name.startswith(f"{group}.")]
    unreachable_nodes: set[str] = set()
    silent = False
    for member in members:
        raw = records.get(member)
        if raw is None:
            continue
        record = json.loads(raw)
        answer = greet(str(record["addr"]), name=member)
        if answer is Probe.ACCEPTED:
            return Reach.ALIVE
        if answer is Probe.UNREACHABLE:
            unreachable_nodes.add(str(record.get("node")))
        silent = silent or answer is Probe.SILENT
    if any(client.get(keys.membership_alive(node)) is not None for node in sorted(unreachable_nodes)):
        return Reach.OUT_OF_REACH
    return Reach.SILENT if silent else Reach.GONE


def group_alive(client: EtcdClient, keys: RunKeys, group: str, round_: int) -> bool:
    """Does ``group`` (of ``round_``) still train in place, reachable from here (:func:`group_reach`)? A silent one
    counts (:data:`JOINABLE`)."""
    return group_reach(client, keys, group, round_) in JOINABLE


def _round_of(token: bytes) -> str:
    return token.decode(errors="replace").split(".", 1)[0]
