"""Parsing etcd endpoint lists ("HOST:PORT[,HOST:PORT...]") into typed values.

This module owns the accepted spellings of an endpoint: ``host``, ``host:port``, ``http://host:port`` (or
``https://``, the scheme is only tolerated: TLS is chosen by the certificate options) and bracketed IPv6
(``[::1]:2379``). A user mistake raises :class:`~elasticd.errors.ConfigError` naming the option it came from (the
caller's ``key``) and the bad part. Text only, no etcd: it sits below the option table, which parses ``--etcd`` with
it, and below the etcd client, which formats its endpoints with it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from elasticd.errors import ConfigError

DEFAULT_PORT = 2379  # etcd's IANA-registered client port

_EXPECTED = "expected HOST:PORT[,HOST:PORT...], e.g. 10.0.0.5:2379 or [::1]:2379"
# A DNS name or an IPv4 address: letters, digits, '-', '_' and dots (no empty labels).
_HOSTNAME = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9_-]*[A-Za-z0-9_])?(\.[A-Za-z0-9_]([A-Za-z0-9_-]*[A-Za-z0-9_])?)*$")
_IPV6 = re.compile(r"^[0-9A-Fa-f:.]+(%[A-Za-z0-9_.-]+)?$")
_SCHEMES = ("http://", "https://")


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One etcd client endpoint; ``host`` is kept without IPv6 brackets."""

    host: str
    port: int = DEFAULT_PORT

    @property
    def netloc(self) -> str:
        """``host:port`` as gRPC and URLs want it (IPv6 hosts in brackets)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def __str__(self) -> str:
        return self.netloc


def format_endpoints(endpoints: tuple[Endpoint, ...] | list[Endpoint]) -> str:
    """The comma-separated form that :func:`parse_endpoints` reads back."""
    return ",".join(str(endpoint) for endpoint in endpoints)


def parse_endpoints(text: str, *, key: str = "etcd endpoints") -> tuple[Endpoint, ...]:
    """Parse a comma-separated endpoint list; duplicates are dropped, order is kept.

    Raises ConfigError(key, ...) naming the first malformed entry and the expected form. A user's text names the
    option it came from as ``key`` (``--etcd``, ``ELASTICD_ETCD``, ``--rdzv-endpoint``); the default is for text no
    user wrote (an embedded etcd's own endpoint).
    """
    if not text or not text.strip():
        raise ConfigError(key, f"no etcd endpoint given; {_EXPECTED}")
    endpoints: list[Endpoint] = []
    for position, raw in enumerate(text.split(","), start=1):
        entry = raw.strip()
        if not entry:
            raise ConfigError(key, f"entry {position} of {text!r} is empty; {_EXPECTED}")
        endpoint = _parse_one(entry, key)
        if endpoint not in endpoints:
            endpoints.append(endpoint)
    return tuple(endpoints)


def _parse_one(entry: str, key: str) -> Endpoint:
    rest = entry
    lowered = entry.lower()
    if "://" in entry:
        scheme = next((s for s in _SCHEMES if lowered.startswith(s)), None)
        if scheme is None:
            raise ConfigError(key, f"{entry!r}: unsupported scheme (only http:// or https://); {_EXPECTED}")
        rest = entry[len(scheme) :]
        # A trailing slash is what people copy from a URL; any other path is a mistake.
        rest = rest[:-1] if rest.endswith("/") else rest
    if "/" in rest or "@" in rest or "?" in rest:
        raise ConfigError(key, f"{entry!r}: an endpoint has no path, user or query part; {_EXPECTED}")

    if rest.startswith("["):
        close = rest.find("]")
        if close < 0:
            raise ConfigError(key, f"{entry!r}: IPv6 address has no closing ']'; {_EXPECTED}")
        host, tail = rest[1:close], rest[close + 1 :]
        if not host or not _IPV6.match(host) or ":" not in host:
            raise ConfigError(key, f"{entry!r}: {host!r} is not an IPv6 address; {_EXPECTED}")
        if tail and not tail.startswith(":"):
            raise ConfigError(key, f"{entry!r}: unexpected {tail!r} after ']'; {_EXPECTED}")
        port_text = tail[1:] if tail else None
    else:
        if rest.count(":") > 1:
            raise ConfigError(key, f"{entry!r}: write an IPv6 address in brackets, e.g. [::1]:2379")
        host, sep, port_text_raw = rest.partition(":")
        port_text = port_text_raw if sep else None
        if not host or not _HOSTNAME.match(host):
            raise ConfigError(key, f"{entry!r}: {host!r} is not a valid host name or address; {_EXPECTED}")
    return Endpoint(host, _parse_port(port_text, entry, key))


def _parse_port(port_text: str | None, entry: str, key: str) -> int:
    if port_text is None:
        return DEFAULT_PORT
    if not (port_text.isascii() and port_text.isdigit()) or not 1 <= int(port_text) <= 65535:
        raise ConfigError(key, f"{entry!r}: port {port_text!r} is not a number in 1-65535; {_EXPECTED}")
    return int(port_text)
