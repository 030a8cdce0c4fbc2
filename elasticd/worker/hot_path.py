"""The worker library's side of recovery in place: when to arm it, what a recovery changes in the run, how it ends.

:meth:`HotPath.arm` (from ``run.resume``) arms :class:`~elasticd.worker.hot.session.HotSession` when the daemon asks
for ``--recovery hot`` and the setup is one it supports; otherwise it says why at start, once, and the run keeps
today's cold path. At each optimizer-step boundary :meth:`HotPath.recovered_from_failure` turns a failed step into a
recovery in place (the run continues at the new size from the same sample) or, when the hot path cannot go on, ends
the worker for the daemons' cold restart from the newest committed checkpoint. The first completed step at the new
size reports the recovery to the daemon (beat ``reconfigured``: metrics, events, ``elasticd status``).

A node that joins a group training in place (its daemon sets ``ELASTICD_JOIN_ROUND``) arms as a joiner: in
``run.resume`` it asks to be admitted and waits, warm, until an epoch takes it, then heals from a live peer and
continues from the group's step and sample (:meth:`HotPath.arm`). The running members admit joiners at a step
boundary they agree on (:meth:`HotPath.admit`, from the checkpoint agreement of ``coordination.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

from elasticd.board import Phase
from elasticd.errors import EXIT_HOT_FALLBACK, EXIT_REJOIN, ElasticdError
from elasticd.etcd.client import EtcdClient, EtcdError
from elasticd.group_record import JOINABLE, Reach, group_reach, read_group
from elasticd.keys import RunKeys
from elasticd.messages import Kind
from elasticd.node_records import read_nodes
from elasticd.worker import fsdp
from elasticd.worker.hot import exit_guard
from elasticd.worker.hot.errors import HotRecoveryError
from elasticd.worker.hot.given_up import GIVEN_UP
from elasticd.worker.hot.session import (
    HotFallback,
    HotSession,
    Identity,
    LeftGroup,
    Recovered,
    advertised_host,
    is_gloo_world,
)
from elasticd.worker.hot.shard_comms import ResilientShardComms
from elasticd.worker.hot.shard_heal import Sharding
from elasticd.worker.hybrid import HybridMesh

if TYPE_CHECKING:
    from elasticd.board import SlotWriter
    from elasticd.worker.batching import BatchPlan
    from elasticd.worker.beats import BeatClient
    from elasticd.worker.coordination import Coordinator
    from elasticd.worker.faults import FaultInjector
    from elasticd.worker.guard import NonFiniteGuard
    from elasticd.worker.saver import CheckpointSaver
    from elasticd.worker.settings import WorkerSettings
    from elasticd.worker.state import TrainingState


class RunPort(Protocol):
    """What the hot path uses of the run it serves (``worker/run.py``'s ``Run``): its settings, place and state, its
    channels to the daemon, and :meth:`regrouped` to go on at a new size. The hot path depends on this, not on
    ``Run``: the run imports the hot path, never the reverse."""

    @property
    def settings(self) -> WorkerSettings: ...
    @property
    def accelerator(self) -> Any: ...
    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def state(self) -> TrainingState: ...
    @property
    def log(self) -> Any: ...
    @property
    def slot(self) -> SlotWriter: ...
    @property
    def beats(self) -> BeatClient: ...
    @property
    def guard(self) -> NonFiniteGuard: ...
    @property
    def coordinator(self) -> Coordinator: ...
    @property
    def saver(self) -> CheckpointSaver: ...
    @property
    def faults(self) -> FaultInjector: ...
    @property
    def hybrid(self) -> HybridMesh | None: ...

    def plan_for(self, world_size: int) -> BatchPlan | None: ...

    def reload(self) -> TrainingState | None: ...

    def regrouped(
        self,
        rank: int,
        world_size: int,
        state: TrainingState,
        plan: BatchPlan | None,
        token: str,
        *,
        planned: bool = False,
    ) -> None: ...


# Seconds a joining worker asks again about a group that is out of its reach before it gives up on joining in place.
JOIN_REACH_WAIT_S = 15.0
_REACH_POLL_S = 0.5
# Seconds a joining worker waits on a group none of whose members greets before it gives up on joining in place.
JOIN_SILENCE_S = 10.0
# etcd electing a leader (the leader lost or cut off, quorum regained) answers "leader changed"/"no leader" for a
# second or two with etcd's defaults: the hot path's calls ride that out for this long before they give up (the
# cold path); each call waits at most ETCD_REQUEST_TIMEOUT_S on one member before trying another.
ETCD_ELECTION_GRACE_S = 15.0
ETCD_REQUEST_TIMEOUT_S = 2.0


class JoinerNotNeeded(ElasticdError):
    """The run this joiner waited for finished: nothing is left to train."""


class HotPath:
    def __init__(self, run: RunPort, session: HotSession) -> None:
        self.run = run
        self.session = session
        self._report: dict[str, Any] | None = None  # the recovery to report at the first step after it

    @classmethod
    def arm(cls, run: RunPort, model: Any, optimizer: Any, scheduler: Any) -> HotPath | None:
        s = run.settings
        if s.recovery != "hot" or not (s.etcd and s.fence_token and s.node_id):
            return None  # cold by choice, or no daemon
        joining = s.join_round is not None
        if run.world_size < 2 and not joining:
            run.log.info("hot_recovery_off", reason="a world of one worker has nobody to re-form with")
            return None
        sharding = None
        if fsdp.is_fsdp(run.accelerator):  # HSDP (run.hybrid): no mirrors, the other nodes are replicas
            sharding = Sharding(s.shard_mirror_every, s.nproc_per_node, run.hybrid)
        if not is_gloo_world():
            return cls._unsupported(run, "a process group other than gloo's default one (NCCL: not yet wired)")
        try:
            client = EtcdClient.connect(
                **s.etcd_connect_args(),
                request_timeout_s=ETCD_REQUEST_TIMEOUT_S,
                election_grace_s=ETCD_ELECTION_GRACE_S,
            )
        except (EtcdError, ElasticdError) as exc:
            return cls._unsupported(run, f"etcd unreachable from the worker: {exc}")
        minimum = (s.min_nodes or 1) * s.nproc_per_node
        keys = RunKeys(s.run_id)
        if joining:
            group, seen = _group_to_join(client, keys, s.join_round or 0)
            if group is None:
                finished = _run_finished(client, keys, s.join_round or 0)
                client.close()
                if finished:
                    run.log.info("join_not_needed", message="the run finished while this node's workers started")
                    cls._exit(0)
                return cls._unsupported(run, f"the group this node was to join no longer trains in place ({seen})")
            identity = Identity(group, run.rank, s.node_id, s.join_round or 0, minimum, name=s.fence_token)
        else:
            identity = Identity(s.fence_token, run.rank, s.node_id, s.round, minimum)
        try:
            session = HotSession(
                run.accelerator,
                model,
                optimizer,
                scheduler,
                client=client,
                keys=keys,
                identity=identity,
                fence=s.fence_token,
                faults=run.faults,
                sharded=sharding,
                reload=run.reload,
            )
            session.start(advertised_host(s.local_addr), joining=joining)
        except HotRecoveryError as exc:  # an unsupported setup, or torch/accelerate moved a surface we rely on
            client.close()
            return cls._unsupported(run, str(exc))
        run.coordinator.on_failure = session.hook.abort
        if isinstance(session.hook, ResilientShardComms):  # a sharded model's NaN check is a collective too
            run.guard.agree = session.hook.agree
        run.saver.on_group_failure = session.hook.abort  # a save's collective failed: that step fails too
        run.saver.group_failed = session.step_failed  # or failed elsewhere while this rank waits
        run.coordinator.wants_change = lambda: session.change_wanted(run.plan_for)
        run.log.info("hot_recovery_armed", member=identity.member, epoch=session.epoch, joining=joining)
        path = cls(run, session)
        if joining:
            path._join(client, keys, identity.round)
        return path

    def _join(self, client: EtcdClient, keys: RunKeys, round_: int) -> None:
        """Wait, warm, until the group admits this node's workers; then they are members like any other."""
        run = self.run
        run.slot.set_phase(Phase.JOINING)  # not a hang, however long a spare waits for room
        run.log.info("join_requested", member=self.session.identity.member, round=round_)

        group = self.session.identity.group
        # out of reach for a moment (a link that just came back) is no reason to give up: gone is, and so is a
        # silence that lasts
        watch = JoinWatch(lambda: group_reach(client, keys, group, round_))

        def still_wanted() -> bool:
            if _run_finished(client, keys, round_):
                raise JoinerNotNeeded("the run finished while this node waited to join")
            return watch()

        try:
            recovered = self.session.join(run.state, run.plan_for, still_wanted)
        except HotFallback as exc:
            self._fall_back(exc.reason, str(exc), EXIT_REJOIN)
        except JoinerNotNeeded as exc:
            run.log.info("join_not_needed", message=str(exc))
            self._exit(0)
        self._adopt(recovered)

    def admit(self) -> None:
        """At the step boundary every member agreed on: admit the joiners waiting (heal them from rank 0), let the
        members of a leaving node go."""
        run = self.run
        if self.session.guard.health.failed:
            return  # a collective failed after the step (a save's): the next step re-forms first, the joiners wait
        at = time.monotonic()
        run.slot.set_phase(Phase.LOADING)
        try:
            recovered = self.session.admit(run.state, run.plan_for, at)
        except HotFallback as exc:
            self._fall_back(exc.reason, str(exc))
        except LeftGroup as exc:
            run.log.info("left_in_place", step=run.state.step, message=str(exc))
            run.saver.wait()  # this rank's own write and commit: nothing sealed is lost
            self._exit(0)
        self._adopt(recovered, planned=True)

    @staticmethod
    def _unsupported(run: RunPort, why: str) -> None:
        run.log.warning("hot_recovery_unsupported", reason=why, fallback="cold restarts from checkpoints")
        run.beats.send(Kind.HOT_FALLBACK, reason="unsupported", message=why)
        if run.settings.join_round is not None:
            # a joiner that cannot join in place leaves it to its daemon: through the rendezvous, cold
            exit_guard.exit_now(EXIT_REJOIN)
        return None

    def recovered_from_failure(self) -> bool:
        """At an optimizer-step boundary: False when the step succeeded; True after a recovery in place."""
        failure = self.session.take_failure()
        if failure is None:
            return False
        run = self.run
        run.log.warning(
            "step_failed",
            step=run.state.step + 1,
            reason=failure.reason,
            epoch=self.session.epoch,
            backward_cuts=self.session.cutoff.cuts,
            backward_uncut=self.session.cutoff.uncut,
        )
        run.slot.set_phase(Phase.LOADING)  # the hang watchdog allows the startup timeout for what follows
        try:
            # a hang's culprit node tells the group before it kills its workers (agent/supervisor.py)
            reason = "hang" if "notice: hang:" in failure.reason else "failure"
            recovered = self.session.recover(failure, run.state, run.plan_for, reason)
        except HotFallback as exc:
            self._fall_back(exc.reason, str(exc))
        self._adopt(recovered)
        return True

    def _adopt(self, recovered: Recovered, *, planned: bool = False) -> None:
        run = self.run
        if self._report is not None:
            self.stepped()  # a change superseded before its first step is still reported (and counted)
        lost = lost_steps(run.state.step, recovered.state.step)  # before regrouped() replaces the state
        run.regrouped(
            recovered.rank,
            recovered.world_size,
            recovered.state,
            recovered.plan,
            recovered.epoch.token,
            planned=planned,
        )
        run.slot.set_phase(Phase.TRAINING)
        self._report = {
            "reason": recovered.epoch.reason,
            "epoch": recovered.epoch.number,
            "world_size": recovered.world_size,
            "nodes": max(1, recovered.world_size // max(1, run.settings.nproc_per_node)),
            "heal_bytes": recovered.heal_bytes,
            "lost_steps": lost,
            "step": recovered.state.step,  # the step training went on from
            "token": recovered.epoch.token,
            "lost_nodes": list(recovered.lost_nodes),
            "node_ids": list(recovered.nodes),
            "detected_at": recovered.detected_at,
        }
        run.log.warning(
            "regrouped",
            epoch=recovered.epoch.number,
            rank=recovered.rank,
            world_size=recovered.world_size,
            step=recovered.state.step,
            heal_bytes=recovered.heal_bytes,
            heal_attempts=recovered.heal_attempts,
        )

    def stepped(self) -> None:
        """After every completed optimizer step: a sharded job's mirror; the first one at a new size reports the
        recovery."""
        mirrored = self.session.after_step(self.run.state)
        if mirrored is not None:
            self.run.beats.send(Kind.SHARD_MIRRORED, step=self.run.state.step, **mirrored)
        if self._report is None:
            return
        report, self._report = self._report, None
        seconds = time.monotonic() - float(report.pop("detected_at"))
        self.run.beats.send(Kind.RECONFIGURED, seconds=round(seconds, 4), **report)
        self.run.log.info("reconfigured", seconds=round(seconds, 4), **report)
        released, held = self.session.settle()  # after the report: its time is the next step's, once per change
        self.run.log.info("old_groups_settled", released=released, held=held, pending_collectives=GIVEN_UP.pending())

    def _fall_back(self, reason: str, message: str, code: int = EXIT_HOT_FALLBACK) -> NoReturn:
        run = self.run
        run.log.error("hot_fallback", reason=reason, message=message)
        run.beats.send(Kind.HOT_FALLBACK, reason=reason, message=message)
        run.saver.wait()  # this rank's own write and commit: nothing sealed is lost
        # The daemon sees a failed worker and restarts cold (a joiner's: goes through the rendezvous).
        self._exit(code)

    @staticmethod
    def _exit(code: int) -> NoReturn:
        # Not SystemExit: interpreter teardown would drop the abandoned gloo group, whose destructor waits out a
        # pending collective for the group's timeout (minutes). The exit handlers run, the files are flushed.
        exit_guard.exit_now(code)

    def close(self) -> None:
        self.session.close()  # releases the old groups, once what was given up on in them has ended
        pending = GIVEN_UP.pending()
        if pending:  # the interpreter's teardown could abort the process: exit_guard.py
            exit_guard.install(self.run.log.info, pending=pending)


def lost_steps(completed: int, healed: int) -> int:
    """The steps a change in place makes this worker train again (``elasticd_lost_steps_total``, "steps redone
    after a restart"): the optimizer steps it had completed (``completed``, its step count before the change) beyond
    the step of the state it was healed to (``healed``), or 0.

    A step that failed in place is no completed step: ``run.step()`` returned False, the optimizer, the scheduler and
    the data position did not move and no step was reported; its samples come again at the new size. The cold path
    counts alike (``agent/progress.py``: the last step reported minus the step resumed from, the step in flight at
    the failure not included). The heal source is the member with the most completed steps, so a survivor of a
    failure, a join or a leave loses none, and a joiner (healed forward from nothing) none; a member ahead of its
    source would lose the difference."""
    return max(0, completed - healed)


def _run_finished(client: EtcdClient, keys: RunKeys, round_: int) -> bool:
    """Did a node of ``round_`` finish the run (its registry record says so)?"""
    return any(r.get("round") == round_ and r.get("state") == "finished" for r in read_nodes(client, keys))


class JoinWatch:
    """Is the group a joiner waits for still there to admit it (``HotSession.join``'s ``still_wanted``)? Not once it
    is gone, nor once none of its members has greeted for ``grace_s``: a group whose every member is stopped or
    wedged admits nobody (seen in the suite: two nodes each waiting to join a group whose last members were a
    convicted, stopped worker and one that had fallen back, until the test's timeout). A member starved of CPU for a
    moment greets again well within the grace."""

    def __init__(
        self, reach: Callable[[], Reach], clock: Callable[[], float] = time.monotonic, grace_s: float = JOIN_SILENCE_S
    ) -> None:
        self._reach = reach
        self._clock = clock
        self._grace_s = grace_s
        self._silent_since: float | None = None

    def __call__(self) -> bool:
        reach = self._reach()
        if reach is not Reach.SILENT:
            self._silent_since = None
            return reach is not Reach.GONE
        now = self._clock()
        if self._silent_since is None:
            self._silent_since = now
        return now - self._silent_since < self._grace_s


def _group_to_join(
    client: EtcdClient, keys: RunKeys, round_: int, reach_wait_s: float = JOIN_REACH_WAIT_S
) -> tuple[str | None, str]:
    """The name of the group of ``round_`` that trains in place now, or None (gone, or another round's), and what
    was seen of it. A group out of this node's reach (its daemon found it reachable a moment ago: a link that just
    came back) is asked again for up to ``reach_wait_s``."""
    deadline = time.monotonic() + reach_wait_s
    while True:
        group = read_group(client, keys)
        if group is None or group.round != round_:
            return None, "no group record" if group is None else f"the group record is round {group.round}'s"
        reach = group_reach(client, keys, group.name, round_)
        if reach in JOINABLE:
            return group.name, reach.value
        if reach is Reach.GONE or time.monotonic() >= deadline:
            return None, reach.value
        time.sleep(_REACH_POLL_S)
