"""The loop's etcd reads while etcd may be away: each answers its fallback then, and one warning says so.

The workers train on while etcd is unreachable; the supervisor loop looks again at its next step. Every part of
the agent that reads etcd from the loop shares one :class:`EtcdPoll`, so the ``etcd_unavailable`` warning comes at
most once per :data:`ETCD_WARN_INTERVAL_S`, however many reads fail.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

from elasticd.etcd.client import EtcdError

T = TypeVar("T")

# Seconds between two etcd_unavailable warnings while etcd stays away.
ETCD_WARN_INTERVAL_S = 10.0


class EtcdPoll:
    """``poll(read, fallback)``: ``read()``, or ``fallback`` (and a rate-limited warning) while etcd is away."""

    def __init__(self, clock: Callable[[], float], log: Callable[[], Any]) -> None:
        self._clock = clock
        self._log = log
        self._warned_at = -ETCD_WARN_INTERVAL_S

    def __call__(self, read: Callable[[], T], fallback: T) -> T:
        try:
            return read()
        except (EtcdError, RendezvousConnectionError) as exc:
            now = self._clock()
            if now - self._warned_at >= ETCD_WARN_INTERVAL_S:
                self._warned_at = now
                self._log().warning("etcd_unavailable", error=str(exc) or type(exc).__name__)
            return fallback
