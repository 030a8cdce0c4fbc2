"""The resilient all-reduce hook on real gloo groups of two, both ranks in this process (a thread each).

A rank that never reaches the collective stands for a peer that hangs or waits on someone else; the hook must give
control back (deadline, notice, abort) with every in-flight bucket completed (the heal: test_heal.py). DDP's
``GradBucket`` cannot be built from Python, so the hook gets an object with the two methods it uses; DDP's own checks
of the hook's signature run on a real DDP model in a world of one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist

from elasticd.etcd.client import EtcdClient
from elasticd.rendezvous.store import EtcdV3Store
from elasticd.worker.hot.backend import GlooGroups, groups_for
from elasticd.worker.hot.comm_hook import BUFFERS, GroupHolder, ResilientAllReduce, resilient_allreduce_hook
from elasticd.worker.hot.errors import ReformError, UnsupportedSetup
from elasticd.worker.hot.failure import StepHealth
from elasticd.worker.hot.given_up import GivenUp
from elasticd.worker.hot.reform import DEFAULT_GROUP_TIMEOUT
from tests.integration.cluster import wait_until
from tests.integration.gloo_groups import gloo_group, on_every_rank

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

SETTLE_S = 5.0  # generous "eventually" on a loaded box: each of these completes in milliseconds when it works


class _Bucket:
    """The part of ``dist.GradBucket`` the hook uses."""

    def __init__(self, index: int, values: list[float]) -> None:
        self._index = index
        self._buffer = torch.tensor(values)

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer


def Bucket(index: int, values: list[float]) -> dist.GradBucket:
    """A stand-in for torch's GradBucket (which has no public constructor), typed as one for the hook."""
    return cast(dist.GradBucket, _Bucket(index, values))


def gloo_pair(timeout: timedelta = timedelta(seconds=30)) -> list[Any]:
    return gloo_group(2, timeout)


@pytest.fixture
def pair() -> Iterator[list[Any]]:
    yield gloo_pair()


def catch_up(peer: Any, *sizes: int) -> None:
    """The absent rank finally joins the collectives the other one abandoned, so that no collective is left pending
    when the groups go (gloo would fail it at exit, and its thread would take the process down)."""
    for size in sizes:
        peer.allreduce([torch.zeros(size)]).wait(timedelta(seconds=30))


def hook_for(group: Any, **kwargs: Any) -> tuple[ResilientAllReduce, StepHealth]:
    health = StepHealth()
    return ResilientAllReduce(GroupHolder(group), health, **kwargs), health


