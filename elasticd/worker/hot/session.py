"""Hot recovery in one worker under a daemon: the building blocks of this package wired to the run's etcd.

:meth:`HotSession.start` (a collective, at ``run.resume``) registers the hook and the failed-step guard on the
prepared objects, opens the liveness port, publishes this member and learns the membership epoch in force. After a
step whose gradients could not be reduced, :meth:`HotSession.recover`:

1. writes the epoch's failure notice (releasing members that still wait in a collective) and bids for the next
   epoch with this member's committed steps;
2. waits until the epoch can be decided: every member of the current epoch bid, or is dead by the kernel's or the
   daemons' verdict (``liveness.py``); then one etcd transaction decides it and moves the fence
   (``elasticd/membership.py``); at least ``min_members`` must be left;
3. re-forms the process group in place over etcd (a store no node takes down with it) and heals every member from
   the one with the most committed steps (the objects registered for checkpointing included; the failed step's
   changes to them were undone at its boundary, ``registered.py``).

A member that dies or hangs *during the heal* costs the group another epoch, not its run: every member learns the heal
failed (``heal.py``), writes the new epoch's failure notice and bids for the next one, the members whose heal failed
with :data:`~elasticd.membership.UNHEALED_STEP` (their tensors may be half written: they can only be healed), and
the next epoch heals again from the members that hold the state, up to :data:`HEAL_ATTEMPTS` times. A half-healed
member never trains. A sharded job's heal that breaks is taken again the same way; the next epoch's members then
load the newest committed checkpoint in place, as what the broken heal half moved cannot be trusted (``shard_heal.py``).

Anything else that stops this (fewer than the minimum, a member dying during the re-formation, a batch plan that does
not fit the new world, this member left out, no member left that holds the state) raises :class:`HotFallback`: the
worker exits and the daemons restart the group from the newest committed checkpoint, today's cold path.

**Joins** go the same way without a failure. The workers of a joining node start in a private world of their node,
import and prepare, then :meth:`HotSession.join` bids for the next epoch with no old rank (one etcd transaction for
the whole node) and waits. The running members see the bids (``watch.py``), agree on a step boundary
(``coordination.py``) and there :meth:`HotSession.admit` moves everyone to the next epoch: re-formed with the joiners,
which heal from rank 0 over the new group, not from disk. Joiners whose number does not split the global batch are
left out of the epoch and stay warm: they bid again for the next one, and step in when a member is lost.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from accelerate.utils import broadcast_object_list

from elasticd.addresses import listen_address
from elasticd.etcd.client import EtcdClient, EtcdError
from elasticd.keys import RunKeys
from elasticd.liveness_probe import ProbeListener
from elasticd.membership import UNHEALED_STEP, BelowMinimum, Bid, Epoch, Membership, bid_items
from elasticd.rendezvous.store import EtcdV3Store
from elasticd.worker.batching import BatchPlan, BatchPlanError
from elasticd.worker.faults import FaultInjector
from elasticd.worker.hot.comm_hook import GroupHolder, ResilientAllReduce
from elasticd.worker.hot.cutoff import BackwardCutoff
from elasticd.worker.hot.decide import DecideTimeout, decide
from elasticd.worker.hot.errors import HealError, HotRecoveryError
from elasticd.worker.hot.failure import StepFailure, StepHealth
from elasticd.worker.hot.heal import heal
from elasticd.worker.hot.hybrid_heal import HybridKeeper
from elasticd.worker.hot.reform import Reformer
from elasticd.worker.hot.registered import Rollback, registered_objects
from elasticd.worker.hot.shard_comms import ResilientShardComms
from elasticd.worker.hot.shard_heal import NoMirror, ShardedReformer, ShardHealFailed, Sharding, ShardKeeper
from elasticd.worker.hot.silence import SilenceWatch
from elasticd.worker.hot.step_guard import FailedStepGuard
from elasticd.worker.hot.trim import return_free_memory
from elasticd.worker.hot.verdicts import Verdicts
from elasticd.worker.hot.watch import FailureWatch
from elasticd.worker.state import TrainingState

# How long the survivors wait for the next epoch to be decided. A live member bids within one step of the failure
# (its own collective fails or the notice releases it), a dead one is declared so within the lease (about a second):
# this is a backstop for a member that is alive, stuck outside a collective and still leased (then: cold path).
DECIDE_TIMEOUT_S = 120.0
# Forming the new group waits this long for every member of the decided epoch (one that dies meanwhile: cold path).
FORM_TIMEOUT = timedelta(seconds=15)
# A joiner looks this often (seconds) whether the group it waits for still trains; a change in etcd wakes it sooner.
_JOIN_POLL_S = 1.0
# Heals one change may take (each in an epoch of its own) before the group gives up and restarts cold: each failed
# one lost a member (or found a piece corrupt), so more would mean a group that keeps failing, not bad luck.
HEAL_ATTEMPTS = 3
# At the end of the run, how long old gloo groups may take to be released (seconds): each waits for what was given up
# on in it to end, which its peers' releases bring about within a few sweeps (given_up.py). One still held after
# this waits on a peer alive and silent in it (a frozen node): the process then ends without its teardown.
DRAIN_AT_CLOSE_S = 10.0


class LeftGroup(Exception):
    """This member's node leaves on SIGTERM and the group went on without it, at an agreed step boundary."""


