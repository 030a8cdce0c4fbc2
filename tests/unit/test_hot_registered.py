"""Objects registered for checkpointing through a discarded step and a heal, on accelerate's real wrappers: a failed
step leaves them as a restart from the step before it would, and a healthy step copies nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from accelerate import Accelerator

from elasticd.worker.hot.failure import StepHealth
from elasticd.worker.hot.heal import _describe, _mismatch
from elasticd.worker.hot.registered import Rollback, capture, registered_objects, restore
from elasticd.worker.hot.step_guard import FailedStepGuard


class Counter:
    """A step counter kept the accelerate way, with plain Python values of several kinds."""

    def __init__(self) -> None:
        self.steps = 0
        self.seen: list[tuple[int, str]] = []
        self.state_dicts = 0  # how often its state was taken

    def state_dict(self) -> dict[str, Any]:
        self.state_dicts += 1
        return {"steps": self.steps, "seen": list(self.seen)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps, self.seen = state["steps"], list(state["seen"])


class Ema(torch.nn.Module):
    """An exponential moving average of a model's parameters, a module of its own (tensors in its state)."""

    def __init__(self, model: torch.nn.Module, decay: float = 0.9) -> None:
        super().__init__()
        self.decay = decay
        self.shadow = torch.nn.ParameterList(
            [torch.nn.Parameter(p.detach().clone(), requires_grad=False) for p in model.parameters()]
        )

    @torch.no_grad()
    def update(self, model: torch.nn.Module) -> None:
        for shadow, p in zip(self.shadow, model.parameters(), strict=True):
            shadow.mul_(self.decay).add_(p.detach(), alpha=1 - self.decay)


class Job:
    """One worker's training objects, prepared by accelerate, with a counter and an EMA registered."""

    def __init__(self) -> None:
        self.accelerator = Accelerator(cpu=True)
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1.0 + s))
        self.model, self.optimizer, self.scheduler = self.accelerator.prepare(model, optimizer, scheduler)
        self.counter, self.ema = Counter(), Ema(self.model)
        self.accelerator.register_for_checkpointing(self.counter, self.ema)
        self.health = StepHealth()
        self.guard = FailedStepGuard(self.health, Rollback(lambda: registered_objects(self.accelerator)))
        self.guard.install(self.optimizer)

    def step(self, *, fail: bool = False) -> bool:
        """One optimizer step and the script's post-step code; True when the step was not discarded."""
        if fail:
            self.health.fail("all-reduce of bucket 0 failed")  # what the hook records during backward
        self.accelerator.backward(self.model(torch.ones(1, 3)).sum())
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad()
        self.counter.steps += 1
        self.counter.seen.append((self.counter.steps, "x"))
        self.ema.update(self.model)
        return self.guard.take() is None

    def registered(self) -> tuple[dict[str, Any], list[torch.Tensor]]:
        counter = {"steps": self.counter.steps, "seen": list(self.counter.seen)}
        return counter, [t.detach().clone() for t in self.ema.shadow]


def _same(a: tuple[dict[str, Any], list[torch.Tensor]], b: tuple[dict[str, Any], list[torch.Tensor]]) -> bool:
    return a[0] == b[0] and all(torch.equal(x, y) for x, y in zip(a[1], b[1], strict=True))


def test_a_discarded_step_leaves_the_registered_objects_as_a_restart_from_the_step_before_would(
    tmp_path: Path,
) -> None:
    job = Job()
    assert job.step() and job.step()
    job.accelerator.save_state(str(tmp_path / "step-2"))  # what a restart from step 2 would load
    before = job.registered()
    assert not job.step(fail=True)  # the post-step code ran: counter and EMA moved, then the boundary undid it
    rolled_back = job.registered()
    assert _same(rolled_back, before) and rolled_back[0]["steps"] == 2
    job.accelerator.load_state(str(tmp_path / "step-2"))
    assert _same(job.registered(), rolled_back)
    assert job.step()  # the next step moves them again
    assert job.counter.steps == 3 and not torch.equal(job.ema.shadow[0], before[1][0])


def test_a_healthy_step_takes_no_copy_of_the_registered_objects() -> None:
    job = Job()
    for _ in range(5):
        assert job.step()
    assert job.counter.state_dicts == 0  # an EMA as large as the model would cost a model-sized copy per step
    assert not job.step(fail=True)
    assert job.counter.state_dicts == 1  # taken once, at the skip


def test_a_second_skip_in_the_same_step_keeps_the_state_from_before_the_first() -> None:
    counter = Counter()
    rollback = Rollback(lambda: [counter])
    rollback.keep()
    counter.steps = 1
    rollback.keep()  # a second optimizer of the same failed step
    counter.steps = 2
    assert rollback.restore() and counter.steps == 0
    assert not rollback.restore()  # nothing kept for the next step


def test_a_heal_loads_the_source_s_objects_and_refuses_another_set_of_them() -> None:
    source, receiver = Job(), Job()
    source.step()
    source.step()
    restore(registered_objects(receiver.accelerator), capture(registered_objects(source.accelerator)))
    assert _same(receiver.registered(), source.registered()) and receiver.counter.steps == 2
    with pytest.raises(ValueError, match="2 registered objects were captured, this process has 1"):
        restore([Counter()], capture([source.counter, source.ema]))
    mine = _describe(receiver.model, receiver.optimizer, receiver.scheduler, [receiver.counter])
    theirs = _describe(source.model, source.optimizer, source.scheduler, [source.counter, source.ema])
    assert "objects registered for checkpointing ['Counter'], the source has ['Counter', 'Ema']" in _mismatch(
        mine, theirs
    )