def result(future: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
    deadline = time.monotonic() + SETTLE_S
    while not future.done() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert future.done(), "the bucket's future was left pending"
    return future.value()


def test_a_healthy_step_averages_every_bucket_over_the_group(pair: list[Any]) -> None:
    hooks = [hook_for(g)[0] for g in pair]
    futures = [hooks[r].reduce(Bucket(0, [2.0 * r, 4.0])) for r in range(2)]
    assert [result(f).tolist() for f in futures] == [[1.0, 4.0], [1.0, 4.0]]
    assert not any(h.health.failed for h in hooks)


def test_an_abort_completes_every_in_flight_bucket_unreduced_and_fails_the_step(pair: list[Any]) -> None:
    hook, health = hook_for(pair[0])
    # rank 1 never reaches this step's collectives: both buckets stay in flight on rank 0
    first = hook.reduce(Bucket(0, [1.0, 2.0]))
    second = hook.reduce(Bucket(1, [3.0]))
    time.sleep(0.05)
    assert not first.done() and not second.done()
    hook.abort("peer 1 declared dead")
    assert result(first).tolist() == [1.0, 2.0]  # this rank's own gradient: untouched by the abandoned collective
    assert result(second).tolist() == [3.0]
    failure = health.failure
    assert failure is not None and failure.reason == "peer 1 declared dead"
    # a bucket that becomes ready after the failure completes at once, without touching the broken group
    late = hook.reduce(Bucket(2, [5.0]))
    assert late.done() and late.value().tolist() == [5.0]
    catch_up(pair[1], 2, 1)


def test_polled_buckets_settle_when_their_collectives_complete(pair: list[Any]) -> None:
    """The way buckets on a GPU are settled (their futures complete at enqueue), exercised on gloo."""
    hooks = [hook_for(g, poll=True)[0] for g in pair]
    futures = [[hooks[r].reduce(Bucket(i, [2.0 * r + i, 4.0])) for i in range(2)] for r in range(2)]
    assert [[result(f).tolist() for f in fs] for fs in futures] == [[[1.0, 4.0], [2.0, 4.0]]] * 2
    assert not any(h.health.failed for h in hooks)
    for hook in hooks:
        hook.close()


def test_a_polled_bucket_whose_collective_fails_fails_the_step() -> None:
    """gloo's own timeout (0.5 s) fails the collective: the work completes with an error, which the poll reads."""
    pair = gloo_pair(timeout=timedelta(seconds=0.5))
    hook, health = hook_for(pair[0], poll=True)
    future = hook.reduce(Bucket(0, [1.0, 2.0]))
    assert result(future).tolist() == [1.0, 2.0]  # this rank's own gradient
    failure = health.failure
    assert failure is not None and "all-reduce of bucket 0 failed" in failure.reason, failure
    hook.close()


def test_an_abort_completes_polled_buckets_too(pair: list[Any]) -> None:
    hook, health = hook_for(pair[0], poll=True)
    futures = [hook.reduce(Bucket(i, [float(i)])) for i in range(2)]
    time.sleep(0.05)
    assert not any(f.done() for f in futures)  # polled, not completed: rank 1 never came
    hook.abort("peer 1 declared dead")
    assert [result(f).tolist() for f in futures] == [[0.0], [1.0]]
    assert health.failure is not None
    hook.close()
    catch_up(pair[1], 1, 1)


def test_the_default_groups_backend_picks_how_groups_are_re_formed() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert isinstance(groups_for(dist.group.WORLD, timeout=timedelta(seconds=30), environ={}), GlooGroups)
    finally:
        dist.destroy_process_group()


def test_a_group_whose_member_never_comes_is_given_up_after_the_store_s_timeout_not_the_group_s(
    etcd_client: EtcdClient,
) -> None:
    """A member that died or fell back between the membership decision and the formation. gloo alone waits for its
    address the group's timeout (10 minutes for a group hot recovery forms: longer than this test may run); the
    members that came give up after the store's, and take the cold path."""
    assert not dist.is_initialized()
    store = EtcdV3Store(etcd_client, "/test/form/", timeout=timedelta(seconds=2))
    with pytest.raises(ReformError, match="elasticd_arrived/1"):
        GlooGroups(DEFAULT_GROUP_TIMEOUT).replace(store, 0, 2, None)
    assert not dist.is_initialized()


def test_a_bucket_past_its_deadline_fails_the_step(pair: list[Any]) -> None:
    hook, health = hook_for(pair[0], timeout=timedelta(seconds=0.3))
    started = time.monotonic()
    futures = [hook.reduce(Bucket(i, [float(i)])) for i in range(3)]
    assert [result(f).tolist() for f in futures] == [[0.0], [1.0], [2.0]]
    assert time.monotonic() - started >= 0.3
    failure = health.failure
    assert failure is not None and "timed out" in failure.reason
    catch_up(pair[1], 1, 1, 1)


def test_a_failure_notice_releases_a_rank_waiting_on_a_peer_that_gave_up(pair: list[Any]) -> None:
    notice: list[str] = []
    hook, health = hook_for(
        pair[0], notice=lambda: notice[0] if notice else None, notice_interval=timedelta(milliseconds=20)
    )
    future = hook.reduce(Bucket(0, [1.0]))
    time.sleep(0.1)
    assert not future.done()  # no notice yet: the wait goes on (its deadline is 10 minutes away)
    notice.append("rank 1: connection reset by rank 2")
    assert result(future).tolist() == [1.0]
    failure = health.failure
    assert failure is not None and "connection reset by rank 2" in failure.reason
    catch_up(pair[1], 1)


def test_a_nudge_releases_a_bucket_in_flight_when_the_notice_has_a_reason(pair: list[Any]) -> None:
    notice: list[str] = []
    hook, health = hook_for(pair[0], notice=lambda: notice[0] if notice else None)  # no interval: nudged, not polled
    future = hook.reduce(Bucket(0, [1.0]))
    notice.append("rank 1: connection reset by rank 2")
    time.sleep(0.2)
    assert not future.done()  # nobody polls the notice: without a nudge the wait goes on (to its 10-minute deadline)
    hook.nudge()
    assert result(future).tolist() == [1.0]
    failure = health.failure
    assert failure is not None and "connection reset by rank 2" in failure.reason
    catch_up(pair[1], 1)


def test_a_notice_that_came_while_nothing_was_in_flight_fails_the_next_bucket_at_once(pair: list[Any]) -> None:
    notice = ["rank 1: connection reset by rank 2"]
    hook, health = hook_for(pair[0], notice=lambda: notice[0] if notice else None)
    hook.nudge()  # nothing in flight: nothing to release, and the nudge is not kept for later
    future = hook.reduce(Bucket(0, [1.0]))
    assert future.done() and future.value().tolist() == [1.0]  # not issued: rank 1 never has to catch up
    failure = health.failure
    assert failure is not None and "connection reset by rank 2" in failure.reason


def test_a_copy_given_up_on_is_never_reused(pair: list[Any]) -> None:
    hooks = [hook_for(g)[0] for g in pair]
    futures = [hooks[r].reduce(Bucket(0, [float(r)])) for r in range(2)]
    healthy = result(futures[0])
    again = [hooks[r].reduce(Bucket(0, [float(r)])) for r in range(2)]
    assert result(again[0]).data_ptr() == healthy.data_ptr()  # a healthy step's copy serves the next one
    result(again[1])
    hooks[0].health.consume()
    abandoned = hooks[0].reduce(Bucket(0, [7.0]))  # rank 1 is late: in flight
    given_up = hooks[0]._copies[0]
    hooks[0].abort("peer 1 declared dead")
    assert result(abandoned).tolist() == [7.0]
    hooks[0].health.consume()
    catch_up(pair[1], 1)  # the abandoned collective completes now, writing into the copy given up on
    futures = [hooks[r].reduce(Bucket(0, [float(2 * r)])) for r in range(2)]
    fresh = result(futures[0])
    assert fresh.data_ptr() != given_up.data_ptr()
    assert fresh.tolist() == [1.0] and result(futures[1]).tolist() == [1.0]


def test_a_collective_failed_while_it_was_being_issued_is_held_until_it_has_ended(
    pair: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    import elasticd.worker.hot.comm_hook as comm_hook

    held = GivenUp()  # what keeps a pending gloo Work from its destructor
    monkeypatch.setattr(comm_hook, "GIVEN_UP", held)

    class FailsWhileIssuing:
        """The group, but a verdict (a nudge, another bucket's failure) lands while the all-reduce is issued."""

        def __init__(self, group: Any) -> None:
            self.group, self.work = group, None
            self.hook: ResilientAllReduce | None = None

        def size(self) -> int:
            return int(self.group.size())

        def allreduce(self, tensors: list[torch.Tensor]) -> Any:
            assert self.hook is not None
            self.hook.abort("peer 1 declared dead")
            self.work = self.group.allreduce(tensors)
            return self.work

    group = FailsWhileIssuing(pair[0])
    hook = ResilientAllReduce(GroupHolder(group), StepHealth())  # type: ignore[arg-type]  # a wrapper of the group
    group.hook = hook
    future = hook.reduce(Bucket(0, [1.0]))
    assert result(future).tolist() == [1.0]
    assert hook.health.failed
    assert held.pending(group) == 1, "the given-up collective's Work was left to the garbage collector"
    catch_up(pair[1], 1)
    wait_until(lambda: held.pending(group) == 0, 10, "the given-up collective ends, and is let go")


def test_a_late_verdict_about_a_consumed_failure_does_not_fail_the_next_step(pair: list[Any]) -> None:
    hooks = [hook_for(g)[0] for g in pair]
    hooks[0].abort("first failure")
    old_generation = hooks[0].health.generation
    assert hooks[0].health.consume() is not None
    hooks[0].abort("the same failure, reported late", generation=old_generation)
    assert not hooks[0].health.failed
    futures = [hooks[r].reduce(Bucket(0, [float(r)])) for r in range(2)]
    assert [result(f).tolist() for f in futures] == [[0.5], [0.5]]


def test_the_hook_reduces_on_whatever_group_the_holder_holds_now(pair: list[Any]) -> None:
    holders = [GroupHolder(g) for g in pair]
    hooks = [ResilientAllReduce(holders[r], StepHealth()) for r in range(2)]
    replacement = gloo_pair()
    for rank in range(2):
        holders[rank].set(replacement[rank])
    # the old pair is left alone: only the new one could complete this
    futures = [hooks[r].reduce(Bucket(0, [float(4 * r)])) for r in range(2)]
    assert [result(f).tolist() for f in futures] == [[2.0], [2.0]]


def test_ddp_accepts_the_hook_and_a_string_annotation_is_refused(world_of_one: None) -> None:
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
    ResilientAllReduce(GroupHolder(), StepHealth()).register(model)
    model(torch.ones(1, 2)).sum().backward()  # the hook ran (world of one: the mean is the gradient itself)

    # the pitfall this module avoids: with `from __future__ import annotations` (as in this test file) the
    # annotation is the string "dist.GradBucket", which DDP refuses
    def stringly(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        return resilient_allreduce_hook(state, bucket)  # type: ignore[arg-type]  # the point: a state of the wrong type

    fresh = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"bucket annotation should be dist\.GradBucket"):
        fresh.register_comm_hook(state=None, hook=stringly)


def test_a_second_hook_is_an_unsupported_setup(world_of_one: None) -> None:
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
    model.register_comm_hook(state=None, hook=lambda _state, bucket: _done(bucket))
    with pytest.raises(UnsupportedSetup, match="a user communication hook"):
        ResilientAllReduce(GroupHolder(), StepHealth()).register(model)


def _done(bucket: Any) -> torch.futures.Future[torch.Tensor]:
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


class HeldBucket:
    """One DDP bucket whose buffer is the same tensor step after step, as DDP's is between re-formations."""

    def __init__(self, values: list[float]) -> None:
        self.tensor = torch.tensor(values)

    def index(self) -> int:
        return 0

    def buffer(self) -> torch.Tensor:
        return self.tensor


def test_in_place_a_bucket_a_given_up_collective_holds_is_reduced_into_a_copy_until_that_collective_ends(
    pair: list[Any],
) -> None:
    hooks = [hook_for(g)[0] for g in pair]
    buckets = [HeldBucket([2.0 * r]) for r in range(2)]
    for hook in hooks:
        hook.in_place = True  # as register() sets it on a DDP model whose buckets re-forming rebuilds
    futures = [hooks[r].reduce(buckets[r]) for r in range(2)]  # type: ignore[arg-type]
    healthy = result(futures[0])
    assert healthy.data_ptr() == buckets[0].tensor.data_ptr() and healthy.tolist() == [1.0]  # the bucket itself
    result(futures[1])
    buckets[0].tensor.fill_(6.0)
    abandoned = hooks[0].reduce(buckets[0])  # type: ignore[arg-type]  # rank 1 is late: in flight, in place
    hooks[0].abort("peer 1 declared dead")
    result(abandoned)
    hooks[0].health.consume()
    # the same buffer again while the given-up collective still holds it: reduced into a copy, the buffer untouched
    buckets[0].tensor.fill_(8.0)
    held = hooks[0].reduce(buckets[0])  # type: ignore[arg-type]
    catch_up(pair[1], 1)  # the given-up collective ends (into the bucket), then rank 1 takes part in the held one
    late = hooks[1].reduce(HeldBucket([0.0]))  # type: ignore[arg-type]
    copy = result(held)
    assert copy.data_ptr() != buckets[0].tensor.data_ptr() and copy.tolist() == [4.0]
    result(late)
    # ended: the bucket is reduced in place again
    wait_until(lambda: hooks[0]._reducible_in_place(buckets[0].tensor), 10, "the given-up collective to end")
    futures = [hooks[r].reduce(buckets[r]) for r in range(2)]  # type: ignore[arg-type]
    assert result(futures[0]).data_ptr() == buckets[0].tensor.data_ptr()
    result(futures[1])


def test_a_ddp_model_is_reduced_in_place_unless_ddp_never_rebuilds_its_buckets(world_of_one: None) -> None:
    for find_unused, in_place in ((False, True), (True, False)):
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1), find_unused_parameters=find_unused)
        hook = ResilientAllReduce(GroupHolder(dist.group.WORLD), StepHealth())
        hook.register(model)
        assert hook.in_place is in_place


