"""Reading the node registry: every live record under ``/elasticd/<run-id>/nodes/``.

Each daemon writes its own record (``agent/registry.py``); many read them all: the daemon (who else is alive, its
peers' straggler figures), ``elasticd status``, and the worker library's hot path (did a node of its round finish
the run?). The reader lives here, below the daemon and the worker library both, so that neither imports the other.
"""

from __future__ import annotations

import json
from typing import Any

from elasticd.etcd.client import EtcdClient
from elasticd.keys import RunKeys


def read_nodes(client: EtcdClient, keys: RunKeys) -> list[dict[str, Any]]:
    """Every live node record of the run, sorted by node id; malformed records are skipped."""
    nodes = []
    for _key, value, _rev in client.get_prefix(keys.nodes_prefix):
        try:
            record = json.loads(value)
        except ValueError:
            continue
        if isinstance(record, dict):
            nodes.append(record)
    return sorted(nodes, key=lambda r: str(r.get("node_id")))
