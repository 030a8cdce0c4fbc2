"""What an option's value may look like: the parsers the option table (``options.py``) names.

Each parser takes the value click resolved (from the command line, ``ELASTICD_*`` or the ``--config`` file) and
returns what the configuration holds, or raises ``ValueError`` with a message; the table's ``resolve`` prefixes the
message with the option's flag, so a parser never names one.
"""

from __future__ import annotations

import math

# Rendezvous settings a user may pass through --rdzv-conf (torchrun's flag), with their unit. The etcd connect
# timeout is not one of them: --etcd-connect-timeout gives every etcd client of a node the same one.
RDZV_CONF_KEYS = {
    "join_timeout": "s",
    "last_call_timeout": "s",
    "close_timeout": "s",
    "heartbeat_timeout": "s",
    "keep_alive_interval": "s",
    "keep_alive_max_attempt": "count",
}

# Largest magnitude of a float option: a billion seconds is 31 years, and larger values overflow the sleeps and
# deadlines they end up in (time.sleep(1e308) raises OverflowError).
MAX_NUMBER = 1e9

AUTO = "auto"


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


def parse_nproc(value: object) -> int:
    """``N`` (>= 1) or ``auto`` (one worker per visible GPU, else 1)."""
    if value == AUTO:
        try:
            import torch

            return max(torch.cuda.device_count(), 1)
        except ImportError:  # pragma: no cover - torch is a dependency
            return 1
    try:
        n = int(str(value))
    except ValueError:
        raise ValueError(f"expected a positive integer or '{AUTO}', got {value!r}") from None
    if n < 1:
        raise ValueError(f"must be >= 1 or '{AUTO}', got {n}")
    return n


def parse_hang_timeout(value: object) -> float | None:
    """``S`` seconds (> 0) or ``auto``; ``None`` means auto."""
    if value == AUTO:
        return None
    try:
        seconds = parse_number(value)
    except ValueError as exc:
        raise ValueError(f"expected seconds or '{AUTO}': {exc}") from None
    if seconds <= 0:
        raise ValueError(f"must be > 0 seconds or '{AUTO}', got {value!r}")
    return seconds


def parse_rdzv_conf(value: object) -> tuple[tuple[str, str], ...]:
    """``key=value[,key=value...]`` with keys from :data:`RDZV_CONF_KEYS` and numeric values."""
    pairs: list[tuple[str, str]] = []
    for item in filter(None, (p.strip() for p in str(value or "").split(","))):
        key, sep, raw = item.partition("=")
        key = key.strip().replace("-", "_")
        if key == "connect_timeout":
            raise ValueError(
                "the etcd connect timeout is --etcd-connect-timeout (every etcd client of the node uses it)"
            )
        if not sep or key not in RDZV_CONF_KEYS:
            accepted = ", ".join(sorted(RDZV_CONF_KEYS))
            raise ValueError(f"unknown entry {item!r}; accepted keys: {accepted}")
        try:
            number = parse_number(raw.strip())
        except ValueError as exc:
            raise ValueError(f"{key} must be a number: {exc}") from None
        if number <= 0:
            raise ValueError(f"{key} must be > 0, got {raw!r}")
        pairs.append((key, raw.strip()))
    return tuple(pairs)
