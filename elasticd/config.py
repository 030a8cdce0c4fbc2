"""One frozen configuration tree for ``elasticd start``, and its validation.

The CLI (``cli.py``) resolves each value with click's precedence, CLI > ``ELASTICD_*`` env > YAML ``--config`` >
default; this module turns the resolved values into a :class:`StartConfig` and checks what one flag alone cannot
(min ≤ max, a readable script, a safe run id). Every problem is a :class:`~elasticd.errors.ConfigError` whose
message names the option as the user wrote it.
"""

from __future__ import annotations

import math
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from elasticd.accelerate_env import precheck
from elasticd.errors import ConfigError
from elasticd.etcd.access import EtcdAccess, resolve_access
from elasticd.etcd.endpoints import Endpoint, parse_endpoints
from elasticd.keys import validate_node_id, validate_run_id

OnNan = Literal["skip", "rollback", "stop"]
Recovery = Literal["hot", "cold"]
LogFormat = Literal["json", "console"]

# Rendezvous settings a user may pass through --rdzv-conf (torchrun's flag), with their unit.
RDZV_CONF_KEYS = {
    "join_timeout": "s",
    "last_call_timeout": "s",
    "close_timeout": "s",
    "heartbeat_timeout": "s",
    "keep_alive_interval": "s",
    "keep_alive_max_attempt": "count",
    "connect_timeout": "s",
}


@dataclass(frozen=True, kw_only=True, slots=True)
class StartConfig:
    """Everything ``elasticd start`` needs, validated."""

    script: Path
    script_args: tuple[str, ...] = ()
    min_nodes: int = 1
    max_nodes: int = 1
    nproc_per_node: int = 1
    etcd: tuple[Endpoint, ...] = ()  # empty: start an embedded etcd on 127.0.0.1
    etcd_connect_timeout_s: float = 10.0
    etcd_access: EtcdAccess = field(default_factory=EtcdAccess)  # TLS files and credentials
    run_id: str = "default"
    node_id: str = field(default_factory=socket.gethostname)
    local_addr: str | None = None
    checkpoint_dir: Path = Path("checkpoints")
    checkpoint_every_steps: int = 100
    checkpoint_every_seconds: float = 0.0
    keep_checkpoints: int = 3
    hang_timeout_s: float | None = None  # None: "auto"
    hang_attempts: int = 3  # the same step hanging this many times in a row stops the run (exit 1)
    startup_timeout_s: float = 600.0  # start-up, checkpoint save/load and first-step allowance of the watchdog
    straggler_factor: float = 1.5  # 0 disables straggler reports
    straggler_window_s: float = 30.0
    drain_timeout_s: float = 120.0  # SIGTERM / stop: budget for the checkpoint before the workers are stopped
    on_nan: OnNan = "rollback"
    recovery: Recovery = "hot"  # hot: survivors re-form in place; cold: every change restarts from a checkpoint
    max_restarts: int = 20
    monitor_interval_s: float = 0.1
    metrics_port: int = 9400
    metrics_addr: str = "127.0.0.1"
    log_format: LogFormat | None = None  # None: console on a TTY, JSON otherwise
    rdzv_conf: tuple[tuple[str, str], ...] = ()
    accelerate_config: Path | None = None  # None: accelerate's default file, if there is one

    @property
    def embedded_etcd(self) -> bool:
        return not self.etcd

    @property
    def etcd_text(self) -> str:
        return ",".join(str(e) for e in self.etcd)


def parse_nproc(value: str) -> int:
    """``N`` or ``auto`` (one worker per visible GPU, else 1)."""
    if value == "auto":
        try:
            import torch

            return max(torch.cuda.device_count(), 1)
        except ImportError:  # pragma: no cover - torch is a dependency
            return 1
    try:
        n = int(value)
    except ValueError:
        raise ConfigError("--nproc-per-node", f"expected a positive integer or 'auto', got {value!r}") from None
    return n


# Largest magnitude of a float option: a billion seconds is 31 years, and larger values overflow the sleeps and
# deadlines they end up in (time.sleep(1e308) raises OverflowError).
MAX_NUMBER = 1e9


