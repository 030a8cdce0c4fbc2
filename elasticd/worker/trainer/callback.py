"""What the daemon hears of a ``transformers.Trainer`` run, through Trainer's callback events.

The same signals the worker library gives (``elasticd.attach``): the hang watchdog's slot (the step entered and
completed), step beats (samples, step time, loss) and the checkpoint requests of the daemon (SIGUSR2: a drain, a
cold join, a SIGTERM of the daemon), agreed between the ranks at the same step as in ``run.step``
(:class:`~elasticd.worker.coordination.Coordinator`). A request sets Trainer's ``should_save``; Trainer saves at
once, into the lineage (:mod:`elasticd.worker.trainer.commits`), and the worker then waits to be stopped.
"""

from __future__ import annotations

import time
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from elasticd.board import Phase, SlotWriter
from elasticd.worker.coordination import Coordinator
from elasticd.worker.step_beats import StepBeats


class ElasticCallback(TrainerCallback):
    """Beats, the watchdog's slot and agreed checkpoint requests, step by step (installed by ``elasticd.Trainer``)."""

    def __init__(self, slot: SlotWriter, step_beats: StepBeats, coordinator: Coordinator, samples_per_step: int):
        self.slot = slot
        self.step_beats = step_beats
        self.coordinator = coordinator
        self.samples_per_step = samples_per_step
        self.requested = False  # the save Trainer makes now was asked for by the daemon: park after it
        self.last_loss: Any = None  # the step's loss (elasticd.Trainer's training_step keeps it)
        self._started = time.perf_counter()

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **_: Any) -> None:
        self.slot.resumed(state.global_step)
        self._started = time.perf_counter()

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **_: Any) -> None:
        self.slot.enter(state.global_step + 1)

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **_: Any) -> None:
        now = time.perf_counter()
        step_time_s, self._started = now - self._started, now
        step = state.global_step
        self.slot.completed(step, step_time_s, 0.0)
        self.step_beats.completed(
            step,
            now=now,
            samples=self.samples_per_step,
            step_time_s=step_time_s,
            own_s=0.0,
            loss=self.last_loss,
            urgent=False,
        )
        outcome = self.coordinator.at_step(step, step_time_s)
        if outcome.checkpoint:
            control.should_save = True  # Trainer saves right after this event, at this step, on every rank
            self.requested = outcome.requested

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **_: Any) -> None:
        self.slot.set_phase(Phase.DONE)