def buffers(rank: int) -> dict[str, torch.Tensor]:
    """What a model's buffers look like: BatchNorm's statistics (float) and counters, BERT's position ids (int)."""
    return {
        "bn.running_mean": torch.full((3,), float(rank)),
        "bn.num_batches_tracked": torch.tensor(10 * rank),
        "position_ids": torch.arange(4).reshape(1, 4) + rank,
    }


def test_a_healthy_forward_gets_rank_0s_buffers_on_every_rank(pair: list[Any]) -> None:
    hooks = [hook_for(g)[0] for g in pair]
    held = [buffers(rank) for rank in range(2)]
    outcomes = on_every_rank(lambda rank: hooks[rank].sync_buffers(held[rank]), 2)
    assert outcomes == [None, None]
    for name, value in buffers(0).items():
        assert torch.equal(held[1][name], value), name
    assert not any(h.health.failed for h in hooks)


def test_a_buffer_broadcast_a_peer_never_joins_fails_the_step_and_keeps_the_buffers(pair: list[Any]) -> None:
    """The broadcast DDP makes before each forward, a peer lost meanwhile: the step fails (it is discarded and
    re-formed at its boundary) instead of the forward raising, and this rank keeps its own buffers."""
    hook, health = hook_for(pair[1])
    held = buffers(1)
    forward = threading.Thread(target=hook.sync_buffers, args=(held,))  # rank 0 never comes
    forward.start()
    time.sleep(0.2)
    assert forward.is_alive()  # waiting on the broadcast (its deadline is 10 minutes away)
    hook.abort("peer 0 declared dead")  # the failure watch's verdict
    forward.join(SETTLE_S)
    assert not forward.is_alive(), "the forward pass was left waiting"
    failure = health.failure
    assert failure is not None and failure.reason == "peer 0 declared dead"
    for name, value in buffers(1).items():
        assert torch.equal(held[name], value), name
    # rank 0 finally broadcasts the one rank 1 gave up on (the float buffers; the step had failed before the int64
    # ones): no collective is left pending
    options = dist.BroadcastOptions()
    options.rootRank = 0
    pair[0].broadcast([torch.zeros(3)], options).wait(timedelta(seconds=30))


