"""A worker's connection to its run's lineage (elasticd/lineage.py): the fence of its commits, and the records its
resume point is chosen from.

The daemon gives every worker the fencing token of its group (``ELASTICD_FENCE_TOKEN``). Rank 0 commits a
checkpoint by recording it in one etcd transaction that requires ``lineage/token`` to still hold that token; a
worker of an older group (a straggler of a lost node, a node that was frozen while the others moved on) finds the
token replaced and its commit refused, so it can never add to the lineage.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from elasticd.errors import EtcdUnavailableError
from elasticd.etcd.client import EtcdClient, EtcdError
from elasticd.keys import RunKeys
from elasticd.lineage import CheckpointRecord, Lineage
from elasticd.worker.checkpoints import CommitDeferredError

# One commit transaction waits this long for an answer (s); an unanswered one is asked again later, so a short
# bound costs nothing and keeps an outage from holding the writer (and the next save behind it).
REQUEST_TIMEOUT_S = 2.0


class EtcdFence:
    """``fence(record) -> bool``: True when ``record`` was committed (the writer's token, ``record.token``, is still
    current). The token comes with each record, not from here: a background write that spans a re-formation in
    place is asked about under the token it started with (``saver.py``)."""

    def __init__(self, connect_args: Callable[[], dict[str, Any]], run_id: str) -> None:
        self._connect_args = connect_args  # EtcdClient.connect's: WorkerSettings.etcd_connect_args
        self._keys = RunKeys(run_id)
        self._client: EtcdClient | None = None

    def _lineage(self) -> Lineage:
        if self._client is None:  # lazily: only rank 0 ever needs etcd
            self._client = EtcdClient.connect(**self._connect_args(), request_timeout_s=REQUEST_TIMEOUT_S)
        return Lineage(self._client, self._keys)

    def __call__(self, record: CheckpointRecord) -> bool:
        try:
            return self._lineage().commit(record.token, record)
        except EtcdError as exc:
            # only a refusal for good refuses the commit; any other error leaves it unknown (seen during a lost
            # quorum: DEADLINE_EXCEEDED, UNAVAILABLE, "UNKNOWN: context deadline exceeded", no endpoint left)
            if exc.refused:
                return False  # etcd answered and will answer the same: refused, as a stale writer is
            # etcd away (or without quorum): whether the transaction was applied is unknown until it answers. The
            # saver keeps the sealed directory and asks again, in step order (worker/commit_queue.py).
            raise CommitDeferredError(str(exc)) from None
        except EtcdUnavailableError as exc:  # no connection yet, and none could be made
            raise CommitDeferredError(str(exc)) from None

    def records(self) -> list[CheckpointRecord] | None:
        """The lineage's records, newest first; None when etcd cannot be read (the caller falls back to disk)."""
        try:
            return self._lineage().records()
        except (EtcdError, EtcdUnavailableError):
            return None

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