# A heal that broke part way, taken again in the next epoch (a replicated one's, a sharded one's)
BrokenHeal = HealError | ShardHealFailed


class HotFallback(HotRecoveryError):
    """Recovery in place is over for this run's group: exit for a cold restart. ``reason`` labels the metric."""

    def __init__(self, reason: str, message: str) -> None:
        self.reason = reason
        super().__init__(message)


@dataclass(frozen=True, slots=True)
class Recovered:
    """The group this worker trains in after a recovery in place."""

    epoch: Epoch
    rank: int
    world_size: int
    state: TrainingState
    plan: BatchPlan | None
    heal_bytes: int
    detected_at: float  # time.monotonic() of the failure
    lost_nodes: tuple[str, ...] = ()  # nodes none of whose members is in the new epoch
    nodes: tuple[str, ...] = ()  # the nodes of the new epoch's members (sorted)
    heal_attempts: int = 1  # heals it took: more than one when a member died or hung during a heal


@dataclass(frozen=True, slots=True)
class Identity:
    """Who this worker is in the run, for its whole life (ranks change, the member name does not)."""

    group: str  # the round's first fencing token: names this group's keys (a joiner learns it from etcd)
    first_rank: int  # the rank this worker started with in the round (a joiner: in its node's private world)
    node_id: str
    round: int
    min_members: int
    name: str | None = None  # the prefix of this worker's member name, when it is not the group's (a joiner)

    @property
    def member(self) -> str:
        return member_name(self.name or self.group, self.first_rank)


def mirror_label(group: str, epoch: int) -> str:
    """Names an epoch's shard mirrors: a mirror is of the epoch it was taken in, or stale."""
    return f"{group}#{epoch}"


def member_name(group: str, rank: int) -> str:
    return f"{group}.{rank}"


