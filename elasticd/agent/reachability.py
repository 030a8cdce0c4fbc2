"""Can the members reach each other? What a hang diagnosis asks before it convicts anyone.

A node cut from its peers but not from etcd (a bad NIC, a switch port, a firewall rule on the data network) stalls
every rank of the group at once: each waits for the cut node inside a collective, and the cut node for them. Every
node's evidence then says "stopped progressing first", and a diagnosis that convicts all of them has nobody to
remove; the whole job restarts and, since the cut node still reaches etcd, forms the same unworkable group again.

So each daemon listens on its ``--local-addr`` (a :class:`~elasticd.liveness_probe.ProbeListener`, its address in
the node's registry record as ``probe``), and with its hang evidence reports which members it reached
(:func:`reached`). The diagnosis (``agreement.py``) keeps the largest set of members that all reach each other both
ways (:func:`partition`) and convicts the others: one group goes on, the one whose members can talk, never a group
that includes a member the others cannot reach. (torchft's lighthouse asks the same question of its replica groups
through heartbeats; here the probe is one TCP connect per peer, in parallel, bounded by the probe timeout.)
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from elasticd.liveness_probe import Probe, probe

# Above this many members the largest clique is not searched exhaustively: the most-disconnected member goes first.
_EXHAUSTIVE_MAX = 12


def reached(
    records: Iterable[Mapping[str, Any]],
    node_id: str,
    members: Sequence[str],
    *,
    probe_fn: Callable[[str], Probe] = probe,
) -> dict[str, bool]:
    """For each other member with a probe address in ``records`` (the registry's): did this node reach it? A refused
    connection counts as reached (its host answered: the network is fine, its daemon is not)."""
    addresses = {
        str(r.get("node_id")): str(r["probe"]) for r in records if r.get("probe") and r.get("node_id") != node_id
    }
    peers = [m for m in members if m in addresses]
    if not peers:
        return {}
    with ThreadPoolExecutor(max_workers=min(32, len(peers)), thread_name_prefix="elasticd-reach") as pool:
        answers = list(pool.map(lambda m: probe_fn(addresses[m]), peers))
    return {m: answer is not Probe.UNREACHABLE for m, answer in zip(peers, answers, strict=True)}


def partition(members: Sequence[str], reports: Mapping[str, Mapping[str, bool]]) -> set[str]:
    """The members outside the largest set whose members all reach each other both ways, by ``reports`` (node ->
    what it reached); empty when every pair reaches each other. What a node did not report on counts as reached.
    Ties go to the set first in the members' sorted order, so every node that computes it gets the same answer."""
    nodes = sorted(set(members))

    def linked(a: str, b: str) -> bool:
        return reports.get(a, {}).get(b, True) and reports.get(b, {}).get(a, True)

    if all(linked(a, b) for a, b in itertools.combinations(nodes, 2)):
        return set()
    if len(nodes) <= _EXHAUSTIVE_MAX:
        for size in range(len(nodes) - 1, 0, -1):
            for group in itertools.combinations(nodes, size):
                if all(linked(a, b) for a, b in itertools.combinations(group, 2)):
                    return set(nodes) - set(group)
    kept = list(nodes)
    while any(not linked(a, b) for a, b in itertools.combinations(kept, 2)):
        worst = max(kept, key=lambda n: (sum(not linked(n, o) for o in kept if o != n), n))
        kept.remove(worst)
    return set(nodes) - set(kept)
