"""Sizes that fit: which nodes of a round train when the round's node count does not split the global batch.

The workers learn the batch constraint (global batch, micro batch, processes per node) in ``run.dataloader`` and send
it in a ``batch_plan`` beat; the daemon records it under ``/elasticd/<run-id>/plan``. After every rendezvous the
round's rank-0 agent decides how many nodes train, the largest count in ``[--min-nodes, --max-nodes]`` (at most the
round's) that splits the global batch, and publishes it in the round's store, so that every agent of the round acts
on one answer even while the record is being written. Agents whose group rank is at or above that count are
**spares**: they start no workers, and the others' workers get ``WORLD_SIZE``/``RANK`` for the training nodes only.
A spare steps in at the next membership change: a node waiting to join, or a member gone from the round.

Before anything is recorded (the very first round), workers whose world does not fit exit with
:data:`~elasticd.errors.EXIT_RESIZE` after their beat; their daemon records the constraint and re-forms the
round, a membership restart that does not count against ``--max-restarts``. A global batch that fits no node count of
the range stays a usage error: the workers report it as fatal, every node exits 2.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any, Protocol

from elasticd.agent.policy import GroupState
from elasticd.agent.registry import NodeRegistry
from elasticd.errors import EXIT_RESIZE
from elasticd.etcd.client import EtcdClient, EtcdError
from elasticd.keys import RunKeys
from elasticd.messages import Kind, kind_of
from elasticd.metrics import Metrics
from elasticd.worker.batching import BatchConstraint, spare_warning

# The round's decision, in the round's store (torch prefixes it with the run and round).
TRAINING_NODES_KEY = "elasticd/training_nodes"
# Seconds a non-zero rank waits for rank 0's decision. Rank 0 publishes it right after the round forms, before it
# waits for anyone, so this only bounds how long a member that died in between is waited for (torch's own rank
# assignment, next, waits on the same rank 0).
AGREE_TIMEOUT_S = 30
# Seconds between a spare's etcd reads (the round's participants, its peers' registry records) while it waits.
WATCH_INTERVAL_S = 1.0


class PlanStore(Protocol):
    """Where the run's batch constraint is recorded."""

    def read(self) -> BatchConstraint | None: ...

    def write(self, constraint: BatchConstraint) -> None: ...


class EtcdPlanStore:
    """The constraint at ``/elasticd/<run-id>/plan``, as JSON; a value that does not parse reads as absent."""

    def __init__(self, client: EtcdClient, keys: RunKeys) -> None:
        self._client = client
        self._key = keys.plan

    def read(self) -> BatchConstraint | None:
        found = self._client.get(self._key)
        if found is None:
            return None
        try:
            return BatchConstraint.from_json(json.loads(found[0]))
        except ValueError:
            return None

    def write(self, constraint: BatchConstraint) -> None:
        self._client.put(self._key, json.dumps(constraint.to_json(), separators=(",", ":")).encode())


