"""What a worker learns from its daemon through the environment, with defaults for a run without one.

Under ``elasticd start`` every value comes from ``ELASTICD_*`` variables (``envvars.py``); under plain ``python``,
``torchrun`` or ``accelerate launch`` none is set and the defaults make the library a local, daemon-free helper:
checkpoints under ``./checkpoints/default`` every 100 steps, no beats, no fencing.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elasticd import envvars
from elasticd import options as o
from elasticd.endpoints import parse_endpoints
from elasticd.etcd.access import EtcdAccess


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerSettings:
    # start options the daemon passes on (options.py, marked `worker`): same field names as StartConfig's, and the
    # defaults a worker without a daemon takes
    run_id: str = o.RUN_ID.default
    checkpoint_dir: Path = Path(o.CHECKPOINT_DIR.default)
    checkpoint_every_steps: int = o.CHECKPOINT_EVERY_STEPS.default
    checkpoint_every_seconds: float = o.CHECKPOINT_EVERY_SECONDS.default
    keep_checkpoints: int = o.KEEP_CHECKPOINTS.default
    on_nan: str = o.ON_NAN.default
    etcd: str | None = None  # None: no daemon, no fencing
    etcd_connect_timeout_s: float = o.ETCD_CONNECT_TIMEOUT.default
    min_nodes: int | None = None
    max_nodes: int | None = None
    recovery: str = o.RECOVERY.worker_default  # "hot" under a daemon that asks for it (--recovery)
    shard_mirror_every: int = o.SHARD_MIRROR_EVERY.default
    node_id: str | None = None
    local_addr: str | None = None
    # what the daemon tells its workers besides (envvars.py), and torchrun's own
    asynchronous: bool = True
    round: int = 0
    fence_token: str | None = None  # None: no daemon, no lineage (checkpoints are found on disk)
    socket: str | None = None
    board: str | None = None  # None: no daemon watches this worker
    local_rank: int = 0
    nproc_per_node: int = 1
    join_round: int | None = None  # this node joins the group of that round in place (hot recovery)

    @property
    def under_daemon(self) -> bool:
        return self.socket is not None

    def etcd_connect_args(self, env: Mapping[str, str] | None = None) -> dict[str, Any]:
        """``EtcdClient.connect``'s arguments for the daemon's etcd, reached as the daemon reaches it: the same
        endpoints, connect timeout, TLS files and credentials (the fence and the hot path both connect so)."""
        return {
            "endpoints": parse_endpoints(self.etcd or "", key=o.ETCD.env),
            "connect_timeout_s": self.etcd_connect_timeout_s,
            **EtcdAccess.from_worker_env(env).connect_kwargs(),
        }

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> WorkerSettings:
        e = dict(os.environ if env is None else env)

        def number(name: str, default: str) -> str:
            return e.get(name) or default

        return cls(
            **{option.field: option.from_env(e) for option in o.worker_options()},
            asynchronous=e.get(envvars.ASYNC_CHECKPOINTS, "1") not in ("0", "false", "no"),
            round=int(number(envvars.ROUND, "0")),
            fence_token=e.get(envvars.FENCE_TOKEN) or None,
            socket=e.get(envvars.SOCKET) or None,
            board=e.get(envvars.BOARD) or None,
            local_rank=int(number(envvars.LOCAL_RANK, "0")),
            nproc_per_node=int(number(envvars.LOCAL_WORLD_SIZE, "1")),
            join_round=int(e[envvars.JOIN_ROUND]) if e.get(envvars.JOIN_ROUND) else None,
        )
