"""Joining in place: a node that starts while the run's group trains in place joins it without a rendezvous.

A node entering torch's rendezvous while a round trains makes every running agent restart its workers (torch counts
it among the nodes waiting): the whole group stops, checkpoints, and restarts cold, 10-12 s here. With
``--recovery hot`` the running group publishes itself (``membership/group``, by its rank 0 worker), and a new node
that finds it live (``elasticd/group_record.py`` reads the record and probes the group) joins it instead
(:func:`group_to_join`):

- its agent takes a *private round* (``rendezvous/handler.py``): a rendezvous of this node alone, with no etcd state,
  so the running agents see no waiting node; torch's agent starts this node's workers in a world of their own;
- the workers learn the round to join (``ELASTICD_JOIN_ROUND``), import and prepare, then ask the group to admit them
  and heal from a live peer (``elasticd/worker/hot_path.py``): the running workers never restart;
- until admitted, the node holds no fencing token (its workers cannot commit); the epoch that admits them moves the
  token, which the agent then adopts as its own (``round.py``);
- if the group stops training in place meanwhile (it fell back to a cold restart, the run ended), the workers give up
  (exit :data:`~elasticd.errors.EXIT_REJOIN`) and the node goes through the rendezvous like any other: a restart of
  this node's agent that, like any membership change, does not count against ``--max-restarts``.

A node that cannot reach the group (a partition of the data network: etcd says the group trains, its members'
nodes are alive, none of its workers answers from here) neither joins it nor enters the rendezvous, where the
running agents would count it waiting and restart everyone into a round it cannot form with: it waits until it
reaches them, or until the group stops training in place (:func:`group_to_join` with ``wait``).

The same path brings a node back whose own workers died while its daemon lived (the group went on without them):
the agent's restart finds the group live and its new workers join it; and a node that was stopped and resumed
(SIGSTOP, a partition), whose workers found themselves excluded.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable

from elasticd.etcd.client import EtcdClient, EtcdError
from elasticd.group_record import JOINABLE, GroupToJoin, Reach, group_reach, read_group
from elasticd.keys import RunKeys
from elasticd.node_records import read_nodes


def group_to_join(
    client: EtcdClient,
    keys: RunKeys,
    node_id: str,
    *,
    max_nodes: int,
    nodes_waiting: int,
    wait: Callable[[GroupToJoin], None] | None = None,
) -> GroupToJoin | None:
    """The group this node can join in place now, or None (then: the rendezvous, as without hot recovery).

    Live means: its record names the round whose token (or one of its epochs') is the run's fencing token, a worker
    of its current epoch answers its liveness probe, no node waits in the rendezvous (a restart is coming anyway),
    and it has room for this node. A round that keeps spare nodes without workers (``agent/spares.py``) is joined
    through the rendezvous too: the new node count may let them train, which only a new round can do.

    ``wait(group)`` is called, again and again, while the group trains but is out of this node's reach; without it
    an unreachable group is not joined (the rendezvous follows)."""
    if nodes_waiting > 0:
        return None
    try:
        group = read_group(client, keys)
        if group is None or len(set(group.nodes) - {node_id}) >= max_nodes:
            return None
        spares = [r for r in read_nodes(client, keys) if r.get("round") == group.round and r.get("state") == "spare"]
        if spares:
            return None
        reach = group_reach(client, keys, group.name, group.round)
        while reach is Reach.OUT_OF_REACH and wait is not None:
            wait(group)
            reach = group_reach(client, keys, group.name, group.round)
        if reach not in JOINABLE:
            return None
    except EtcdError:
        return None
    return group


def join_name(node_id: str) -> str:
    """The name this node's workers go by until admitted, also their fencing token then (it never fences anything
    in: the run's token is a round's or an epoch's, ``<round>.<...>``)."""
    return f"join-{node_id}-{secrets.token_hex(4)}"
