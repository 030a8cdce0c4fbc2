"""This node's part in hangs, as the supervisor loop sees it (the controller's :class:`~.controller.Hangs` port).

:class:`~.hangs.HangHandler` does the work (watchdog, evidence, agreement); this adapter gives it what it needs
from the agent (the round, its epoch and members, the local pids and ranks, when the workers started) and keeps
the acts around a hang that involve the group: excusing the watchdog while the culprits re-form in place, and
telling the group of a hang before this node kills its culprits. Without a handler (``hangs=None``) nothing hangs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from elasticd.agent.hangs import HangHandler
from elasticd.agent.policy import HangReport
from elasticd.agent.polling import EtcdPoll
from elasticd.agent.reports import WorkerReports
from elasticd.agent.round import RoundState
from elasticd.agent.spares import Sizing
from elasticd.agent.workers import LocalWorkers
from elasticd.board import Phase
from elasticd.membership import Membership

# Seconds between telling the group of a hang whose culprits are here and killing them: the others abandon their
# collective on the notice (their failure watch pushes it to the hook) rather than on the reset, so they count a hang.
HANG_NOTICE_S = 0.1


class NodeHangs:
    """Hang detection and agreement for this node's workers, in the round they train in now."""

    def __init__(
        self,
        hangs: HangHandler | None,
        *,
        node_id: str,
        workers: LocalWorkers,
        round_state: RoundState,
        reports: WorkerReports,
        sizing: Sizing,
        log: Callable[[], Any],
        poll: EtcdPoll,
        membership: Membership | None = None,
    ) -> None:
        self._hangs = hangs
        self._node_id = node_id
        self._workers = workers
        self._round = round_state
        self._reports = reports
        self._sizing = sizing
        self._log = log
        self._poll = poll
        self._membership = membership
        self._started_at = workers.clock()

    # -- the agent's lifecycle ------------------------------------------------------------------------------------

    def round_started(self, round_: int | None, group_rank: int | None) -> None:
        """A new round: its rank-0 agent forgets the older rounds' agreements."""
        hangs = self._hangs
        if group_rank == 0 and round_ is not None and hangs is not None:
            self._poll(lambda: hangs.forget_rounds_before(round_), None)

    def workers_starting(self, local_ranks: tuple[int, ...]) -> None:
        """A new generation of workers: its watchdog allowances start now."""
        self._started_at = self._workers.clock()
        if self._hangs is not None:
            self._hangs.reset(local_ranks, self._started_at)

    # -- the controller's port ------------------------------------------------------------------------------------

    def suspicion(self) -> Any | None:
        return self._hangs.check() if self._hangs is not None else None

    def peer_claim(self) -> str | None:
        hangs, round_ = self._hangs, self._round
        if hangs is None:
            return None
        return self._poll(lambda: hangs.peer_claim(round_.round or 0, round_.epoch), None)

    def exiting(self) -> bool:
        return self._hangs is not None and self._hangs.exiting()

    def phases(self) -> list[Phase]:
        if self._hangs is None:
            return []
        return [slot.phase for slot in self._hangs.watchdog.slots().values() if slot is not None]

    def diagnose(self, suspicion: Any | None) -> HangReport | None:
        assert self._hangs is not None
        if self._sizing.spare:
            return None  # no workers here: the training nodes diagnose their hang without this node
        round_ = self._round
        in_place = round_.regrouped_in_place
        # in place, the group's nodes as its last epoch named them; otherwise the round's that train
        members = round_.members if in_place else self._sizing.training_members(round_.members)
        return self._hangs.handle(
            round_=round_.round or 0,
            members=[*members, *(n for n in self._being_admitted(round_.round or 0, round_.epoch) if n not in members)],
            pids=self._workers.pids(),
            ranks={w.local_rank: round_.rank_of(w.local_rank, w.global_rank) for w in self._workers.workers},
            can_dump=self._reports.can_dump_stacks(),
            started_at=self._started_at,
            suspicion=suspicion,
            epoch=round_.epoch,
            in_place=in_place,
        )

    def _being_admitted(self, round_: int, epoch: int) -> list[str]:
        """Nodes of an epoch decided after the one the workers last reported (a join being admitted in place): a
        hang now may be theirs, so they are members of its diagnosis (their reachability included), not outsiders
        whose silence convicts a healthy member."""
        membership = self._membership
        if membership is None:
            return []
        nothing: list[str] = []  # etcd away: the members the workers reported, as before
        return self._poll(lambda: membership.admitted_nodes(round_, epoch), nothing)

    def leave_to_culprits(self, hang: HangReport) -> None:
        if self._hangs is not None:
            watchdog = self._hangs.watchdog
            watchdog.excuse(self._workers.clock() + watchdog.startup_s)
        self._log().info("hang_left_to_culprits", culprit_nodes=list(hang.culprit_nodes), step=hang.step)

    def tell_group(self, hang: HangReport) -> None:
        """This node holds a culprit of a hang and its workers re-form in place: tell the group first, so that the
        others abandon the collective they wait in (and count a hang, not a failure) before the kill resets it."""
        membership = self._membership
        if membership is None or self._node_id not in hang.culprit_nodes or not self._reports.all_in_place():
            return
        text = f"hang: {', '.join(hang.culprit_nodes)} stopped progressing"
        # out first: the others, woken by the notice, must count these workers dead even if they cannot probe them
        self._poll(lambda: membership.leave_group(self._node_id), False)
        if self._poll(lambda: membership.notify_group(text), False):
            self._workers.sleep(HANG_NOTICE_S)