def parse_number(value: object) -> float:
    """A finite number from a flag, an env value or a YAML value; ``ValueError`` naming the value otherwise.

    Every float option goes through here (click's through ``cli.FiniteFloat``; ``--hang-timeout`` and the
    ``--rdzv-conf`` values too). nan and ±inf are refused: nan passes every comparison, so no range check would catch
    it, and either one becomes a traceback or a wait that never ends further in (a nan timeout, an inf sleep).
    """
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"{value!r} is not a number")
    try:
        number = float(value)
    except (ValueError, OverflowError):
        raise ValueError(f"{value!r} is not a number") from None
    if not math.isfinite(number):
        raise ValueError(f"{value!r} is not a finite number")
    if abs(number) > MAX_NUMBER:
        raise ValueError(f"{value!r} is beyond {MAX_NUMBER:g}")
    return number


def parse_hang_timeout(value: str) -> float | None:
    """``S`` seconds (> 0) or ``auto``; ``None`` means auto."""
    if value == "auto":
        return None
    try:
        seconds = parse_number(value)
    except ValueError as exc:
        raise ConfigError("--hang-timeout", f"expected seconds or 'auto': {exc}") from None
    if seconds <= 0:
        raise ConfigError("--hang-timeout", f"must be > 0 seconds or 'auto', got {value!r}")
    return seconds


def parse_rdzv_conf(value: str) -> tuple[tuple[str, str], ...]:
    """``key=value[,key=value...]`` with keys from :data:`RDZV_CONF_KEYS` and numeric values."""
    pairs: list[tuple[str, str]] = []
    for item in filter(None, (p.strip() for p in value.split(","))):
        key, sep, raw = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in RDZV_CONF_KEYS:
            accepted = ", ".join(sorted(RDZV_CONF_KEYS))
            raise ConfigError("--rdzv-conf", f"unknown entry {item!r}; accepted keys: {accepted}")
        try:
            number = parse_number(raw.strip())
        except ValueError as exc:
            raise ConfigError("--rdzv-conf", f"{key} must be a number: {exc}") from None
        if number <= 0:
            raise ConfigError("--rdzv-conf", f"{key} must be > 0, got {raw!r}")
        pairs.append((key, raw.strip()))
    return tuple(pairs)


def access_from_options(values: dict[str, object]) -> EtcdAccess:
    """``--etcd-cacert/--etcd-cert/--etcd-key/--etcd-user/--etcd-password-file`` (and the password env var)."""

    def text(name: str) -> str | None:
        value = values.get(name)
        return str(value) if value else None

    return resolve_access(
        ca_cert=text("etcd_cacert"),
        cert=text("etcd_cert"),
        key=text("etcd_key"),
        user=text("etcd_user"),
        password_file=text("etcd_password_file"),
    )


