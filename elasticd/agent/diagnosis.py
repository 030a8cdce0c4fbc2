"""Who the others wait for: the culprit of a hang, chosen from every node's evidence (a pure function).

The rules, first match wins (each names its reason in the summary):

1. a member node whose daemon is gone or frozen and that sent no evidence (``lost``: its registry record expired,
   or its rendezvous heartbeat is stale; see ``liveness.py``): a whole node stopped or died, and everyone else
   waits for it. Its workers' exits elsewhere (a collective that failed because of it) are consequences;
2. a rank whose process is stopped or traced: alive, but it cannot take part in anything;
3. a rank whose process exited (zombie or gone) while the others are alive: its failure is what they wait for;
4. a rank that entered fewer collectives than the others (flight recorder) is the one they wait for;
5. a rank that has not started the step the others are in (the board) is the one they wait for;
6. a rank whose main thread is outside any collective while others are inside one;
7. otherwise the rank(s) silent the longest: they stopped making progress first.

Before these, a **partition** (:func:`partitioned`, from ``reachability.py``): when some members cannot reach each
other, the culprits are the members outside the largest set that all reach each other, whatever their evidence
says (every rank of a partitioned group stalls at once and looks like it stopped first).

Only rules 2 and 4-7 describe a **hang**: a live process that does not progress, which may recur at the same step
after a restart, so only they count toward ``--hang-attempts``. A lost node (rule 1) and an exited worker (rule 3)
are faults of a node or a process, not of the training step (``cause`` says which).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from elasticd.agent.evidence import EXITED_STATES, FROZEN_STATES, RankEvidence

# Values of Diagnosis.cause.
HANG, NODE_LOST, WORKER_EXITED, PARTITION = "hang", "node_lost", "worker_exited", "partition"


@dataclass(frozen=True, slots=True)
class Diagnosis:
    culprits: tuple[int, ...]  # global ranks
    reason: str
    step: int  # the step that did not complete
    evidence: tuple[RankEvidence, ...] = field(default=())
    lost_nodes: tuple[str, ...] = ()  # culprit nodes that sent no evidence (rule 1)
    cause: str = HANG

    @property
    def counted(self) -> bool:
        """Whether this counts toward ``--hang-attempts`` (a hang of the training, not a lost node or process)."""
        return self.cause == HANG

    @property
    def culprit_nodes(self) -> list[str]:
        return sorted({e.node for e in self.evidence if e.rank in self.culprits} | set(self.lost_nodes))

    def to_json(self) -> dict[str, Any]:
        return {
            "culprit_ranks": list(self.culprits),
            "culprit_nodes": self.culprit_nodes,
            "culprits": [
                {"rank": e.rank, "node": e.node, "pid": e.pid, "where": e.where, "state": e.process_state}
                for e in self.evidence
                if e.rank in self.culprits
            ]
            + [{"rank": None, "node": node, "pid": None, "where": "", "state": "lost"} for node in self.lost_nodes],
            "reason": self.reason,
            "cause": self.cause,
            "counted": self.counted,
            "step": self.step,
            "ranks": [e.to_json() for e in sorted(self.evidence, key=lambda e: e.rank)],
        }


def diagnose(evidence: Sequence[RankEvidence], lost: Mapping[str, str] | None = None) -> Diagnosis:
    """The culprit among ``evidence`` (every reporting rank) and ``lost`` (node -> why, for members whose daemon
    is gone or frozen and that did not report)."""
    ranks = sorted(evidence, key=lambda e: e.rank)
    step = max((e.entered_step for e in ranks if e.entered_step is not None), default=0)
    everything = tuple(ranks)
    reported = {e.node for e in ranks}
    missing = {node: why for node, why in (lost or {}).items() if node not in reported}

    def verdict(chosen: Sequence[RankEvidence], reason: str, cause: str = HANG) -> Diagnosis:
        return Diagnosis(tuple(e.rank for e in chosen), reason, step, everything, cause=cause)

    if missing:
        nodes = sorted(missing)
        why = "; ".join(f"node {node}: {missing[node]}" for node in nodes)
        return Diagnosis((), f"{why}: the others wait for it", step, everything, tuple(nodes), NODE_LOST)
    if not ranks:
        return Diagnosis((), "no evidence", 0)
    frozen = [e for e in ranks if e.process_state in FROZEN_STATES]
    if frozen and len(frozen) < len(ranks):
        states = ", ".join(sorted({e.process_state for e in frozen}))
        return verdict(frozen, f"process {states}: it cannot reach the collective the others wait in")
    exited = [e for e in ranks if e.process_state in EXITED_STATES]
    if exited and len(exited) < len(ranks):
        return verdict(exited, "process exited: the others wait in a collective it will never join", WORKER_EXITED)
    counted = [e for e in ranks if e.collectives is not None]
    if len(counted) == len(ranks) and len({e.collectives for e in counted}) > 1:
        fewest = min(e.collectives or 0 for e in counted)
        most = max(e.collectives or 0 for e in counted)
        behind = [e for e in counted if e.collectives == fewest]
        return verdict(behind, f"entered {fewest} collectives where the others entered up to {most}")
    positioned = [e for e in ranks if e.entered_step is not None]
    if len(positioned) == len(ranks) and len({e.entered_step for e in positioned}) > 1:
        lowest = min(e.entered_step or 0 for e in positioned)
        behind = [e for e in positioned if e.entered_step == lowest]
        return verdict(behind, f"never started step {lowest + 1}, which the others are in")
    inside = [e for e in ranks if e.in_collective]
    outside = [e for e in ranks if e.in_collective is False]
    if inside and outside:
        return verdict(outside, "outside any collective while the others wait inside one")
    longest = max(e.silent_s for e in ranks)
    first = [e for e in ranks if longest - e.silent_s < 0.05]
    return verdict(first, "stopped making progress first")


def partitioned(evidence: Sequence[RankEvidence], cut: set[str], kept: Sequence[str]) -> Diagnosis:
    """The diagnosis of a partition: the ranks of the ``cut`` nodes (and the cut nodes that sent no evidence) are
    the culprits; ``kept`` are the members that all reach each other. Not a hang of the training: not counted."""
    ranks = tuple(sorted(evidence, key=lambda e: e.rank))
    step = max((e.entered_step for e in ranks if e.entered_step is not None), default=0)
    silent = tuple(sorted(cut - {e.node for e in ranks}))
    reason = f"unreachable from {', '.join(sorted(kept))} (the data network is partitioned): the others go on"
    return Diagnosis(tuple(e.rank for e in ranks if e.node in cut), reason, step, ranks, silent, PARTITION)
