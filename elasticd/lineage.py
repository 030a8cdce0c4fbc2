"""A run's checkpoint lineage in etcd: the fencing token and the record of every committed checkpoint.

Keys (under ``/elasticd/<run-id>/``)::

    lineage/token                       the fencing token of the group allowed to commit now
    lineage/checkpoints/<step, 12 dig>  one record per committed checkpoint (JSON, see :class:`CheckpointRecord`)
    checkpoint/latest                   the newest record again (DESIGN.md §3), written in the same transaction

**The commit point** is one transaction that compares ``lineage/token`` with the writer's token and, only if they
are equal, writes the record. The files are durable before it (manifest last, fsynced), so a record always names a
complete checkpoint; a writer whose token was replaced (a stale round, an excluded member) can never add one.

**The token never repeats** for a run id: it is ``<round>.<random 64 bits>``, written by each new group's leader
through a compare-and-swap on the key's revision (:meth:`Lineage.begin`). Comparing the value, not a round number,
means a reused run id or an etcd that lost its data and counts rounds from zero again cannot revive an old writer.

A fresh lineage (a new run id, or an etcd that came back empty) adopts the newest verified checkpoint on disk, so
training resumes from it; a directory that the lineage does not record is otherwise never loaded.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import tenacity

from elasticd.errors import ElasticdError
from elasticd.etcd.client import EtcdClient, EtcdError
from elasticd.keys import RunKeys

# Writing a new token: attempts, and the longest the retries may take (s). A leader that cannot write it within
# this bound starts no workers: they could never commit.
TOKEN_ATTEMPTS = 5
TOKEN_DEADLINE_S = 10.0
# A writer id with no daemon (plain python / accelerate launch): partial directories are then "step-N.local.partial".
LOCAL_WRITER = "local"
ADOPTED = "adopted"  # the token of a record adopted from disk by a new lineage, not committed by a writer of it


class TokenWriteError(ElasticdError):
    """The new group's fencing token could not be written: its workers could never commit."""


@dataclass(frozen=True, slots=True)
class CheckpointRecord:
    """What the lineage knows of one committed checkpoint (its directory names are relative to the run dir)."""

    step: int
    dir: str  # the committed directory, ``step-N``
    partial: str  # the writer's own directory before the rename (for rolling a commit forward after a crash)
    manifest_sha256: str  # sha256 of the checkpoint's ``elasticd.json``
    token: str  # the token of the writer that committed it (:data:`ADOPTED` for one adopted from disk)
    committed_at: float

    def encode(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def decode(cls, raw: bytes) -> CheckpointRecord | None:
        """The record, or None when ``raw`` is not one (a foreign or truncated value is skipped, not fatal)."""
        try:
            data = json.loads(raw)
            return cls(
                step=int(data["step"]),
                dir=str(data["dir"]),
                partial=str(data["partial"]),
                manifest_sha256=str(data["manifest_sha256"]),
                token=str(data["token"]),
                committed_at=float(data["committed_at"]),
            )
        except (ValueError, KeyError, TypeError):
            return None


def new_token(round_: int) -> str:
    return f"{round_}.{secrets.token_hex(8)}"


def writer_id(token: str | None) -> str:
    """The part of a token that names a writer's directories (letters and digits only)."""
    return token.rsplit(".", 1)[-1] if token else LOCAL_WRITER


class Lineage:
    """The lineage of one run, over an etcd client (the daemon's, or a worker's own)."""

    def __init__(self, client: EtcdClient, keys: RunKeys, *, clock: Callable[[], float] = time.time) -> None:
        self._client = client
        self._keys = keys
        self._clock = clock

    def token(self) -> str | None:
        """The current token, or None when there is none (a fresh run, or etcd lost its data)."""
        current = self._client.get(self._keys.lineage_token)
        return None if current is None else current[0].decode()

    def begin(self, round_: int, adopt: Callable[[], CheckpointRecord | None] | None = None) -> str:
        """Make a new token current for a group of round ``round_`` and return it; :class:`TokenWriteError` when
        it could not be written within the bounds above (each failed attempt retries: etcd away, a racing writer).

        When the lineage records no checkpoint yet, ``adopt()`` may return one found on disk: it is recorded first.
        """
        token = new_token(round_)

        def attempt() -> str:
            if adopt is not None and not self.records():
                record = adopt()
                if record is not None:
                    self._client.create(self._keys.lineage_checkpoint(record.step), record.encode())
                    self._client.put(self._keys.checkpoint_latest, record.encode())
            current = self._client.get(self._keys.lineage_token)
            if not self._client.compare_and_swap(self._keys.lineage_token, token, current[1] if current else 0):
                raise EtcdError("token write", "", "CONFLICT", "another writer changed the token")
            return token

        try:
            return tenacity.Retrying(
                stop=tenacity.stop_after_attempt(TOKEN_ATTEMPTS) | tenacity.stop_after_delay(TOKEN_DEADLINE_S),
                wait=tenacity.wait_exponential(multiplier=0.1, max=1.0),
                retry=tenacity.retry_if_exception_type(EtcdError),
                reraise=True,
            )(attempt)
        except EtcdError as exc:
            raise TokenWriteError(f"could not write the fencing token for round {round_}: {exc}") from None

    def commit(self, token: str, record: CheckpointRecord) -> bool:
        """The commit point: record ``record`` if ``token`` is still current and nothing newer is recorded; False
        when the token was replaced or a later step is the latest already.

        In step order: a commit that waited out an etcd outage can never replace a newer ``checkpoint/latest``
        (one transaction compares the latest's revision read here). Taking the same record again is a success (a
        retried commit whose first answer was lost), as is re-recording a step with the same manifest."""
        raw = record.encode()
        latest = self._client.get(self._keys.checkpoint_latest)
        if latest is not None:
            current = CheckpointRecord.decode(latest[0])
            if current is not None and (current.step, current.manifest_sha256) == (record.step, record.manifest_sha256):
                if current.token == token:
                    return True  # this very commit, applied before its answer was lost
            elif current is not None and current.step >= record.step:
                return False  # superseded: a later checkpoint is the latest
        return self._client.put_all_if_revision_and_equal(
            self._keys.checkpoint_latest,
            latest[1] if latest is not None else 0,
            self._keys.lineage_token,
            token,
            {self._keys.lineage_checkpoint(record.step): raw, self._keys.checkpoint_latest: raw},
        )

    def records(self) -> list[CheckpointRecord]:
        """Every recorded checkpoint, newest step first."""
        found = []
        for _key, value, _rev in self._client.get_prefix(self._keys.lineage_checkpoints_prefix):
            record = CheckpointRecord.decode(value)
            if record is not None:
                found.append(record)
        return sorted(found, key=lambda r: r.step, reverse=True)
