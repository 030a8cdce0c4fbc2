"""``elasticd status``: the run as etcd sees it, once (a table, or ``--json`` for scripts) or as a live view
(``--watch``, ``status_watch.py``).

What a snapshot holds (nodes, round, epoch, world size, step, last checkpoint, health) and how it is read from etcd
is ``status_snapshot.py``'s, shared by this command and the live view; this module connects, picks the form and draws
the table.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

from elasticd import options as o
from elasticd.endpoints import Endpoint
from elasticd.errors import EXIT_OK, ConfigError
from elasticd.etcd.access import EtcdAccess
from elasticd.etcd.client import EtcdClient, EtcdError
from elasticd.status_snapshot import collect_status, dash, summarize
from elasticd.status_watch import run_watch


def show_status(
    etcd: Sequence[Endpoint],
    run_id: str,
    connect_timeout_s: float,
    *,
    as_json: bool,
    access: EtcdAccess | None = None,
    watch: bool = False,
) -> int:
    """``elasticd status`` (its options resolved by the option table: endpoints parsed, run id checked)."""
    if watch and as_json:
        raise ConfigError(o.WATCH.flag, "draws a live view for a terminal; --json prints one snapshot for scripts")
    client = EtcdClient.connect(
        etcd,
        connect_timeout_s=connect_timeout_s,
        **(access or EtcdAccess()).connect_kwargs(),
    )
    try:
        if watch:
            return run_watch(lambda: _collect_or_unreachable(client, run_id))
        status = collect_status(client, run_id)
    finally:
        client.close()
    if as_json:
        print(json.dumps(status, indent=2, sort_keys=True))
    else:
        _render(status)
    return EXIT_OK


def _collect_or_unreachable(client: EtcdClient, run_id: str) -> dict[str, Any]:
    """A watch frame: while etcd is away the view says so and keeps trying."""
    try:
        return collect_status(client, run_id)
    except EtcdError as exc:
        status = summarize(run_id, [], None)
        status["health"] = f"etcd unreachable ({' '.join(str(exc).split())[:80]})"
        return status


def _render(status: dict[str, Any], console: Console | None = None) -> None:
    console = console or Console()
    ckpt = status["checkpoint"]
    console.print(
        f"run [bold]{status['run_id']}[/]  health [bold]{status['health']}[/]  nodes {status['node_count']}  "
        f"round {dash(status['round'])}  epoch {dash(status['epoch'])}  world size {dash(status['world_size'])}  "
        f"step {dash(status['step'])}  "
        f"last checkpoint {dash(ckpt.get('step') if ckpt else None)}"
        + (f"  spares {len(status['spares'])}" if status["spares"] else "")
    )
    if not status["nodes"]:
        return
    table = Table("node", "host", "pid", "state", "round", "epoch", "workers", "last step", "updated", "health")
    for n in status["nodes"]:
        table.add_row(
            str(n.get("node_id")),
            str(n.get("host")),
            str(n.get("pid")),
            str(n.get("state")),
            dash(n.get("round")),
            dash(n.get("epoch")),
            dash(n.get("workers")),
            dash(n.get("last_step")),
            f"{n['age_s']}s ago",
            n["health"],
        )
    console.print(table)
