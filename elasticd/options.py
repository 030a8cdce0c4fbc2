"""Every option of the ``elasticd`` commands, in one table: the one place an option is written.

An :class:`Option` is a flag with its type, default, help, the check its value must pass and the commands that take
it. Everything else is derived from the table: the click options (``cli.py``), the ``ELASTICD_<NAME>`` variable each
one reads, the keys the YAML ``--config`` file accepts (``config_file.py``), the defaults and checks of
:class:`~elasticd.config.StartConfig` (``config.py``, through :func:`resolve`), and the environment the daemon gives
its workers (an option marked ``worker`` travels under its own ``ELASTICD_<NAME>``, read back by
``worker/settings.py``). Adding an option is one entry here plus the code that uses its value;
``tests/unit/test_options.py`` walks the table and checks that every option reaches every place it must.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from elasticd.endpoints import parse_endpoints
from elasticd.errors import ConfigError
from elasticd.keys import validate_node_id, validate_run_id
from elasticd.option_values import AUTO, parse_hang_timeout, parse_nproc, parse_number, parse_rdzv_conf

ENV_PREFIX = "ELASTICD_"

# How click reads a value: int and float (finite: nan and inf are refused), text, one of `choices`, seconds or
# "auto", a file or directory path, an on/off flag.
Kind = Literal["int", "float", "text", "choice", "seconds|auto", "file", "dir", "flag"]
Check = Callable[[Any], str | None]  # the problem with a value, or None

START, STATUS, STOP, ETCD_DEV = "start", "status", "stop", "etcd"
CLIENTS = frozenset({STATUS, STOP})  # the commands that talk to a run's etcd from outside


@dataclass(frozen=True, slots=True)
class Option:
    flag: str
    default: Any = None
    help: str = ""
    kind: Kind = "text"
    choices: tuple[str, ...] = ()
    dest: str = ""  # the configuration field it fills; "" derives it from the flag (--min-nodes: min_nodes)
    parse: Callable[[Any], Any] | None = None  # click's value -> the configuration's; ValueError on a bad one
    check: Check | None = None
    commands: frozenset[str] = frozenset({START})
    client_default: Any = None  # the default for status and stop, where it differs (None: the same)
    worker: bool = False  # the daemon gives its workers this value, under `env`
    worker_default: Any = ...  # what a worker without a daemon takes (...: the default)
    reads_env: bool = True
    show_default: str | None = None  # the help's words for a default that is not a value

    @property
    def name(self) -> str:
        """The flag without dashes: the ``--config`` file's key."""
        return self.flag.lstrip("-")

    @property
    def field(self) -> str:
        return self.dest or self.name.replace("-", "_")

    @property
    def env(self) -> str:
        """``ELASTICD_MIN_NODES`` for ``--min-nodes``: read by the CLI, and given to workers when ``worker``."""
        return ENV_PREFIX + self.name.upper().replace("-", "_")

    def default_for(self, command: str) -> Any:
        return self.client_default if command in CLIENTS and self.client_default is not None else self.default

    def value(self, raw: Any) -> Any:
        """``raw`` (click's resolved value) parsed and checked; :class:`ConfigError` naming the flag otherwise."""
        try:
            if isinstance(raw, str) and self.kind in ("int", "float"):  # text, when click did not convert it
                raw = int(raw) if self.kind == "int" else parse_number(raw)
            value = self.parse(raw) if self.parse is not None else raw
        except ValueError as exc:  # (a parser's ConfigError already names its option)
            raise ConfigError(self.flag, str(exc)) from None
        if value is not None and self.check is not None and (problem := self.check(value)) is not None:
            raise ConfigError(self.flag, problem)
        return value

    def to_env(self, value: Any) -> str | None:
        """The text a worker gets for ``value`` (paths absolute: a worker may run elsewhere); None: not set."""
        if value is None:
            return None
        if isinstance(value, Path):
            return str(value.resolve())
        if isinstance(value, tuple):
            return ",".join(str(v) for v in value)
        return str(value)

    def from_env(self, env: Mapping[str, str]) -> Any:
        """A worker's value: what its daemon set, else the worker default (a run without a daemon)."""
        text = env.get(self.env)
        value = text or (self.default if self.worker_default is ... else self.worker_default)
        if value is None:
            return None
        if self.parse is Path:
            return Path(value)
        return {"int": int, "float": float}.get(self.kind, str)(value)


# --- checks ----------------------------------------------------------------------------------------------------


def at_least(minimum: int) -> Check:
    return lambda value: None if value >= minimum else f"must be >= {minimum}, got {value}"


def _positive_seconds(value: float) -> str | None:
    return None if value > 0 else f"must be > 0 seconds, got {value}"


def _metrics_port(value: int) -> str | None:
    return None if 0 <= value <= 65535 else f"must be 0 (off) or a TCP port 1-65535, got {value}"


