"""One diagnosis per hang, agreed by every node of the round through etcd.

Every daemon whose workers stop making progress (and every daemon that sees a peer's claim) takes part:

1. **claim** ``hang/round-<n>/claim`` with a create-if-absent transaction: the first node owns the hang and names
   it (its diagnostics directory); the others read the name;
2. **report**: each node collects its local evidence and puts it under ``hang/round-<n>/nodes/<node>``, tagged
   with the hang's name;
3. **summary**: the owner waits for the reports of every member of the round (bounded, and never for a member
   whose daemon is gone or frozen: ``liveness.py``), chooses the culprit (``diagnosis.py``), counts how often the
   same step hung in a row (``hang/last``), and puts the summary; the others wait for it and act on that same
   summary, so all nodes restart, or all give up, with one diagnosis.

A hang can be **abandoned**: a node whose own worker exited while it took part (the silence was a failure on its
way, which torch's monitor reports) gives it up; an owner that gives up puts an ``abandoned`` summary, so the
others give up too instead of waiting, and a later hang of the same round may claim afresh.

**Repeats** (``hang/last``: step, attempts, round): only a diagnosis whose cause is a hang of the training counts
(not a lost node, not an exited worker), and at most once per round, never from a round older than the last one
counted: a late report from a node that was stopped and evicted never pushes a healthy run toward
``--hang-attempts``.

No node stops its workers before it has reported, and the owner publishes only after every report or the deadline,
so a node that kills its workers early never destroys another node's evidence. Keys of older rounds are removed by
the next round's rank-0 agent.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from elasticd.agent.diagnosis import diagnose, partitioned
from elasticd.agent.evidence import RankEvidence
from elasticd.agent.reachability import partition
from elasticd.etcd.client import EtcdClient
from elasticd.keys import RunKeys

# Seconds the owner waits for the other nodes' reports, and a node waits for the owner's summary (the owner may die:
# then each node diagnoses from the reports it can read, which is the same set once all have reported).
REPORT_WAIT_S = 5.0
SUMMARY_WAIT_S = 8.0
# Seconds between two polls of etcd while waiting.
_POLL_S = 0.05


class HangAgreement:
    def __init__(
        self,
        client: EtcdClient,
        keys: RunKeys,
        node_id: str,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        reach: Callable[[Sequence[str]], dict[str, bool]] | None = None,
    ) -> None:
        """``reach(members)``: which of the other members this node reaches (``reachability.reached``), reported
        with the evidence; None reports nothing, and no partition is ever diagnosed."""
        self._reach = reach
        self._client = client
        self._keys = keys
        self._node = node_id
        self._clock = clock
        self._sleep = sleep

    def _key(self, round_: int, name: str) -> str:
        return self._keys.hang_round(round_) + name

    def claim(self, round_: int, name: str) -> tuple[str, bool]:
        """(the hang's name, whether this node owns it); ``name`` is ours if we are first, or if the round's
        earlier hang was abandoned (then it is cleared first)."""
        key = self._key(round_, "claim")
        record = json.dumps({"name": name, "node": self._node, "at": time.time()})
        if self._client.create(key, record):
            return name, True
        found = self._client.get(key)
        if found is not None and self._abandoned(round_, _name(found[0])):
            # the round's earlier hang was given up (a worker exited); one that outlives it is a new hang
            if self._client.delete_if_revision(key, found[1]):
                self._client.delete(self._key(round_, "summary"))
                if self._client.create(key, record):
                    return name, True
            found = self._client.get(key)
        existing = _name(found[0]) if found is not None else ""
        return (existing, False) if existing else (name, True)

    def claimed(self, round_: int) -> str | None:
        """The name of a hang a node claimed in ``round_`` and did not abandon, if any (the loop polls this)."""
        found = self._client.get(self._key(round_, "claim"))
        if found is None:
            return None
        name = _name(found[0])
        return name if name and not self._abandoned(round_, name) else None

    def report(
        self, round_: int, evidence: Sequence[RankEvidence], hang: str = "", members: Sequence[str] = ()
    ) -> None:
        """This node's evidence; with ``members``, also which of them it reaches (probed now)."""
        key = self._key(round_, f"nodes/{self._node}")
        record: dict[str, Any] = {"hang": hang, "evidence": [e.to_json() for e in evidence]}
        if self._reach is not None and members:
            record["reached"] = self._reach(members)
        self._client.put(key, json.dumps(record))

    def reached(self, round_: int, hang: str = "") -> dict[str, dict[str, bool]]:
        """What each node that reported on ``hang`` said it reached (nothing for a node that did not probe)."""
        prefix = self._key(round_, "nodes/")
        found = {}
        for key, value, _rev in self._client.get_prefix(prefix):
            data = json.loads(value)
            if isinstance(data, dict) and data.get("hang", "") == hang and isinstance(data.get("reached"), dict):
                found[key[len(prefix) :]] = {str(k): bool(v) for k, v in data["reached"].items()}
        return found

    def reports(self, round_: int, hang: str = "") -> dict[str, list[RankEvidence]]:
        """Every node's report of the hang called ``hang`` in ``round_``."""
        prefix = self._key(round_, "nodes/")
        found = {}
        for key, value, _rev in self._client.get_prefix(prefix):
            data = json.loads(value)
            if isinstance(data, dict) and data.get("hang", "") == hang:
                found[key[len(prefix) :]] = [RankEvidence.from_json(e) for e in data.get("evidence") or []]
        return found

    def abandon(self, round_: int, hang: str, reason: str) -> None:
        """The owner gives the hang up: the others stop waiting for a summary and give it up too."""
        record = {"abandoned": True, "hang": hang, "node": self._node, "reason": reason}
        self._client.put(self._key(round_, "summary"), json.dumps(record))

    def _abandoned(self, round_: int, hang: str) -> bool:
        found = self._client.get(self._key(round_, "summary"))
        if found is None:
            return False
        summary = json.loads(found[0])
        return bool(summary.get("abandoned")) and summary.get("hang") == hang

    def decide(
        self,
        round_: int,
        members: Sequence[str],
        *,
        owner: bool,
        extra: dict[str, Any],
        lost: Callable[[], Mapping[str, str]] = dict,
        abort: Callable[[], bool] = lambda: False,
    ) -> dict[str, Any] | None:
        """The summary every node acts on: written by the owner, read by the others. None: the hang was abandoned
        (``abort()`` became true here, or the owner gave it up). ``lost()`` names the members whose daemon is gone
        or frozen: nobody waits for their reports, and they are the prime suspects."""
        hang = str(extra.get("hang", ""))
        summary_key = self._key(round_, "summary")
        if not owner:
            claim = self._client.get(self._key(round_, "claim"))
            owner_node = str(json.loads(claim[0]).get("node", "")) if claim is not None else ""
            deadline = self._clock() + SUMMARY_WAIT_S
            while self._clock() < deadline:
                found = self._client.get(summary_key)
                if found is not None:
                    summary = dict(json.loads(found[0]))
                    return None if summary.get("abandoned") else summary
                if abort():
                    return None
                if owner_node in lost():
                    break  # the owner's daemon is gone: it will never summarise; diagnose from the reports
                self._sleep(_POLL_S)
        deadline = self._clock() + REPORT_WAIT_S
        while True:
            reports = self.reports(round_, hang)
            missing = set(members) - set(reports)
            if abort():
                return None
            # never wait for a node whose daemon is gone: it will not report
            if not missing or missing <= set(lost()) or self._clock() >= deadline:
                break
            self._sleep(_POLL_S)
        gone = {node: why for node, why in lost().items() if node in missing}
        evidence = [e for node in sorted(reports) for e in reports[node]]
        cut = set() if gone else partition(members, self.reached(round_, hang))
        kept = sorted(set(members) - cut)
        diagnosis = partitioned(evidence, cut, kept) if cut else diagnose(evidence, gone)
        summary = {
            **diagnosis.to_json(),
            "nodes_reported": sorted(reports),
            "nodes_missing": sorted(missing),
            **extra,
        }
        counted = diagnosis.counted
        summary["attempt"] = self._count_attempt(round_, diagnosis.step, summary.get("path", "")) if counted else 0
        if owner:
            self._client.put(summary_key, json.dumps(summary))
        return summary

    def _count_attempt(self, round_: int, step: int, path: str) -> int:
        """How many hangs in a row stopped at ``step`` (this one included); a hang elsewhere starts again at 1.

        One hang per round at most: a second diagnosis of the same round (a node that diagnosed alone) does not
        count again, and one from a round older than the last counted (a late report) does not count at all."""
        found = self._client.get(self._keys.hang_last)
        last = json.loads(found[0]) if found else {}
        last_round = last.get("round")
        if isinstance(last_round, int) and round_ <= last_round:
            return int(last.get("attempts", 0)) if round_ == last_round else 0
        attempt = int(last.get("attempts", 0)) + 1 if last.get("step") == step else 1
        record = {"step": step, "attempts": attempt, "round": round_, "path": path}
        self._client.put(self._keys.hang_last, json.dumps(record))
        return attempt

    def forget_rounds_before(self, round_: int) -> None:
        """Called by a new round's rank-0 agent: older rounds' claims and reports are done with."""
        for key, _value, _rev in self._client.get_prefix(self._keys.hang_prefix):
            rest = key[len(self._keys.hang_prefix) :]
            if rest.startswith("round-"):
                number = rest[len("round-") :].split("/", 1)[0]
                if number.isdigit() and int(number) < round_:
                    self._client.delete(key)


def _name(value: bytes) -> str:
    return str(json.loads(value).get("name", ""))