def build_start_config(values: dict[str, object]) -> StartConfig:
    """Validate resolved option values (keys are the dataclass field names) into a :class:`StartConfig`."""
    script = Path(str(values["script"]))
    if not script.is_file():
        raise ConfigError("SCRIPT", f"{script} does not exist or is not a file")
    if not os.access(script, os.R_OK):
        raise ConfigError("SCRIPT", f"{script} is not readable")

    min_nodes, max_nodes = int(str(values["min_nodes"])), int(str(values["max_nodes"]))
    for key, n in (("--min-nodes", min_nodes), ("--max-nodes", max_nodes)):
        if n < 1:
            raise ConfigError(key, f"must be >= 1, got {n}")
    if min_nodes > max_nodes:
        raise ConfigError("--min-nodes", f"{min_nodes} is greater than --max-nodes {max_nodes}")

    nproc = parse_nproc(str(values["nproc_per_node"]))
    if nproc < 1:
        raise ConfigError("--nproc-per-node", f"must be >= 1 or 'auto', got {nproc}")

    run_id = str(values["run_id"])
    if (why := validate_run_id(run_id)) is not None:
        raise ConfigError("--run-id", f"{run_id!r} cannot name an etcd key and a directory: {why}")
    node_id = str(values["node_id"] or socket.gethostname())
    if (why := validate_node_id(node_id)) is not None:
        raise ConfigError("--node-id", f"{node_id!r} is not usable: {why}")

    etcd_text = values.get("etcd")
    etcd = parse_endpoints(str(etcd_text), key="--etcd") if etcd_text else ()
    access = access_from_options(values)
    if not etcd and access != EtcdAccess():
        raise ConfigError("--etcd", "TLS and credential options need an external etcd (--etcd HOST:PORT)")

    def non_negative(key: str, name: str) -> float:
        number = float(str(values[name]))
        if number < 0:
            raise ConfigError(key, f"must be >= 0, got {values[name]}")
        return number

    every_steps = int(non_negative("--checkpoint-every-steps", "checkpoint_every_steps"))
    every_seconds = non_negative("--checkpoint-every-seconds", "checkpoint_every_seconds")
    keep = int(str(values["keep_checkpoints"]))
    if keep < 1:
        raise ConfigError("--keep-checkpoints", f"must be >= 1, got {keep}")
    max_restarts = int(non_negative("--max-restarts", "max_restarts"))
    port = int(str(values["metrics_port"]))
    if not 0 <= port <= 65535:
        raise ConfigError("--metrics-port", f"must be 0 (off) or a TCP port 1-65535, got {port}")
    monitor = float(str(values["monitor_interval_s"]))
    if monitor <= 0:
        raise ConfigError("--monitor-interval", f"must be > 0 seconds, got {monitor}")
    hang_attempts = int(str(values.get("hang_attempts", 3)))
    if hang_attempts < 1:
        raise ConfigError("--hang-attempts", f"must be >= 1, got {hang_attempts}")
    startup = float(str(values.get("startup_timeout_s", 600.0)))
    if startup <= 0:
        raise ConfigError("--startup-timeout", f"must be > 0 seconds, got {startup}")
    straggler_factor = float(str(values.get("straggler_factor", 1.5)))
    if straggler_factor != 0 and straggler_factor <= 1:
        raise ConfigError("--straggler-factor", f"must be > 1 (or 0 to disable), got {straggler_factor}")
    straggler_window = float(str(values.get("straggler_window_s", 30.0)))
    if straggler_window <= 0:
        raise ConfigError("--straggler-window", f"must be > 0 seconds, got {straggler_window}")
    drain = float(str(values.get("drain_timeout_s", 120.0)))
    if drain <= 0:
        raise ConfigError("--drain-timeout", f"must be > 0 seconds, got {drain}")
    connect = float(str(values["etcd_connect_timeout_s"]))
    if connect <= 0:
        raise ConfigError("--etcd-connect-timeout", f"must be > 0 seconds, got {connect}")

    accelerate_text = values.get("accelerate_config")
    accelerate_config = Path(str(accelerate_text)) if accelerate_text else None
    if accelerate_config is not None:
        precheck(accelerate_config)

    return StartConfig(
        script=script,
        accelerate_config=accelerate_config,
        script_args=tuple(str(a) for a in values.get("script_args") or ()),  # type: ignore[attr-defined]
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        nproc_per_node=nproc,
        etcd=etcd,
        etcd_connect_timeout_s=connect,
        etcd_access=access,
        run_id=run_id,
        node_id=node_id,
        local_addr=str(values["local_addr"]) if values.get("local_addr") else None,
        checkpoint_dir=Path(str(values["checkpoint_dir"])),
        checkpoint_every_steps=every_steps,
        checkpoint_every_seconds=every_seconds,
        keep_checkpoints=keep,
        hang_timeout_s=parse_hang_timeout(str(values["hang_timeout"])),
        hang_attempts=hang_attempts,
        startup_timeout_s=startup,
        straggler_factor=straggler_factor,
        straggler_window_s=straggler_window,
        drain_timeout_s=drain,
        on_nan=str(values["on_nan"]),  # type: ignore[arg-type]  # click.Choice checked it
        recovery=str(values.get("recovery") or "hot"),  # type: ignore[arg-type]  # click.Choice checked it
        max_restarts=max_restarts,
        monitor_interval_s=monitor,
        metrics_port=port,
        metrics_addr=str(values["metrics_addr"]),
        log_format=values.get("log_format") or None,  # type: ignore[arg-type]
        rdzv_conf=parse_rdzv_conf(str(values.get("rdzv_conf") or "")),
    )