class Sizing:
    """One node's view: the constraint its workers reported, the round's training count, and whether it is a spare.

    ``agree`` runs inside the rank assignment of every rendezvous, ``started`` when workers would start,
    ``reform_needed`` every supervisor tick, ``on_beat`` on the beat receiver's thread.
    """

    def __init__(
        self,
        *,
        min_nodes: int = 1,
        max_nodes: int | None = None,
        plans: PlanStore | None = None,
        participants: Callable[[], int] | None = None,
        read_peers: Callable[[], list[dict[str, Any]]] = list,
        metrics: Metrics | None = None,
        registry: NodeRegistry | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._min = min_nodes
        self._max = max_nodes
        self._plans = plans
        self._participants = participants
        self._read_peers = read_peers
        self._metrics = metrics
        self._registry = registry
        self._clock = clock
        self._lock = threading.Lock()
        self._reported: BatchConstraint | None = None  # from this node's workers (the newest knowledge)
        self._recorded: BatchConstraint | None = None  # what this node knows etcd holds
        self._next_watch: dict[str, float] = {}  # per etcd read a spare repeats: when it is due next
        self.round: int | None = None
        self.nodes = 0  # nodes in the round
        self.training: int | None = None  # nodes of the round that train (None before the first round)
        self.spare = False

    @property
    def min_nodes(self) -> int:
        return self._min

    # -- the beat receiver's thread --------------------------------------------------------------------------------

    def on_beat(self, beat: dict[str, Any]) -> None:
        if kind_of(beat) is not Kind.BATCH_PLAN:
            return
        constraint = BatchConstraint.from_json(beat)
        if constraint is not None:
            with self._lock:
                self._reported = constraint

    # -- the rendezvous --------------------------------------------------------------------------------------------

    def agree(self, store: Any, group_rank: int, nodes: int, round_: int | None = None) -> int:
        """The round's training count: rank 0 decides and publishes it, the others read it (bounded wait)."""
        if group_rank == 0:
            training = self.training_nodes(nodes, self._known())
            store.set(TRAINING_NODES_KEY, str(training))
        else:
            old_timeout = store.timeout
            store.set_timeout(timedelta(seconds=AGREE_TIMEOUT_S))
            try:
                training = int(store.get(TRAINING_NODES_KEY))
            finally:
                store.set_timeout(old_timeout)
        self.round, self.nodes, self.training = round_, nodes, training
        self.spare = group_rank >= training
        self._next_watch.clear()
        return training

    def joining(self, round_: int | None) -> None:
        """This node's round is private (it joins a group in place, ``agent/joining.py``): it trains, and the
        group decides its sizes; this node never re-forms for them."""
        self.round, self.nodes, self.training, self.spare = round_, 1, None, False
        self._next_watch.clear()

    def training_nodes(self, nodes: int, constraint: BatchConstraint | None) -> int:
        """How many of ``nodes`` train under ``constraint``; all when it is unknown or fits no count of the range
        (the workers then stop the run with the usage error)."""
        high = nodes if self._max is None else self._max
        if constraint is None or not constraint.fitting(self._min, high):
            return nodes
        return constraint.training_nodes(nodes, self._min, high)

    def _known(self) -> BatchConstraint | None:
        with self._lock:
            reported = self._reported
        if reported is not None or self._plans is None:
            return reported
        try:
            self._recorded = self._plans.read()
        except EtcdError:
            return None  # only rank 0 decides, so every agent of the round still acts on the same answer
        return self._recorded

    # -- starting workers ------------------------------------------------------------------------------------------

    def started(self, log: Any, local_world_size: int) -> bool:
        """Report the round's sizes (metric, registry, warning); True when this node is a spare and starts nothing."""
        training = self.nodes if self.training is None else self.training
        world_size = training * local_world_size
        if self._metrics is not None:
            self._metrics.spare.set(1 if self.spare else 0)
            self._metrics.world_size.set(world_size)
        if self._registry is not None:
            fields: dict[str, Any] = {"world_size": world_size, "training_nodes": training}
            self._registry.update(**fields, **({"state": "spare", "workers": 0} if self.spare else {}))
        if training < self.nodes:
            constraint = self._known()
            high = self.nodes if self._max is None else self._max
            message = spare_warning(constraint, self.nodes, training, self._min, high) if constraint else ""
            log.warning(
                "batch_does_not_fit",
                nodes=self.nodes,
                training_nodes=training,
                spare=self.spare,
                message=message,
            )
        return self.spare

    def training_members(self, members: Sequence[str]) -> list[str]:
        """The node ids (in group-rank order) that train this round."""
        return list(members if self.training is None else members[: self.training])

    # -- the supervisor loop ---------------------------------------------------------------------------------------

    def reform_needed(self, state: GroupState, failures: Mapping[int, Any]) -> bool:
        """Must the round re-form for its sizes? The workers exited to be resized, the constraint they reported
        gives another training count, or (a spare) a member left the round. Records a newly reported constraint.

        ``failures`` are torch's ``ProcessFailure`` objects of the failed local workers, by global rank.
        """
        self._flush()
        if self.training is None:
            return False
        with self._lock:
            reported = self._reported
        codes = [getattr(failure, "exitcode", None) for failure in failures.values()]
        if state is GroupState.FAILED and codes and all(c == EXIT_RESIZE for c in codes) and reported is not None:
            return True
        if reported is not None and self.training_nodes(self.nodes, reported) != self.training:
            return True
        if self.spare and self._participants is not None and self._watch_due("participants"):
            return self._participants() < self.nodes
        return False

    def run_finished(self) -> bool:
        """A spare's question: did a training node of this round finish the run (its registry record says so)?"""
        if not self._watch_due("peers"):
            return False
        return any(peer.get("round") == self.round and peer.get("state") == "finished" for peer in self._read_peers())

    def _watch_due(self, read: str) -> bool:
        now = self._clock()
        if now < self._next_watch.get(read, 0.0):
            return False
        self._next_watch[read] = now + WATCH_INTERVAL_S
        return True

    def _flush(self) -> None:
        with self._lock:
            reported = self._reported
        if reported is None or reported == self._recorded or self._plans is None:
            return
        try:
            self._plans.write(reported)
        except EtcdError:
            return  # written on a later tick; this node's own knowledge already decides if it is rank 0
        self._recorded = reported
