"""Who the others wait for: the culprit of a hang, chosen from every node's evidence (a pure function).

The rules, first match wins (each names its reason in the summary):

1. a rank whose process is stopped, traced, a zombie or gone cannot take part in anything;
2. a rank that entered fewer collectives than the others (flight recorder) is the one they wait for;
3. a rank that has not started the step the others are in (the board) is the one they wait for;
4. a rank whose main thread is outside any collective while others are inside one;
5. otherwise the rank(s) silent the longest: they stopped making progress first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from elasticd.agent.evidence import RankEvidence

_DEAD_STATES = ("stopped", "traced", "zombie", "gone")


@dataclass(frozen=True, slots=True)
class Diagnosis:
    culprits: tuple[int, ...]  # global ranks
    reason: str
    step: int  # the step that did not complete
    evidence: tuple[RankEvidence, ...] = field(default=())

    @property
    def culprit_nodes(self) -> list[str]:
        return sorted({e.node for e in self.evidence if e.rank in self.culprits})

    def to_json(self) -> dict[str, Any]:
        return {
            "culprit_ranks": list(self.culprits),
            "culprit_nodes": self.culprit_nodes,
            "culprits": [
                {"rank": e.rank, "node": e.node, "pid": e.pid, "where": e.where, "state": e.process_state}
                for e in self.evidence
                if e.rank in self.culprits
            ],
            "reason": self.reason,
            "step": self.step,
            "ranks": [e.to_json() for e in sorted(self.evidence, key=lambda e: e.rank)],
        }


def diagnose(evidence: Sequence[RankEvidence]) -> Diagnosis:
    ranks = sorted(evidence, key=lambda e: e.rank)
    step = max((e.entered_step for e in ranks if e.entered_step is not None), default=0)
    everything = tuple(ranks)

    def verdict(chosen: Sequence[RankEvidence], reason: str) -> Diagnosis:
        return Diagnosis(tuple(e.rank for e in chosen), reason, step, everything)

    if not ranks:
        return Diagnosis((), "no evidence", 0)
    dead = [e for e in ranks if e.process_state in _DEAD_STATES]
    if dead and len(dead) < len(ranks):
        states = ", ".join(sorted({e.process_state for e in dead}))
        return verdict(dead, f"process {states}: it cannot reach the collective the others wait in")
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
