"""One diagnosis per hang, agreed by every node of the round through etcd.

Every daemon whose workers stop making progress (and every daemon that sees a peer's claim) takes part:

1. **claim** ``hang/round-<n>/claim`` with a create-if-absent transaction: the first node owns the hang and names
   it (its diagnostics directory); the others read the name;
2. **report**: each node collects its local evidence and puts it under ``hang/round-<n>/nodes/<node>``;
3. **summary**: the owner waits for the reports of every member of the round (bounded), chooses the culprit
   (``diagnosis.py``), counts how often the same step hung in a row (``hang/last``), and puts the summary; the
   others wait for it and act on that same summary, so all nodes restart, or all give up, with one diagnosis.

No node stops its workers before it has reported, and the owner publishes only after every report or the deadline,
so a node that kills its workers early never destroys another node's evidence. Keys of older rounds are removed by
the next round's rank-0 agent.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from elasticd.agent.diagnosis import diagnose
from elasticd.agent.evidence import RankEvidence
from elasticd.etcd.client import EtcdClient
from elasticd.keys import RunKeys

# Seconds the owner waits for the other nodes' reports, and a node waits for the owner's summary (the owner may die:
# then each node diagnoses from the reports it can read, which is the same set once all have reported).
REPORT_WAIT_S = 5.0
SUMMARY_WAIT_S = 8.0


class HangAgreement:
    def __init__(
        self,
        client: EtcdClient,
        keys: RunKeys,
        node_id: str,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._client = client
        self._keys = keys
        self._node = node_id
        self._clock = clock
        self._sleep = sleep

    def claim(self, round_: int, name: str) -> tuple[str, bool]:
        """(the hang's name, whether this node owns it); ``name`` is ours if we are first."""
        key = self._keys.hang_round(round_) + "claim"
        record = json.dumps({"name": name, "node": self._node, "at": time.time()})
        if self._client.create(key, record):
            return name, True
        existing = self.claimed(round_)
        return (existing, False) if existing else (name, True)

    def claimed(self, round_: int) -> str | None:
        """The name of a hang a node claimed in ``round_``, if any (the loop polls this)."""
        found = self._client.get(self._keys.hang_round(round_) + "claim")
        if found is None:
            return None
        return str(json.loads(found[0]).get("name", "")) or None

    def report(self, round_: int, evidence: list[RankEvidence]) -> None:
        key = f"{self._keys.hang_round(round_)}nodes/{self._node}"
        self._client.put(key, json.dumps([e.to_json() for e in evidence]))

    def reports(self, round_: int) -> dict[str, list[RankEvidence]]:
        prefix = f"{self._keys.hang_round(round_)}nodes/"
        return {
            key[len(prefix) :]: [RankEvidence.from_json(e) for e in json.loads(value)]
            for key, value, _rev in self._client.get_prefix(prefix)
        }

    def decide(self, round_: int, members: list[str], *, owner: bool, extra: dict[str, Any]) -> dict[str, Any]:
        """The summary every node acts on: written by the owner, read by the others."""
        summary_key = self._keys.hang_round(round_) + "summary"
        if not owner:
            deadline = self._clock() + SUMMARY_WAIT_S
            while self._clock() < deadline:
                found = self._client.get(summary_key)
                if found is not None:
                    return dict(json.loads(found[0]))
                self._sleep(0.05)
        deadline = self._clock() + REPORT_WAIT_S
        reports = self.reports(round_)
        while set(members) - set(reports) and self._clock() < deadline:
            self._sleep(0.05)
            reports = self.reports(round_)
        diagnosis = diagnose([e for node in sorted(reports) for e in reports[node]])
        summary = {
            **diagnosis.to_json(),
            "nodes_reported": sorted(reports),
            "nodes_missing": sorted(set(members) - set(reports)),
            **extra,
        }
        summary["attempt"] = self._count_attempt(diagnosis.step, summary.get("path", ""))
        if owner:
            self._client.put(summary_key, json.dumps(summary))
        return summary

    def _count_attempt(self, step: int, path: str) -> int:
        """How many hangs in a row stopped at ``step`` (this one included); a hang elsewhere starts again at 1."""
        found = self._client.get(self._keys.hang_last)
        last = json.loads(found[0]) if found else {}
        attempt = int(last.get("attempts", 0)) + 1 if last.get("step") == step else 1
        self._client.put(self._keys.hang_last, json.dumps({"step": step, "attempts": attempt, "path": path}))
        return attempt

    def forget_rounds_before(self, round_: int) -> None:
        """Called by a new round's rank-0 agent: older rounds' claims and reports are done with."""
        for key, _value, _rev in self._client.get_prefix(self._keys.hang_prefix):
            rest = key[len(self._keys.hang_prefix) :]
            if rest.startswith("round-"):
                number = rest[len("round-") :].split("/", 1)[0]
                if number.isdigit() and int(number) < round_:
                    self._client.delete(key)