class HotSession:
    """One worker's hot path (see the module docstring)."""

    def __init__(
        self,
        accelerator: Any,
        model: Any,
        optimizer: Any,
        scheduler: Any,
        *,
        client: EtcdClient,
        keys: RunKeys,
        identity: Identity,
        fence: str,
        faults: FaultInjector | None = None,
        clock: Callable[[], float] = time.monotonic,
        sharded: Sharding | None = None,
        reload: Callable[[], TrainingState | None] = lambda: None,
    ) -> None:
        """``sharded``: an FSDP2 job's mirror settings (``shard_heal.py``), None for a replicated (DDP) one;
        ``reload()``: the newest committed checkpoint loaded in place, for a sharded job with no state in memory."""
        self.accelerator = accelerator
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.client = client
        self.keys = keys
        self.identity = identity
        self.fence = fence
        self._clock = clock
        self.membership = Membership(client, keys, clock=clock)
        self.health, self.holder = StepHealth(), GroupHolder()
        self.group = identity.group
        self.verdicts = Verdicts(client, keys, self.group)
        # a lease that lapsed while its node's daemon still greets is no failure at once (watch.py)
        self.watch = FailureWatch(client, keys, self.group, daemon_answers=self.verdicts.daemon_answers)
        self.hook, self.reformer, self.keeper = _comms(self, sharded, reload)
        self.watch.on_reason(self.hook.nudge)
        # a discarded step leaves the objects registered for checkpointing as they were (registered.py)
        self.guard = FailedStepGuard(self.health, Rollback(lambda: registered_objects(accelerator)))
        self.cutoff = BackwardCutoff(self.health, self.watch.reason, self.hook.abort)  # a failed step's backward
        self.listener: ProbeListener | None = None
        self.epoch = 0
        self.members: tuple[str, ...] = ()
        self.rank = int(accelerator.process_index)
        self._faults = faults
        self._heals = 0  # heals this process took part in (the fault injector counts by them)
        # one worker per node greets the next node's daemon (silence.py)
        self._greets = int(getattr(accelerator, "local_process_index", 0)) == 0
        self.silence = SilenceWatch(
            self.verdicts.daemon_address,
            self._report_silent,
            current_address=self.verdicts.current_daemon_address,
        )

    # -- start ---------------------------------------------------------------------------------------------------

    def start(self, advertise: str, *, joining: bool = False) -> None:
        """Arm the hook and the guard, publish this member, learn the epoch in force (every rank calls it).

        ``joining``: this worker joins a group that trains already (:meth:`join` comes next)."""
        self.hook.register(self.model)
        self.guard.install(self.optimizer)
        if self.keeper is None:
            self.cutoff.install(self.accelerator, self.model)
        elif isinstance(self.hook, ResilientShardComms):  # FSDP sets sharded gradients itself: its collectives,
            self.cutoff.wrap(self.accelerator, after_cut=self.model.reset_iter_state)  # not grad hooks, cut a backward
            self.hook.after_failed = self.cutoff.cut
        # where peers dial it, not every interface; it greets by this member's name (a port taken again is told apart)
        self.listener = ProbeListener(listen_address(advertise), self.identity.member)
        record = {"node": self.identity.node_id, "addr": f"{advertise}:{self.listener.port}"}
        self.client.put(self.keys.membership_member(self.identity.member), json.dumps(record))
        if joining:
            return
        current: list[int | None] = [None]
        if self.rank == 0:
            found = self.membership.current()
            current = [0 if found is None else found[0].number]
        # also the barrier after which every member's record is in etcd
        current = broadcast_object_list(current, from_process=0)
        self.epoch = int(current[0] or 0)
        world = int(self.accelerator.num_processes)
        self.members = tuple(member_name(self.group, rank) for rank in range(world))
        nodes = self.verdicts.nodes_of(self.members)
        if self.rank == 0:
            self._publish_group(nodes)
        self.watch.follow(self.epoch, nodes)
        self._follow_silence(nodes)
        if self.keeper is not None:
            self.keeper.start_epoch(mirror_label(self.group, self.epoch))

    def after_step(self, state: TrainingState) -> dict[str, Any] | None:
        """At every completed optimizer step: a sharded job mirrors its shards here and returns its mirror figures
        since the last report, at most a few a second (None: nothing to say)."""
        return None if self.keeper is None else self.keeper.after_step(state)

    def _publish_group(self, nodes: set[str]) -> None:
        """Tell nodes that start now that this group trains in place (they join it instead of a rendezvous)."""
        record = {"group": self.group, "round": self.identity.round, "nodes": sorted(nodes)}
        self.client.put(self.keys.membership_group, json.dumps(record))

    def change_wanted(self, plan_for: Callable[[int], BatchPlan | None]) -> bool:
        """Does the group want to move to a new epoch at an agreed step boundary (any rank may say so)? A member's
        node leaves (and enough stay), or workers wait to join and the global batch splits over the group with them.
        """
        if self.watch.leaving():
            return True
        waiting = self.watch.joiners()
        # joiners that do not fit stay warm spares until a loss makes room
        return bool(waiting) and _fits(plan_for)(len(self.members) + waiting)

    def step_failed(self) -> bool:
        """Has the current step failed, here or elsewhere (a member's notice, a member node's lease gone)?

        For a rank waiting outside the hook, in a save's agreement: the watch's nudge releases only buckets in
        flight, so such a rank, waiting on a peer that waits on a vanished one, would otherwise see nothing until
        gloo's timeout (minutes) while the others re-form without it."""
        return self.health.failed or self.watch.reason() is not None

    def take_failure(self) -> StepFailure | None:
        """At the optimizer-step boundary: the failure of the step that just ended, if any (once per step)."""
        return self.guard.take()

    # -- recovery ------------------------------------------------------------------------------------------------

    def recover(
        self,
        failure: StepFailure,
        state: TrainingState,
        plan_for: Callable[[int], BatchPlan | None],
        reason: str = "failure",
    ) -> Recovered:
        try:
            return self._recover(failure, state, plan_for, reason)
        except Exception as exc:
            raise fallback_for(exc) from None

    def admit(self, state: TrainingState, plan_for: Callable[[int], BatchPlan | None], detected_at: float) -> Recovered:
        """At the step boundary the group agreed on: move to the next epoch with the joiners (every member calls it).

        ``detected_at``: when this member saw the group agree (the stall is measured from it)."""
        leavers = self.watch.leaving()
        leaving = self.identity.node_id in leavers
        if self.keeper is not None:
            self.keeper.settle()  # a leaver's shards at this boundary are in its peer's memory before it goes
        try:
            self.membership.bid(self.epoch + 1, Bid(self.identity.member, self.rank, state.step, leaving))
            decision = self._decide(self.epoch + 1, "leave" if leavers else "join", plan_for)
            if leaving and decision.rank_of(self.identity.member) is None:
                raise LeftGroup(f"epoch {decision.number} went on without this node, which leaves")
            return self._move(decision, state, plan_for, detected_at)
        except LeftGroup:
            raise
        except Exception as exc:
            raise fallback_for(exc) from None

    def join(
        self, state: TrainingState, plan_for: Callable[[int], BatchPlan | None], still_wanted: Callable[[], bool]
    ) -> Recovered:
        """A joiner, imported and prepared: ask to be admitted, wait (warm) until an epoch takes this node's workers,
        then re-form with the group and heal from its rank 0. Every worker of the node calls it (a collective of the
        node's private world). ``still_wanted()`` is asked about once a second: False (the group stopped training
        in place, the run ended) gives up, and the daemon brings this node in through the rendezvous."""
        try:
            return self._join(state, plan_for, still_wanted)
        except Exception as exc:
            raise fallback_for(exc) from None

    def _join(
        self, state: TrainingState, plan_for: Callable[[int], BatchPlan | None], still_wanted: Callable[[], bool]
    ) -> Recovered:
        me = self.identity.member
        asked_at = self._clock()
        # the node's workers bid in one transaction: an epoch takes all of them or none
        names: list[Any] = [None] * int(self.accelerator.num_processes)
        dist.all_gather_object(names, me)
        while True:
            found = self.membership.current()
            target = 1 if found is None else found[0].number + 1
            if self.rank == 0:
                self.client.put_all(bid_items(self.keys, target, [Bid(str(name), None, 0) for name in names]))
            decision = None
            while decision is None:
                decision = self.membership.wait(target, _JOIN_POLL_S)
                if decision is None and not still_wanted():
                    raise HotFallback("join_abandoned", "the group this node waited to join no longer trains in place")
            if me in decision.members:
                self.epoch = decision.number - 1  # the epoch this node's workers join from
                return self._move(decision, state, plan_for, asked_at)

    def _recover(
        self, failure: StepFailure, state: TrainingState, plan_for: Callable[[int], BatchPlan | None], reason: str
    ) -> Recovered:
        me = self.identity.member
        if self._is_out(me):
            raise HotFallback("excluded", f"this node took {me} out of epoch {self.epoch} (a hang's culprit)")
        self.client.create(self.keys.membership_notice(self.group, self.epoch), f"{me}: {failure.reason}")
        target = self.epoch + 1
        self.membership.bid(target, Bid(me, self.rank, state.step))
        return self._move(self._decide(target, reason, plan_for), state, plan_for, failure.at)

    def _move(
        self, decision: Epoch, state: TrainingState, plan_for: Callable[[int], BatchPlan | None], detected_at: float
    ) -> Recovered:
        """Re-form into ``decision``'s group and heal from its rank 0; a heal that fails is taken again in the next
        epoch by the members left (the module's docstring)."""
        left, before = self.epoch, self.members
        for attempt in range(1, HEAL_ATTEMPTS + 1):
            try:
                healed, heal_bytes, plan = self._enter(decision, state, plan_for)
            except (HealError, ShardHealFailed) as exc:
                if attempt == HEAL_ATTEMPTS:
                    raise
                decision = self._after_failed_heal(exc, state, decision.reason, plan_for)
                continue
            lost_nodes = tuple(sorted(self.verdicts.nodes_of(before) - self.verdicts.nodes_of(decision.members)))
            nodes = self.verdicts.nodes_of(decision.members)
            if self.rank == 0:
                for epoch in range(left, self.epoch):  # the bids of every epoch before the one in force
                    self.membership.forget(epoch)
                self._publish_group(nodes)
            return Recovered(
                decision,
                self.rank,
                len(decision.members),
                healed,
                plan,
                heal_bytes,
                detected_at,
                lost_nodes,
                tuple(sorted(nodes)),
                attempt,
            )
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _enter(
        self, decision: Epoch, state: TrainingState, plan_for: Callable[[int], BatchPlan | None]
    ) -> tuple[TrainingState, int, BatchPlan | None]:
        """Re-form into ``decision``'s group, make it this member's epoch, heal from its rank 0: the state this member
        goes on with, the bytes it moved, the batch plan of the new world."""
        me, target = self.identity.member, self.epoch + 1
        if decision.number != target:
            raise HotFallback("epoch_skipped", f"expected epoch {target}, epoch {decision.number} is in force")
        rank = decision.rank_of(me)
        if rank is None:
            raise HotFallback("excluded", f"epoch {target} was decided without {me}: this member is out")
        if decision.step == UNHEALED_STEP and self.keeper is None:  # a sharded group reloads its newest commit
            raise HotFallback("heal_failed", f"no member of epoch {target} holds the state to heal from")
        world = len(decision.members)
        old_rank, old_world = (self.rank if me in self.members else None), len(self.members)
        plan = plan_for(world)  # the same on every member: all fall back together if the world does not fit
        store = EtcdV3Store(self.client, self.keys.hot_group_store(self.identity.round, target), FORM_TIMEOUT)
        self.reformer.reform(store, rank, world, plan)
        # the new epoch is this member's from here: a heal that fails is the new epoch's failure, and its notice
        # releases the members that wait on a live peer in the heal
        self.epoch, self.members, self.fence, self.rank = target, decision.members, decision.token, rank
        nodes = self.verdicts.nodes_of(decision.members)
        self.watch.follow(target, nodes)
        self._follow_silence(nodes)
        self._heals += 1
        faults, heals = self._faults, self._heals
        if self.keeper is not None:
            labels = mirror_label(self.group, target - 1), mirror_label(self.group, target)
            fault = (lambda: None) if faults is None else (lambda: faults.before_heal_piece(heals))
            return (*self.keeper.heal(state, old_rank, old_world, *labels, self.watch.reason, fault), plan)
        healed, report = heal(
            0,
            self.model,
            self.optimizer,
            self.scheduler,
            state,
            registered=registered_objects(self.accelerator),
            abandon=self.watch.reason,
            before_piece=None if faults is None else lambda _piece: faults.before_heal_piece(heals),
        )
        return healed, report.bytes_moved, plan

    def _after_failed_heal(
        self, error: BrokenHeal, state: TrainingState, reason: str, plan_for: Callable[[int], BatchPlan | None]
    ) -> Epoch:
        """The heal of this member's (new) epoch failed: tell the others, bid for the next epoch, wait for it."""
        me = self.identity.member
        self.client.create(self.keys.membership_notice(self.group, self.epoch), f"{me}: the heal failed: {error}")
        step = state.step if error.holds_state else UNHEALED_STEP
        self.membership.bid(self.epoch + 1, Bid(me, self.rank, step))
        return self._decide(self.epoch + 1, reason, plan_for)

    def _decide(self, target: int, reason: str, plan_for: Callable[[int], BatchPlan | None] | None = None) -> Epoch:
        def attempt() -> Epoch | None:
            return self.membership.try_decide(
                target,
                self.members,
                self._is_dead,
                min_members=self.identity.min_members,
                round_=self.identity.round,
                reason=reason,
                fence=self.fence,
                fits=None if plan_for is None else _fits(plan_for),
                out=self.verdicts.out_of(self.epoch),
            )

        me = self.identity.member
        try:
            is_gone = lambda m: self.verdicts.is_gone(m, self.epoch)  # noqa: E731
            return decide(self.membership, target, self.members, me, is_gone, attempt, DECIDE_TIMEOUT_S)
        except DecideTimeout as exc:
            raise HotFallback("decision_timeout", str(exc)) from None

    def _follow_silence(self, nodes: set[str]) -> None:
        if self._greets:
            self.silence.follow(self.identity.node_id, nodes)

    def _report_silent(self, node: str, text: str) -> None:
        """The silence watch's verdict: fail this epoch's step everywhere (its notice), from the watch's thread. Not
        for a node that asked to leave: its daemon ends once its workers left, which is no failure."""
        with contextlib.suppress(EtcdError):  # etcd out of reach: the node's lease expiry is the verdict then
            if node in self.watch.leaving() or node not in self.verdicts.nodes_of(self.members):
                return  # a leaver, or a node of an epoch that is over (the watch moved on meanwhile)
            self.client.create(self.keys.membership_notice(self.group, self.epoch), f"{self.identity.member}: {text}")

    def _is_dead(self, member: str) -> bool:
        return self.verdicts.is_dead(member, self.epoch)

    def _is_out(self, member: str) -> bool:
        return self.verdicts.is_out(member, self.epoch)

    def settle(self) -> tuple[int, int]:
        """Once the group trains at its new size: release the old groups in which nothing given up on is pending
        (their connections close, which ends what the peers still wait for in them) and give what the change freed
        back to the operating system. Returns (old groups released, old groups still held)."""
        abandoned = getattr(self.reformer.groups, "abandoned", None)
        released = 0 if abandoned is None else abandoned.sweep()
        return_free_memory()
        return released, 0 if abandoned is None else len(abandoned)

    def close(self) -> None:
        if self.keeper is not None:
            self.keeper.close()
        self.watch.close()
        self.silence.close()
        self.hook.close()
        abandoned = getattr(self.reformer.groups, "abandoned", None)
        if abandoned is not None and abandoned.drain(DRAIN_AT_CLOSE_S):
            abandoned.leak()  # never destroyed: the exit guard ends this process (hot_path.py)
        if self.listener is not None:
            self.listener.close()


