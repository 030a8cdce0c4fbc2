"""What a worker learns from its daemon through the environment, with defaults for a run without one.

Under ``elasticd start`` every value comes from ``ELASTICD_*`` variables (``envvars.py``); under plain ``python``,
``torchrun`` or ``accelerate launch`` none is set and the defaults make the library a local, daemon-free helper:
checkpoints under ``./checkpoints/default`` every 100 steps, no beats, no fencing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from elasticd import envvars


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerSettings:
    run_id: str = "default"
    checkpoint_dir: Path = Path("checkpoints")
    every_steps: int = 100
    every_seconds: float = 0.0
    keep: int = 3
    on_nan: str = "rollback"
    asynchronous: bool = True
    round: int = 0
    fence_token: str | None = None  # None: no daemon, no lineage (checkpoints are found on disk)
    etcd: str | None = None  # None: no daemon, no fencing
    socket: str | None = None
    board: str | None = None  # None: no daemon watches this worker
    local_rank: int = 0
    nproc_per_node: int = 1
    min_nodes: int | None = None
    max_nodes: int | None = None
    recovery: str = "cold"  # "hot" under a daemon that asks for it (--recovery)
    node_id: str | None = None
    local_addr: str | None = None
    join_round: int | None = None  # this node joins the group of that round in place (hot recovery)

    @property
    def under_daemon(self) -> bool:
        return self.socket is not None

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> WorkerSettings:
        e = dict(os.environ if env is None else env)

        def number(name: str, default: str) -> str:
            return e.get(name) or default

        return cls(
            run_id=e.get(envvars.RUN_ID, "default"),
            checkpoint_dir=Path(e.get(envvars.CHECKPOINT_DIR, "checkpoints")),
            every_steps=int(number(envvars.CHECKPOINT_EVERY_STEPS, "100")),
            every_seconds=float(number(envvars.CHECKPOINT_EVERY_SECONDS, "0")),
            keep=int(number(envvars.KEEP_CHECKPOINTS, "3")),
            on_nan=e.get(envvars.ON_NAN, "rollback"),
            asynchronous=e.get(envvars.ASYNC_CHECKPOINTS, "1") not in ("0", "false", "no"),
            round=int(number(envvars.ROUND, "0")),
            fence_token=e.get(envvars.FENCE_TOKEN) or None,
            etcd=e.get(envvars.ETCD) or None,
            socket=e.get(envvars.SOCKET) or None,
            board=e.get(envvars.BOARD) or None,
            local_rank=int(number("LOCAL_RANK", "0")),
            nproc_per_node=int(number("LOCAL_WORLD_SIZE", "1")),
            min_nodes=int(e[envvars.MIN_NODES]) if e.get(envvars.MIN_NODES) else None,
            max_nodes=int(e[envvars.MAX_NODES]) if e.get(envvars.MAX_NODES) else None,
            recovery=e.get(envvars.RECOVERY) or "cold",
            node_id=e.get(envvars.NODE_ID) or None,
            local_addr=e.get(envvars.LOCAL_ADDR) or None,
            join_round=int(e[envvars.JOIN_ROUND]) if e.get(envvars.JOIN_ROUND) else None,
        )
