"""The run around this node as the supervisor loop sees it (the controller's :class:`~.controller.RunView` port).

Whether ``elasticd stop`` asked the run to stop, whether the workers' fencing token is still the run's, how many
nodes wait for the next round, whether the group must re-form to another size, the stragglers among the nodes,
and the state this node's registry record shows. Every etcd read answers its fallback while etcd is away.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from elasticd.agent.controller import NodeState
from elasticd.agent.policy import GroupState
from elasticd.agent.polling import EtcdPoll
from elasticd.agent.registry import NodeRegistry
from elasticd.agent.round import RoundState
from elasticd.agent.spares import Sizing
from elasticd.agent.stragglers import StragglerDetector
from elasticd.lineage import Lineage
from elasticd.membership import Membership
from elasticd.metrics import Metrics


class EtcdRunView:
    """This node's view of the run: etcd, the rendezvous's wait list, the registry."""

    def __init__(
        self,
        *,
        node_id: str,
        round_state: RoundState,
        registry: NodeRegistry,
        metrics: Metrics,
        log: Callable[[], Any],
        poll: EtcdPoll,
        drain_requested: Callable[[], bool],
        nodes_waiting: Callable[[], int],
        sizing: Sizing,
        stragglers: StragglerDetector,
        read_peers: Callable[[], list[dict[str, Any]]],
        lineage: Lineage | None = None,
        membership: Membership | None = None,
    ) -> None:
        self._node_id = node_id
        self._round = round_state
        self._registry = registry
        self._metrics = metrics
        self._log = log
        self._poll = poll
        self._drain_requested = drain_requested
        self._nodes_waiting = nodes_waiting
        self._sizing = sizing
        self._stragglers = stragglers
        self._read_peers = read_peers
        self._lineage = lineage
        self._membership = membership  # hot recovery's epochs: each one moves the token in place

    @property
    def node_id(self) -> str:
        return self._node_id

    def drain_requested(self) -> bool:
        """Did ``elasticd stop`` ask the whole run to stop (etcd away: no)?"""
        return bool(self._poll(self._drain_requested, False))

    def waiting_to_join(self) -> bool:
        return self._round.waiting_to_join()

    def nodes_waiting(self) -> int:
        return int(self._poll(self._nodes_waiting, 0))

    def resize_needed(self, state: GroupState, failures: dict[int, Any]) -> bool:
        return bool(self._poll(partial(self._sizing.reform_needed, state, failures), False))

    def publish_state(self, state: NodeState) -> None:
        self._registry.update(state=state.value)

    def lineage_lost(self) -> bool:
        """True when the workers' token is no longer the run's: etcd lost its data, or a newer group took over."""
        token = self._round.token
        if self._lineage is None or token is None:
            return False
        unchanged: str | None = token
        current = self._poll(self._lineage.token, unchanged)  # etcd away: nothing to conclude
        if current == token:
            return False
        if current is not None and self._moved_in_place(current):
            return False
        cause = "etcd lost the run's keys" if current is None else "a newer group holds the run's fencing token"
        self._log().warning("lineage_lost", cause=cause, token=token, current=current)
        return True

    def _moved_in_place(self, current: str) -> bool:
        """Did our workers' group re-form in place under ``current``? Then it is their token now (hot recovery's
        membership epoch moved the fence with one transaction), and this node's workers are still in it."""
        round_token = self._round.round_token
        if self._membership is None or round_token is None:
            return False
        found = self._poll(self._membership.current, None)
        if found is None or found[0].token != current:
            return False
        ours = f"{round_token}."
        if not any(member.startswith(ours) for member in found[0].members):
            return False  # the group went on without this node: its workers are fenced off
        self._log().info("lineage_token", token=current, epoch=found[0].number)
        self._round.adopt_token(current)
        return True

    def check_stragglers(self, now: float) -> None:
        detector = self._stragglers
        if not detector.enabled:
            return
        if len(self._round.members) > 1:  # alone in the round: no other node to tell or hear from
            medians = detector.local_medians(now)
            self._registry.update(own_s={str(rank): round(m, 6) for rank, m in medians.items()})
            peers: dict[int, float] = {}
            records: list[dict[str, Any]] = self._poll(self._read_peers, [])
            round_ = self._round.round
            for record in records:
                if record.get("node_id") != self._node_id and record.get("round") == round_:
                    peers.update({int(r): float(m) for r, m in (record.get("own_s") or {}).items()})
            detector.peers(peers)
        else:
            detector.peers({})
        for event in detector.check(now):
            if event.kind == "detected":
                self._metrics.stragglers_total.inc()
                self._log().warning(
                    "straggler_detected",
                    rank=event.rank,
                    own_s=round(event.own_s, 4),
                    others_s=round(event.others_s, 4),
                    ratio=round(event.ratio, 2),
                    step_s=round(event.step_s, 4),
                )
            else:
                self._log().info("straggler_recovered", rank=event.rank, own_s=round(event.own_s, 4))