def _comms(
    session: HotSession, sharded: Sharding | None, reload: Callable[[], TrainingState | None]
) -> tuple[ResilientAllReduce | ResilientShardComms, Reformer | ShardedReformer, ShardKeeper | None]:
    """A session's collectives guard, re-former and (sharded) shard keeper: a replicated (DDP) model's gradient
    all-reduce is elasticd's own hook; a sharded model's collectives are FSDP's, its state comes back from mirrors."""
    if sharded is None:
        hook = ResilientAllReduce(session.holder, session.health, notice=session.watch.reason)
        return hook, Reformer(session.accelerator, session.model, session.holder), None
    comms = ResilientShardComms(session.health, notice=session.watch.reason)
    parts = (session.accelerator, session.model, session.optimizer, session.scheduler)
    keeper = ShardKeeper if sharded.hybrid is None else HybridKeeper  # HSDP: the other nodes are the copies
    return comms, ShardedReformer(session.accelerator), keeper(*parts, comms, sharded, session.step_failed, reload)


def fallback_for(exc: Exception) -> HotFallback:
    """The cold restart an error of the hot path leads to, with its reason (``elasticd_hot_fallbacks_total``); an
    error that is none of the hot path's own is raised again."""
    if isinstance(exc, HotFallback):
        return exc
    reasons: tuple[tuple[type[Exception] | tuple[type[Exception], ...], str], ...] = (
        (BelowMinimum, "below_minimum"),
        (BatchPlanError, "batch_plan"),
        ((HealError, ShardHealFailed), "heal_failed"),
        (NoMirror, "no_mirror"),
        (HotRecoveryError, "reform_failed"),
        (EtcdError, "etcd"),
    )
    for kinds, reason in reasons:
        if isinstance(exc, kinds):
            return HotFallback(reason, str(exc))
    raise exc


def _fits(plan_for: Callable[[int], BatchPlan | None]) -> Callable[[int], bool]:
    def fits(world_size: int) -> bool:
        try:
            plan_for(world_size)
        except BatchPlanError:
            return False
        return True

    return fits


def advertised_host(local_addr: str | None) -> str:
    """The address peers probe this worker at: the daemon's ``--local-addr``, else this host's name."""
    return local_addr or socket.getfqdn()


def is_gloo_world() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo"
