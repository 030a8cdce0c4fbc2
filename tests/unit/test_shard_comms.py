"""FSDP2's collectives through elasticd's waits (``worker/hot/shard_comms.py``), with stand-ins for gloo's Work: a
collective that ends returns at once, one that fails or is told of a failure elsewhere marks the step failed and
returns as if it had completed."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from elasticd.worker.hot import shard_comms
from elasticd.worker.hot.cutoff import BackwardCutoff
from elasticd.worker.hot.failure import StepHealth
from elasticd.worker.hot.shard_comms import ResilientShardComms

# Long enough that a wait which only ends at its next look at the notice never ends within a test's timeout.
_NEVER_S = 3600.0


class _Work:
    """A collective's Work whose end the test decides: with a future (gloo's all-gather) or without (its
    reduce-scatter: ``get_future`` not implemented)."""

    def __init__(self, *, future: bool, error: Exception | None = None) -> None:
        self._future: torch.futures.Future[Any] | None = torch.futures.Future() if future else None
        self._ended = threading.Event()
        self._error = error

    def get_future(self) -> torch.futures.Future[Any]:
        if self._future is None:
            raise RuntimeError("Work::getFuture not implemented")
        return self._future

    def end(self) -> None:
        self._ended.set()
        if self._future is not None:
            self._future.set_result(None)

    def wait(self) -> bool:
        self._ended.wait()
        if self._error is not None:
            raise self._error
        return True


def _run_in_thread(comms: ResilientShardComms, work: _Work) -> threading.Thread:
    thread = threading.Thread(target=comms.run, args=("all-gather", lambda: work, None), daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("future", [True, False], ids=["future", "waiter-thread"])
def test_a_collective_that_ends_returns_at_once_not_at_the_next_look_at_the_notice(
    monkeypatch: pytest.MonkeyPatch, future: bool
) -> None:
    monkeypatch.setattr(shard_comms, "_NOTICE_POLL_S", _NEVER_S)
    health = StepHealth()
    comms = ResilientShardComms(health)
    for _ in range(3):  # one after another, as FSDP issues them
        work = _Work(future=future)
        thread = _run_in_thread(comms, work)
        work.end()
        thread.join(timeout=10)
        assert not thread.is_alive(), "the wait ended only at the notice poll"
    assert not health.failed


def test_a_failed_collective_fails_the_step_and_returns() -> None:
    health = StepHealth()
    comms = ResilientShardComms(health)
    work = _Work(future=True, error=RuntimeError("Connection reset by peer"))
    thread = _run_in_thread(comms, work)
    work.end()
    thread.join(timeout=10)
    assert not thread.is_alive()
    failure = health.failure
    assert failure is not None and "Connection reset by peer" in failure.reason


def test_a_failure_notice_releases_a_collective_that_never_ends_and_later_ones_are_not_issued() -> None:
    health = StepHealth()
    notice: list[str | None] = [None]
    comms = ResilientShardComms(health, notice=lambda: notice[0])
    stuck = _Work(future=True)  # a peer that never answers
    thread = _run_in_thread(comms, stuck)
    notice[0] = "g.2: all-gather failed"
    comms.nudge()
    thread.join(timeout=10)
    assert not thread.is_alive()
    assert health.failure is not None and "failure notice" in health.failure.reason
    issued: list[bool] = []
    comms.run("reduce-scatter", lambda: issued.append(True), None)  # the rest of the failed step
    assert not issued, "a collective of a failed step was issued on the broken group"
    stuck.end()


def test_after_a_failed_collective_the_backward_cutoff_is_asked_and_not_after_a_healthy_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def all_gather_single(*_args: Any, **_kwargs: Any) -> _Work:
        work = _Work(future=True)
        work.end()
        return work

    monkeypatch.setattr(shard_comms.dist, "all_gather_single", all_gather_single)
    health = StepHealth()
    comms = ResilientShardComms(health)
    asked: list[bool] = []
    comms.after_failed = lambda: asked.append(True)
    comms.all_gather(torch.empty(2), torch.empty(1), None)  # FSDP's call, healthy
    assert not asked
    health.fail("a peer died")
    comms.reduce_scatter(torch.empty(1), torch.empty(2), None)  # a failed step: issues nothing, asks the cutoff
    assert asked == [True]


class _Accelerator:
    """accelerate's ``backward`` as the cutoff sees it: a call that runs the pass (here: FSDP's collectives of it)."""

    def __init__(self, pass_: Any) -> None:
        self.pass_ = pass_

    def backward(self, loss: Any, **_kwargs: Any) -> Any:
        self.pass_()
        return "done"


def test_a_sharded_backward_of_a_failed_step_is_unwound_at_its_collective_and_fsdp_reset_after() -> None:
    health = StepHealth()
    cutoff = BackwardCutoff(health, notice=lambda: None, abort=lambda _reason: None)
    later: list[str] = []
    resets: list[bool] = []

    def pass_() -> None:
        cutoff.cut()  # FSDP's first collective of the pass: the step failed before it
        later.append("the rest of the pass")

    accelerator = _Accelerator(pass_)
    cutoff.wrap(accelerator, after_cut=lambda: resets.append(True))
    assert accelerator.backward(None) == "done" and later == ["the rest of the pass"]  # healthy: nothing cut
    health.fail("all-gather failed: Connection reset by peer")
    assert accelerator.backward(None) is None
    assert later == ["the rest of the pass"] and resets == [True] and cutoff.cuts == 1
    cutoff.cut()  # outside the wrapped backward (a forward's collective): never raises
