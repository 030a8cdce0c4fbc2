"""Hot recovery's in-place re-formations as the daemon sees them: metrics, the registry's epoch, one event each.

After each re-formation in place every worker sends one ``reconfigured`` beat (reason, the membership epoch now in
force, world size and node count after the change, seconds from the fault to the first step at the new size, bytes
it moved in the heal, committed steps lost, the new fencing token). A worker that gives the hot path up sends
``hot_fallback`` (reason, message) and exits for the cold restart. Every local worker reports the same change, so
only local rank 0's beat counts it: one count per node, as for non-finite steps. Heal bytes are each worker's own
(every rank holds a replica and sends or receives its own copy), so the node's counter adds every local rank's.

Beat fields come from the training process: a field that is missing or of the wrong type is left out of the figures
(and shown as it came in the event), never a crash of the beat receiver.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from elasticd.messages import Kind, kind_of
from elasticd.metrics import HOT_FALLBACK_REASONS, RECONFIGURATION_REASONS, Metrics

# Counts at or above this are not taken (a float cannot hold them exactly; far larger ones overflow it).
_MAX_COUNT = 1 << 63
# The label of a fallback reason the metrics do not know (e.g. a newer worker's): the event keeps the full reason.
OTHER_FALLBACK = "other"


class Reconfigurations:
    """Turns ``reconfigured`` and ``hot_fallback`` beats into metrics, registry fields and events.

    ``update_registry`` merges fields into this node's registry record (``NodeRegistry.update``); ``log`` returns the
    agent's current event logger (it is re-bound each round).
    """

    def __init__(
        self,
        metrics: Metrics,
        update_registry: Callable[..., None],
        log: Callable[[], Any],
        note: Callable[..., None] | None = None,
    ) -> None:
        self._metrics = metrics
        self._update_registry = update_registry
        self._log = log
        self._note = note or (lambda kind, **fields: None)  # the registry's recent changes (NodeRegistry.note)

    def on_beat(self, beat: dict[str, Any]) -> None:
        """Called for every beat of every local worker; a change counts once per node (local rank 0's beat)."""
        kind = kind_of(beat)
        if kind is Kind.RECONFIGURED and (heal_bytes := _count(beat, "heal_bytes")):
            self._metrics.heal_bytes_total.inc(heal_bytes)
        if kind is Kind.SHARD_MIRRORED:
            self._mirrored(beat)  # every worker's own shards
        if beat.get("local_rank", 0) != 0:
            return
        if kind is Kind.RECONFIGURED:
            self._reconfigured(beat)
        elif kind is Kind.HOT_FALLBACK:
            self._fallback(beat)

    def _reconfigured(self, beat: dict[str, Any]) -> None:
        m = self._metrics
        reason = beat.get("reason")
        epoch, world_size, nodes = _count(beat, "epoch"), _count(beat, "world_size"), _count(beat, "nodes")
        seconds, lost_steps = _seconds(beat, "seconds"), _count(beat, "lost_steps")
        if reason in RECONFIGURATION_REASONS:
            m.reconfigurations_total.labels(reason=reason).inc()
        if seconds is not None:
            m.reconfiguration_duration_seconds.observe(seconds)
        if lost_steps:
            m.lost_steps_total.inc(lost_steps)
        record: dict[str, int] = {}
        if epoch is not None:
            m.membership_epoch.set(epoch)
            record["epoch"] = epoch
        if world_size:
            m.world_size.set(world_size)
            record["world_size"] = world_size
        if nodes:
            m.nodes.set(nodes)
            record["nodes"] = nodes
        if record:
            self._update_registry(**record)
        self._log().info(
            "reconfigured",
            reason=reason,
            epoch=beat.get("epoch"),
            world_size=beat.get("world_size"),
            nodes=beat.get("nodes"),
            seconds=round(seconds, 3) if seconds is not None else beat.get("seconds"),
            heal_bytes=beat.get("heal_bytes"),
            lost_steps=beat.get("lost_steps"),
            step=beat.get("step"),
            token=beat.get("token"),
            rank=beat.get("rank"),
        )
        lost = beat.get("lost_nodes")
        lost_nodes = [str(node) for node in lost] if isinstance(lost, list) else []
        self._note(
            "reformed", reason=str(reason), seconds=seconds, world_size=world_size, lost_nodes=lost_nodes or None
        )
        for node in lost_nodes:
            # the same event as after a rendezvous that lost a node: operators follow one name either way
            self._log().warning("node_lost", lost_node=node, in_place=True)

    def _mirrored(self, beat: dict[str, Any]) -> None:
        """A worker's mirror generations since its last such beat, as sums: each generation is observed at the
        beat's mean (a worker sends at most a few a second, not one per generation)."""
        m = self._metrics
        generations = _count(beat, "generations") or 0
        for phase, key in (("blocking", "blocking_s"), ("total", "total_s")):
            seconds = _seconds(beat, key)
            if seconds is not None and generations:
                for _ in range(min(generations, 1000)):
                    m.shard_mirror_seconds.labels(phase=phase).observe(seconds / generations)
        if sent := _count(beat, "bytes"):
            m.shard_mirror_bytes_total.inc(sent)

    def _fallback(self, beat: dict[str, Any]) -> None:
        reason = str(beat.get("reason"))
        self._metrics.hot_fallbacks_total.labels(reason=fallback_label(reason)).inc()
        self._note("fallback", reason=reason)
        self._log().warning("hot_fallback", reason=reason, message=beat.get("message"), rank=beat.get("rank"))


def fallback_label(reason: str) -> str:
    """The metric label of a fallback reason: ``unsupported:fsdp`` counts as ``unsupported`` (bounded labels)."""
    head = reason.split(":", 1)[0]
    return head if head in HOT_FALLBACK_REASONS else OTHER_FALLBACK


def _count(beat: dict[str, Any], key: str) -> int | None:
    value = beat.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < _MAX_COUNT else None


def _seconds(beat: dict[str, Any], key: str) -> float | None:
    value = beat.get(key)
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value >= 0:
        return float(value)
    return None
