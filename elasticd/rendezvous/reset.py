"""Clearing what a finished earlier run of the same run id left in etcd, so the id can be used again.

torch closes the rendezvous when a job ends (the state says ``closed`` for its TTL), and a drain request stays
until removed: a new job under the same id would join a closed rendezvous or drain at once. The first daemon of a
new job (no other live node in the registry) removes both. Only a *closed* state is removed, with a
compare-and-delete on its revision, so a racing node that is already forming a new round is never disturbed.
"""

from __future__ import annotations

import pickle

from elasticd.etcd.client import EtcdClient
from elasticd.keys import RunKeys
from elasticd.rendezvous.lease_round import RoundRecord


def clear_finished_run(client: EtcdClient, keys: RunKeys) -> list[str]:
    """Remove a closed rendezvous state, stale control requests, hang records and the batch plan; returns what
    was removed. The checkpoint lineage stays: a new job under the same run id resumes from it."""
    removed: list[str] = []
    current = client.get(keys.rdzv_state)
    if current is not None:
        value, revision = current
        try:
            # torch's own format: the state is a pickle (it is trusted exactly as torch's backends trust it).
            closed = bool(getattr(pickle.loads(value), "closed", False))
        except Exception:
            closed = False
        if closed and client.delete_if_revision(keys.rdzv_state, revision):
            client.delete_prefix(keys.store_prefix)
            removed.append("closed rendezvous")
    record = client.get(keys.rdzv_round)  # the lease rendezvous's (lease_handler.py)
    if (
        record is not None
        and RoundRecord.decode(record[0]).closed
        and client.delete_if_revision(keys.rdzv_round, record[1])
    ):
        for prefix in (keys.rdzv_lobby_prefix, keys.rdzv_joined_root, keys.store_prefix):
            client.delete_prefix(prefix)
        removed.append("closed rendezvous")
    if client.get_prefix(keys.control_prefix):
        client.delete_prefix(keys.control_prefix)
        removed.append("control requests")
    if client.get_prefix(keys.hang_prefix):
        client.delete_prefix(keys.hang_prefix)  # a new job starts its hang repeat count at zero
        removed.append("hang diagnoses")
    if client.delete(keys.plan):
        removed.append("batch plan")  # the new job's workers report their own (agent/spares.py)
    return removed
