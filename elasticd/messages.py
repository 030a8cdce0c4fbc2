"""The beat protocol between a worker and its node's daemon, defined in one place: the kinds of message, the fields
each kind carries, the types the daemon checks, and the protocol version.

A message is one JSON object in one datagram: the envelope (``kind``, ``v``, ``rank``, ``local_rank``, ``ts``: see
:func:`encode`) and the fields of its kind (:data:`FIELDS`). The worker sends with
:class:`elasticd.worker.beats.BeatClient`, the daemon parses with :func:`elasticd.agent.beats.parse_beat` and each
consumer dispatches on :func:`kind_of`. The kinds are a ``StrEnum``: a member is its string on the wire.

**Version rule.** Every message carries ``"v": PROTOCOL_VERSION``. The number goes up only for a change an older
daemon would misread (a field that changes its meaning or type, a kind that changes its meaning); a new kind or a new
field keeps it, because a daemon ignores kinds and fields it does not know. A daemon takes a message without ``v``
as version 1 (a worker from before the field: the same messages), and drops a message of a higher version, counted
and logged like any datagram that is not a beat: it must not guess at what a newer worker means.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from enum import StrEnum
from typing import Any

PROTOCOL_VERSION = 1
# What a message without a version field is (sent by a worker from before the field existed).
UNVERSIONED = 1

# The envelope: every message has these, whatever its kind.
KIND = "kind"
VERSION = "v"
RANK = "rank"
LOCAL_RANK = "local_rank"
TS = "ts"


class Kind(StrEnum):
    """What a message reports."""

    STEP = "step"  # optimizer steps since the last step beat (at most one beat per 250 ms)
    HELLO = "hello"  # resumed and listening: what this worker can do (:class:`Capability`)
    RESUMED = "resumed"  # the step training (re)starts from
    BATCH_PLAN = "batch_plan"  # the batch constraint the daemons size rounds with (agent/spares.py)
    NONFINITE = "nonfinite"  # a non-finite step, and what the guard did about it
    FATAL = "fatal"  # the worker gives up for good (:class:`FatalReason`): the run stops, no restart
    CHECKPOINT_SAVED = "checkpoint_saved"  # the checkpoint the daemon asked for is saved (and whether committed)
    CHECKPOINT_COMMITTED = "checkpoint_committed"  # rank 0 committed a checkpoint
    CHECKPOINT_FAILED = "checkpoint_failed"  # a save failed: which rank, and the OS error that says why
    CHECKPOINT_FENCED = "checkpoint_fenced"  # the fence refused a commit: this writer's token is no longer current
    CHECKPOINT_DEFERRED = "checkpoint_commit_deferred"  # etcd could not take a commit now: it waits, in step order
    CHECKPOINT_UNUSABLE = "checkpoint_unusable"  # a checkpoint failed verification and was skipped on resume
    RECONFIGURED = "reconfigured"  # the group re-formed in place (hot recovery); the first step at the new size
    HOT_FALLBACK = "hot_fallback"  # the worker gives up the hot path and exits for a cold restart
    SHARD_MIRRORED = "shard_mirrored"  # a sharded job's mirror generations since the last such beat (their sums)


class Capability(StrEnum):
    """What a ``hello`` says a worker can do (its ``capabilities`` list)."""

    CHECKPOINT_REQUEST = "checkpoint_request"  # saves a checkpoint when its daemon asks (SIGUSR2)
    STACKS = "stacks"  # dumps its Python stacks on SIGUSR1
    IN_PLACE = "in_place"  # armed hot recovery: re-forms its group in place when a peer is lost


class FatalReason(StrEnum):
    """Why a worker gave up (a ``fatal`` message's ``reason``)."""

    CONFIG = "config"  # a usage error a restart would repeat: the run exits 2
    NAN = "nan"  # --on-nan stop, or repeated non-finite steps after rollbacks


# Each kind's own fields (beside the envelope). A daemon ignores fields it does not know, so a worker may add one
# without a version change; a field listed here is one the daemon may read.
FIELDS: Mapping[Kind, frozenset[str]] = {
    Kind.STEP: frozenset({"step", "loss", "samples", "step_time_s", "train_s", "own_s", "phase"}),
    Kind.HELLO: frozenset({"capabilities", "pid"}),
    Kind.RESUMED: frozenset({"step"}),
    Kind.BATCH_PLAN: frozenset({"global_batch_size", "micro_batch_size", "nproc_per_node"}),
    Kind.NONFINITE: frozenset({"step", "action"}),
    Kind.FATAL: frozenset({"reason", "message", "exit_code"}),
    Kind.CHECKPOINT_SAVED: frozenset({"step", "requested", "committed"}),
    Kind.CHECKPOINT_COMMITTED: frozenset({"step", "blocking_s", "total_s", "path", "asynchronous"}),
    Kind.CHECKPOINT_FAILED: frozenset({"step", "error", "errno", "path", "os_error"}),
    Kind.CHECKPOINT_FENCED: frozenset({"step"}),
    Kind.CHECKPOINT_DEFERRED: frozenset({"step", "error"}),
    Kind.CHECKPOINT_UNUSABLE: frozenset({"step", "reason"}),
    Kind.RECONFIGURED: frozenset(
        {
            "seconds",
            "reason",
            "epoch",
            "world_size",
            "nodes",
            "heal_bytes",
            "lost_steps",
            "token",
            "lost_nodes",
            "node_ids",
            "step",
        }
    ),
    Kind.HOT_FALLBACK: frozenset({"reason", "message"}),
    Kind.SHARD_MIRRORED: frozenset({"step", "generations", "blocking_s", "total_s", "bytes"}),
}

# The types the daemon checks, in any kind that has the field (a message that breaks one is dropped).
RANK_FIELDS = (RANK, LOCAL_RANK)  # integers in [0, 2^24)
COUNT_FIELDS = ("step", "samples", "exit_code", "pid", "generations", "bytes")  # integers >= 0
SECONDS_FIELDS = (TS, "step_time_s", "train_s", "own_s", "blocking_s", "total_s")  # finite numbers >= 0
NUMBER_FIELDS = ("loss",)  # any number: nan and inf are what the guard reports
LIST_FIELDS = ("capabilities",)


def encode(kind: Kind, fields: Mapping[str, Any], *, rank: int, local_rank: int, ts: float) -> bytes:
    """One message as it goes on the wire: compact JSON, the envelope first."""
    message = {KIND: kind, VERSION: PROTOCOL_VERSION, RANK: rank, LOCAL_RANK: local_rank, TS: ts, **fields}
    return json.dumps(message, separators=(",", ":")).encode()


def kind_of(message: Mapping[str, Any]) -> Kind | None:
    """The message's kind, or None for one this side does not know (a newer worker's: ignored, not an error)."""
    value = message.get(KIND)
    try:
        return Kind(value) if isinstance(value, str) else None
    except ValueError:
        return None
