"""One snapshot of a run's status as etcd sees it: its nodes, round, epoch, world size, step, last checkpoint and
health, as a JSON-able dict (``elasticd status --json`` prints it; the table and the live view draw it).

Read-only: it lists the node registry and ``checkpoint/latest``. A node whose record was not refreshed for
:data:`STALE_AFTER_S` is shown as ``stale`` (its lease is about to expire, or its daemon is stuck). A node in state
``spare`` is healthy and idle: the round's node count does not split the global batch, so it waits for the next
membership change (``agent/spares.py``); the run is ``ok`` while the others train, ``waiting`` when every node is one.
``epoch`` is the membership epoch in force (hot recovery re-forms the group in place without a new round; each node
records the epoch it last re-formed into, ``agent/reconfig.py``): ``-`` until the first re-formation.

The status command (``status.py``) and its live view (``status_watch.py``) both build on this module, so neither
imports the other's internals.
"""

from __future__ import annotations

import json
import time
from typing import Any

from elasticd.etcd.client import EtcdClient
from elasticd.keys import RunKeys
from elasticd.node_records import read_nodes

# Seconds without a registry write after which a node is reported stale; the registry rewrites at least every
# few seconds while a node trains (last step) and its lease expires after 10 s.
STALE_AFTER_S = 30.0


def collect_status(client: EtcdClient, run_id: str, now: float | None = None) -> dict[str, Any]:
    """The run's status as a JSON-able dict (the ``--json`` output)."""
    keys = RunKeys(run_id)
    now = time.time() if now is None else now
    nodes = read_nodes(client, keys)
    for node in nodes:
        age = now - float(node.get("updated_at", now))
        node["health"] = "stale" if age > STALE_AFTER_S else _health(str(node.get("state")))
        node["age_s"] = round(age, 1)
    latest = client.get(keys.checkpoint_latest)
    checkpoint = json.loads(latest[0]) if latest else None
    return summarize(run_id, nodes, checkpoint)


def summarize(run_id: str, nodes: list[dict[str, Any]], checkpoint: dict[str, Any] | None) -> dict[str, Any]:
    """The run's status from its node records (each with ``health`` and ``age_s``) and its latest checkpoint."""
    rounds = [n["round"] for n in nodes if isinstance(n.get("round"), int)]
    steps = [n["last_step"] for n in nodes if isinstance(n.get("last_step"), int)]
    sizes = [n["world_size"] for n in nodes if isinstance(n.get("world_size"), int)]
    epochs = [n["epoch"] for n in nodes if isinstance(n.get("epoch"), int)]
    spares = [str(n.get("node_id")) for n in nodes if n.get("state") == "spare"]
    return {
        "run_id": run_id,
        "nodes": nodes,
        "node_count": len(nodes),
        "round": max(rounds) if rounds else None,
        "epoch": max(epochs) if epochs else None,
        "world_size": max(sizes) if sizes else None,
        "step": max(steps) if steps else None,
        "checkpoint": checkpoint,
        "spares": spares,
        "health": _run_health(nodes),
    }


def _health(state: str) -> str:
    return {"running": "ok", "finished": "done", "failed": "failed", "spare": "spare"}.get(state, state)


def _run_health(nodes: list[dict[str, Any]]) -> str:
    if not nodes:
        return "no nodes"
    if any(n["health"] in {"stale", "failed"} for n in nodes):
        return "degraded"
    if all(n["health"] == "spare" for n in nodes):
        return "waiting"  # no node count present splits the global batch: nobody trains until one joins
    # a node whose workers wait, warm, to be admitted in place changes nothing until they are
    if all(n["health"] in {"ok", "spare", "joining"} for n in nodes):
        return "ok"
    return "changing"


def dash(value: object) -> str:
    """A value for a table cell: ``-`` for none."""
    return "-" if value is None else str(value)