def _tcp_port(value: int) -> str | None:
    return None if 1 <= value <= 65535 else f"must be a TCP port 1-65535, got {value}"


def _off_or_above_one(value: float) -> str | None:
    return None if value == 0 or value > 1 else f"must be > 1 (or 0 to disable), got {value}"


def _run_id(value: str) -> str | None:
    why = validate_run_id(value)
    return None if why is None else f"{value!r} cannot name an etcd key and a directory: {why}"


def _node_id(value: str) -> str | None:
    why = validate_node_id(value)
    return None if why is None else f"{value!r} is not usable: {why}"


def _endpoints(text: Any) -> Any:
    return parse_endpoints(str(text), key=ETCD.flag) if text else ()


def _optional_path(value: Any) -> Path | None:
    return Path(str(value)) if value else None


# --- the table ---------------------------------------------------------------------------------------------------

_ETCD_USERS = frozenset({START, STATUS, STOP})

CONFIG = Option(
    "--config",
    kind="file",
    help="YAML file of option names to values (CLI > env > file > default).",
    commands=_ETCD_USERS,
)
MIN_NODES = Option(
    "--min-nodes", 1, "Fewest nodes the job runs with.", "int", check=at_least(1), worker=True, worker_default=None
)
MAX_NODES = Option(
    "--max-nodes", 1, "Most nodes the job grows to.", "int", check=at_least(1), worker=True, worker_default=None
)
NPROC_PER_NODE = Option("--nproc-per-node", "1", f"Workers per node: N or '{AUTO}' (GPUs, else 1).", parse=parse_nproc)
ETCD = Option(
    "--etcd",
    None,
    "etcd endpoints HOST:PORT[,...]; absent: an embedded etcd on 127.0.0.1.",
    parse=_endpoints,
    commands=_ETCD_USERS,
    client_default="127.0.0.1:2379",
    worker=True,
)
ETCD_CONNECT_TIMEOUT = Option(
    "--etcd-connect-timeout",
    10.0,
    "Seconds every etcd client of the node (the daemon's, the rendezvous', the workers') waits for etcd to answer.",
    "float",
    dest="etcd_connect_timeout_s",
    check=_positive_seconds,
    commands=_ETCD_USERS,
    client_default=5.0,
    worker=True,
)
# TLS and credentials for etcd (elasticd/etcd/access.py): the password comes from a file or ELASTICD_ETCD_PASSWORD,
# never a flag. Workers get the same files under the same names.
ETCD_CACERT = Option(
    "--etcd-cacert", help="CA certificate that signed etcd's server certificate.", commands=_ETCD_USERS
)
ETCD_CERT = Option("--etcd-cert", help="Client certificate for etcd (with --etcd-key).", commands=_ETCD_USERS)
ETCD_KEY = Option("--etcd-key", help="Client certificate key for etcd.", commands=_ETCD_USERS)
ETCD_USER = Option("--etcd-user", help="etcd user (password: --etcd-password-file or env).", commands=_ETCD_USERS)
ETCD_PASSWORD_FILE = Option("--etcd-password-file", help="File holding the etcd password.", commands=_ETCD_USERS)
ETCD_ACCESS = (ETCD_CACERT, ETCD_CERT, ETCD_KEY, ETCD_USER, ETCD_PASSWORD_FILE)
RUN_ID = Option(
    "--run-id",
    "default",
    "Names the job in etcd and in the checkpoint dir.",
    check=_run_id,
    commands=_ETCD_USERS,
    worker=True,
)
NODE_ID = Option(
    "--node-id",
    help="This node's name in the run (default: the host name).",
    parse=lambda value: str(value or socket.gethostname()),
    check=_node_id,
    worker=True,
)
LOCAL_ADDR = Option(
    "--local-addr",
    help="Address other nodes reach this one at (default: its FQDN).",
    parse=lambda value: value or None,
    worker=True,
)
CHECKPOINT_DIR = Option("--checkpoint-dir", "checkpoints", "Where committed checkpoints live.", parse=Path, worker=True)
CHECKPOINT_EVERY_STEPS = Option(
    "--checkpoint-every-steps", 100, "0 disables step-based checkpoints.", "int", check=at_least(0), worker=True
)
CHECKPOINT_EVERY_SECONDS = Option(
    "--checkpoint-every-seconds", 0.0, "0 disables time-based checkpoints.", "float", check=at_least(0), worker=True
)
KEEP_CHECKPOINTS = Option("--keep-checkpoints", 3, "Committed checkpoints kept.", "int", check=at_least(1), worker=True)
HANG_TIMEOUT = Option(
    "--hang-timeout",
    AUTO,
    f"No-progress timeout in seconds, or '{AUTO}' (learned from step times).",
    "seconds|auto",
    dest="hang_timeout_s",
    parse=parse_hang_timeout,
)
HANG_ATTEMPTS = Option(
    "--hang-attempts", 3, "Exit 1 when one step hangs this many times in a row.", "int", check=at_least(1)
)
STARTUP_TIMEOUT = Option(
    "--startup-timeout",
    600.0,
    "Seconds allowed for start-up to the first step, and for each checkpoint save or load.",
    "float",
    dest="startup_timeout_s",
    check=_positive_seconds,
)
STRAGGLER_FACTOR = Option(
    "--straggler-factor",
    1.5,
    "Report a rank this much slower than the others; 0: off.",
    "float",
    check=_off_or_above_one,
)
STRAGGLER_WINDOW = Option(
    "--straggler-window",
    30.0,
    "Seconds a straggler must last.",
    "float",
    dest="straggler_window_s",
    check=_positive_seconds,
)
DRAIN_TIMEOUT = Option(
    "--drain-timeout",
    120.0,
    "SIGTERM or stop: seconds to wait for the checkpoint before stopping the workers.",
    "float",
    dest="drain_timeout_s",
    check=_positive_seconds,
)
ON_NAN = Option("--on-nan", "rollback", kind="choice", choices=("skip", "rollback", "stop"), worker=True)
RECOVERY = Option(
    "--recovery",
    "hot",
    "hot: survivors keep their processes and re-form in place; cold: restart from the newest checkpoint.",
    "choice",
    choices=("hot", "cold"),
    worker=True,
    worker_default="cold",  # without a daemon nothing can re-form a group
)
SHARD_MIRROR_EVERY = Option(
    "--shard-mirror-every",
    # measured (bench/shard_mirror.py at 3dec3dc: ~100M parameters with AdamW, 3 ranks on 2 cores, 7.1 s steps): a
    # mirror every step cost +5.9 % of the mean step, every 4 steps +0.6 %, the smallest measured K within 5 %
    4,
    "Sharded (FSDP2) jobs, --recovery hot: copy each rank's shards to another node's memory every K optimizer steps"
    " (a node loss then redoes at most K steps, without a restart); 0: no mirrors, a loss restarts from the"
    " checkpoint.",
    "int",
    check=at_least(0),
    worker=True,
)
MAX_RESTARTS = Option(
    "--max-restarts", 20, "Worker-group restarts on failure (torchrun's meaning).", "int", check=at_least(0)
)
MONITOR_INTERVAL = Option(
    "--monitor-interval", 0.1, "Worker poll, seconds.", "float", dest="monitor_interval_s", check=_positive_seconds
)
RDZV_CONF = Option(
    "--rdzv-conf", "", "Rendezvous timing, e.g. last_call_timeout=2,keep_alive_interval=1.", parse=parse_rdzv_conf
)
METRICS_PORT = Option("--metrics-port", 9400, "Prometheus endpoint port; 0 disables.", "int", check=_metrics_port)
METRICS_ADDR = Option("--metrics-addr", "127.0.0.1", "Address the metrics endpoint binds.")
ACCELERATE_CONFIG = Option(
    "--accelerate-config",
    help="accelerate's config file: the workers get the environment `accelerate launch` would give them.",
    kind="file",
    parse=_optional_path,
    show_default="accelerate's default, where `accelerate config` writes it",
)
LOG_FORMAT = Option(
    "--log-format",
    None,
    "Default: console on a TTY.",
    "choice",
    choices=("json", "console"),
    parse=lambda value: value or None,
)
JSON = Option("--json", False, "Machine-readable output.", "flag", dest="as_json", commands=frozenset({STATUS}))
WATCH = Option(
    "--watch", False, "A live view, redrawn every second until Ctrl-C.", "flag", commands=frozenset({STATUS})
)
DATA_DIR = Option(
    "--data-dir",
    None,
    "Default: a temporary dir.",
    "dir",
    parse=_optional_path,
    commands=frozenset({ETCD_DEV}),
    reads_env=False,
)
PORT = Option(
    "--port", 2379, "Client port on 127.0.0.1.", "int", check=_tcp_port, commands=frozenset({ETCD_DEV}), reads_env=False
)

# Every Option above, in the order written (a new one needs no second mention).
TABLE: tuple[Option, ...] = tuple(value for value in dict(globals()).values() if isinstance(value, Option))
BY_FLAG: Mapping[str, Option] = {option.flag: option for option in TABLE}


def of(command: str) -> tuple[Option, ...]:
    """The options ``command`` takes, in the table's order (its ``--help`` order)."""
    return tuple(option for option in TABLE if command in option.commands)


def worker_options() -> Iterator[Option]:
    return (option for option in TABLE if option.worker)


def resolve(values: Mapping[str, Any], command: str) -> dict[str, Any]:
    """Each option of ``command`` (but ``--config``) parsed and checked from ``values`` (click's resolved values, by
    field); an option missing from ``values`` takes its default. :class:`ConfigError` names the first bad one."""
    return {
        option.field: option.value(values.get(option.field, option.default_for(command)))
        for option in of(command)
        if option is not CONFIG
    }
