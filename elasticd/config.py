"""One frozen configuration tree for ``elasticd start``, and the checks that span options.

The CLI (``cli.py``) resolves each value with click's precedence, CLI > ``ELASTICD_*`` env > YAML ``--config`` >
default; the option table (``options.py``) parses and checks each one, and this module puts them into a
:class:`StartConfig` and checks what one option alone cannot (min ≤ max, a readable script, TLS without an external
etcd). Every problem is a :class:`~elasticd.errors.ConfigError` whose message names the option as the user wrote it.
:class:`StartConfig`'s defaults are the table's (``tests/unit/test_options.py`` holds them equal).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from elasticd import options as o
from elasticd.accelerate_env import precheck
from elasticd.endpoints import Endpoint, format_endpoints
from elasticd.errors import ConfigError
from elasticd.etcd.access import EtcdAccess, access_from_options

OnNan = Literal["skip", "rollback", "stop"]
Recovery = Literal["hot", "cold"]
LogFormat = Literal["json", "console"]


@dataclass(frozen=True, kw_only=True, slots=True)
class StartConfig:
    """Everything ``elasticd start`` needs, validated."""

    script: Path
    script_args: tuple[str, ...] = ()
    min_nodes: int = o.MIN_NODES.default
    max_nodes: int = o.MAX_NODES.default
    nproc_per_node: int = int(o.NPROC_PER_NODE.default)
    etcd: tuple[Endpoint, ...] = ()  # empty: start an embedded etcd on 127.0.0.1
    etcd_connect_timeout_s: float = o.ETCD_CONNECT_TIMEOUT.default
    etcd_access: EtcdAccess = field(default_factory=EtcdAccess)  # TLS files and credentials
    run_id: str = o.RUN_ID.default
    node_id: str = field(default_factory=socket.gethostname)
    local_addr: str | None = None
    checkpoint_dir: Path = Path(o.CHECKPOINT_DIR.default)
    checkpoint_every_steps: int = o.CHECKPOINT_EVERY_STEPS.default
    checkpoint_every_seconds: float = o.CHECKPOINT_EVERY_SECONDS.default
    keep_checkpoints: int = o.KEEP_CHECKPOINTS.default
    hang_timeout_s: float | None = None  # None: "auto"
    hang_attempts: int = o.HANG_ATTEMPTS.default  # the same step hanging this many times in a row: exit 1
    startup_timeout_s: float = o.STARTUP_TIMEOUT.default  # start-up, checkpoint save/load, the first step
    straggler_factor: float = o.STRAGGLER_FACTOR.default  # 0 disables straggler reports
    straggler_window_s: float = o.STRAGGLER_WINDOW.default
    drain_timeout_s: float = o.DRAIN_TIMEOUT.default  # SIGTERM / stop: budget for the checkpoint first
    on_nan: OnNan = o.ON_NAN.default
    recovery: Recovery = o.RECOVERY.default  # hot: survivors re-form in place; cold: restart from a checkpoint
    shard_mirror_every: int = o.SHARD_MIRROR_EVERY.default  # sharded jobs: shards in a peer's memory every K steps
    max_restarts: int = o.MAX_RESTARTS.default
    monitor_interval_s: float = o.MONITOR_INTERVAL.default
    metrics_port: int = o.METRICS_PORT.default
    metrics_addr: str = o.METRICS_ADDR.default
    log_format: LogFormat | None = None  # None: console on a TTY, JSON otherwise
    rdzv_conf: tuple[tuple[str, str], ...] = ()
    accelerate_config: Path | None = None  # None: accelerate's default file, if there is one

    @property
    def embedded_etcd(self) -> bool:
        return not self.etcd

    @property
    def etcd_text(self) -> str:
        return format_endpoints(self.etcd)

    def etcd_connect_args(self) -> dict[str, Any]:
        """``EtcdClient.connect``'s arguments for the run's etcd (once the daemon settled it: ``etcd`` is empty
        before an embedded etcd started)."""
        return {
            "endpoints": self.etcd,
            "connect_timeout_s": self.etcd_connect_timeout_s,
            **self.etcd_access.connect_kwargs(),
        }

    def worker_env(self, **runtime: Any) -> dict[str, str]:
        """The start options its workers get (``worker`` in the option table), each under its own ``ELASTICD_<NAME>``;
        ``runtime`` holds values the daemon settled at start instead (the embedded etcd's endpoint)."""
        env: dict[str, str] = {}
        for option in o.worker_options():
            text = option.to_env(runtime.get(option.field, getattr(self, option.field)))
            if text is not None:
                env[option.env] = text
        return env


def build_start_config(values: Mapping[str, Any]) -> StartConfig:
    """Validate resolved option values (keys are the dataclass field names) into a :class:`StartConfig`."""
    script = Path(str(values["script"]))
    if not script.is_file():
        raise ConfigError("SCRIPT", f"{script} does not exist or is not a file")
    if not os.access(script, os.R_OK):
        raise ConfigError("SCRIPT", f"{script} is not readable")

    resolved = o.resolve(values, o.START)
    if resolved["min_nodes"] > resolved["max_nodes"]:
        raise ConfigError(
            o.MIN_NODES.flag, f"{resolved['min_nodes']} is greater than {o.MAX_NODES.flag} {resolved['max_nodes']}"
        )
    access = access_from_options({a.field: resolved.pop(a.field) for a in o.ETCD_ACCESS})
    if not resolved["etcd"] and access != EtcdAccess():
        raise ConfigError(o.ETCD.flag, "TLS and credential options need an external etcd (--etcd HOST:PORT)")
    if resolved["accelerate_config"] is not None:
        precheck(resolved["accelerate_config"])
    return StartConfig(
        script=script,
        script_args=tuple(str(a) for a in values.get("script_args") or ()),
        etcd_access=access,
        **resolved,
    )
