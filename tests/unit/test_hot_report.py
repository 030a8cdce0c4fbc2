"""The report of a change in place (``worker/hot_path.py``): the ``reconfigured`` beat sent at the first step at the
new size counts as lost the completed steps the worker trains again, from its state before and after the heal."""

from __future__ import annotations

from typing import Any

import pytest

from elasticd.membership import Epoch
from elasticd.messages import Kind
from elasticd.worker.hot.session import Recovered
from elasticd.worker.hot_path import HotPath
from elasticd.worker.state import TrainingState


class _Recorder:
    """Stands in for the run's slot, log and beats: takes every call."""

    def __init__(self) -> None:
        self.beats: list[tuple[Any, dict[str, Any]]] = []

    def send(self, kind: Any, **fields: Any) -> None:
        self.beats.append((kind, fields))

    def __getattr__(self, _name: str) -> Any:
        return lambda *args, **kwargs: None


class _Run:
    """The part of :class:`~elasticd.worker.run.Run` a change in place reports through."""

    def __init__(self, step: int) -> None:
        self.state = TrainingState(step=step)
        self.slot = self.log = self.beats = _Recorder()
        self.settings = type("Settings", (), {"nproc_per_node": 1})()

    def regrouped(self, rank: int, world_size: int, state: TrainingState, *_args: Any, **_kwargs: Any) -> None:
        self.state = state


class _Session:
    """The part of the hot session the report calls: the settling after a change."""

    def __init__(self) -> None:
        self.settled = 0

    def settle(self) -> tuple[int, int]:
        self.settled += 1
        return 0, 0

    def after_step(self, state: TrainingState) -> None:
        return None  # a replicated (DDP) job keeps no shard mirror


def _recovered(step: int, reason: str) -> Recovered:
    epoch = Epoch(1, ("g.0", "g.1"), "g.0", step, "3.e1.token", reason)
    return Recovered(epoch, 1, 2, TrainingState(step=step), None, 0, 0.0)


@pytest.mark.parametrize(
    ("completed", "healed", "lost"),
    [
        (41, 41, 0),  # a survivor: the failed step 42 was discarded, never completed; healed to 41 like everyone
        (41, 39, 2),  # a member ahead of the state it is healed to trains steps 40 and 41 again
        (0, 41, 0),  # a joiner, healed forward from nothing
    ],
    ids=["survivor", "behind-the-source", "joiner"],
)
def test_the_reconfigured_beat_counts_the_completed_steps_trained_again(completed: int, healed: int, lost: int) -> None:
    run = _Run(completed)
    session = _Session()
    path = HotPath(run, session=session)  # type: ignore[arg-type]  # reporting uses the run and the settling
    path._adopt(_recovered(healed, "failure"))
    path.stepped()
    path.stepped()
    [(kind, fields)] = run.beats.beats
    assert kind is Kind.RECONFIGURED and fields["lost_steps"] == lost
    assert run.state.step == healed
    assert session.settled == 1  # once per change, at its first step