def test_a_buffer_broadcast_whose_collective_fails_fails_the_step_instead_of_raising() -> None:
    """gloo's own timeout (0.5 s) fails the broadcast, as a peer's reset connection does: no exception reaches
    the forward pass."""
    pair = gloo_pair(timeout=timedelta(seconds=0.5))
    hook, health = hook_for(pair[1])
    held = buffers(1)
    hook.sync_buffers(held)
    failure = health.failure
    assert failure is not None and "broadcast of the module's buffers failed" in failure.reason, failure
    assert failure.bucket == BUFFERS
    assert torch.equal(held["bn.running_mean"], torch.ones(3))


def test_ddp_runs_the_buffer_hook_before_each_forward(world_of_one: None) -> None:
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3))
    )
    hook = ResilientAllReduce(GroupHolder(), StepHealth())
    hook.register(model)
    seen: list[list[str]] = []
    sync = hook.sync_buffers

    def counted(named: dict[str, torch.Tensor]) -> None:
        seen.append(sorted(named))
        sync(named)

    hook.sync_buffers = counted  # type: ignore[method-assign,assignment]
    for _ in range(2):
        model(torch.ones(4, 2)).sum().backward()
    names = ["1.num_batches_tracked", "1.running_mean", "1.running_var"]
    assert seen == [names, names]
    assert not hook.health.failed
