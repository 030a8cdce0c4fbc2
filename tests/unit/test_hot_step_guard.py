"""The failed-step guard and the shared step verdict, on accelerate's real optimizer and scheduler wrappers."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.scheduler import AcceleratedScheduler

from elasticd.worker.guard import NonFiniteGuard, Verdict
from elasticd.worker.hot.errors import UnsupportedSetup
from elasticd.worker.hot.failure import StepHealth
from elasticd.worker.hot.step_guard import FailedStepGuard


class Trainee:
    def __init__(self) -> None:
        Accelerator(cpu=True)  # accelerate's wrappers read its shared state
        torch.manual_seed(0)
        self.model = torch.nn.Linear(2, 1)
        self.optimizer = AcceleratedOptimizer(torch.optim.SGD(self.model.parameters(), lr=0.1))
        schedule = torch.optim.lr_scheduler.LambdaLR(self.optimizer.optimizer, lambda s: 1.0 / (1.0 + s))
        self.scheduler = AcceleratedScheduler(schedule, self.optimizer, split_batches=True)

    def step(self, value: float = 1.0) -> None:
        self.model(torch.full((1, 2), value)).sum().backward()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad()

    def snapshot(self) -> tuple[torch.Tensor, float]:
        return self.model.weight.detach().clone(), self.scheduler.get_last_lr()[0]


def test_the_first_failure_of_a_generation_is_kept_and_consuming_it_starts_the_next() -> None:
    health = StepHealth()
    assert health.fail("peer 2 reset the connection", bucket=0)
    assert not health.fail("bucket 1 failed as a consequence", bucket=1)
    failure = health.consume()
    assert failure is not None and failure.reason == "peer 2 reset the connection" and failure.bucket == 0
    assert health.generation == failure.generation + 1 and not health.failed
    assert not health.fail("a late report about the old step", generation=failure.generation)
    assert health.consume() is None


def test_a_failed_step_moves_neither_the_weights_nor_the_schedule_and_the_next_step_moves_both() -> None:
    t = Trainee()
    health = StepHealth()
    guard = FailedStepGuard(health)
    guard.install(t.optimizer)
    t.step()
    assert guard.take() is None
    before = t.snapshot()
    health.fail("all-reduce of bucket 0 failed")
    t.step()
    assert torch.equal(t.snapshot()[0], before[0]) and t.snapshot()[1] == before[1]
    assert guard.skipped == 1 and guard.take() is not None
    t.step()  # accelerate never clears the skip flag without a scaler: the guard must, or the schedule stops
    after = t.snapshot()
    assert not torch.equal(after[0], before[0]) and after[1] < before[1]


@pytest.mark.parametrize("hot_first", [True, False], ids=["hot-inside", "hot-outside"])
def test_the_guard_composes_with_the_nonfinite_guard_in_either_order(hot_first: bool) -> None:
    t = Trainee()
    health = StepHealth()
    hot, nonfinite = FailedStepGuard(health), NonFiniteGuard("rollback")
    installs: list[Any] = [lambda: hot.install(t.optimizer), lambda: nonfinite.install(t.optimizer, t.model.parameters)]
    for install in installs if hot_first else reversed(installs):
        install()
    before = t.snapshot()
    health.fail("peer lost")
    t.step()
    assert t.snapshot()[1] == before[1] and torch.equal(t.snapshot()[0], before[0])
    assert nonfinite.verdict(1) is Verdict.OK  # a failed step is not a non-finite event
    hot.take()
    t.step(float("nan"))  # and a non-finite step is still the non-finite guard's
    assert nonfinite.verdict(2) is Verdict.SKIPPED and hot.skipped == 1
    t.step()
    assert t.snapshot()[1] < before[1]


def test_an_fp16_scaler_or_a_bare_optimizer_is_refused_at_install() -> None:
    Accelerator(cpu=True)
    model = torch.nn.Linear(2, 1)
    scaled = AcceleratedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(UnsupportedSetup, match="fp16 loss scaling"):
        FailedStepGuard(StepHealth()).install(scaled)
    with pytest.raises(UnsupportedSetup, match="AcceleratedOptimizer"):
        FailedStepGuard(StepHealth()).install(torch.optim.SGD(model.parameters(), lr=0.1))
