"""Fencing checkpoint commits through etcd: a writer from a stale rendezvous round cannot commit.

Each round's rank-0 agent writes the round number to ``/elasticd/<run-id>/round``. A worker commits a checkpoint by
writing ``checkpoint/latest`` in one transaction that requires that key to still hold the round the worker was
started in. A worker of an older round (a straggler of a lost node, a zombie that outlived its daemon) finds the
round moved on and its commit refused, so it can never overwrite the newer round's progress.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

from elasticd.etcd.access import EtcdAccess
from elasticd.etcd.client import EtcdClient, EtcdError
from elasticd.etcd.endpoints import parse_endpoints
from elasticd.keys import RunKeys

Fence = Callable[[int], bool]


class EtcdFence:
    """``fence(step) -> bool``: True when this round may commit ``step`` (and ``checkpoint/latest`` now says so)."""

    def __init__(self, endpoints: str, run_id: str, round_: int, *, connect_timeout_s: float = 10.0) -> None:
        self._endpoints = endpoints
        self._keys = RunKeys(run_id)
        self._round = round_
        self._connect_timeout_s = connect_timeout_s
        self._client: EtcdClient | None = None

    def __call__(self, step: int) -> bool:
        if self._client is None:  # lazily: only the committing rank ever needs etcd
            self._client = EtcdClient.connect(
                parse_endpoints(self._endpoints),
                connect_timeout_s=self._connect_timeout_s,
                **EtcdAccess.from_worker_env().connect_kwargs(),
            )
        record = json.dumps({"step": step, "round": self._round, "committed_at": time.time()})
        try:
            return self._client.put_if_equal(self._keys.round, str(self._round), self._keys.checkpoint_latest, record)
        except EtcdError:
            # etcd away at commit time: refuse rather than risk a stale commit; the next checkpoint tries again.
            return False

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
