"""``elasticd.Trainer``: a ``transformers.Trainer`` that trains one run through lost and joining nodes.

A script changes one line: ``from elasticd import Trainer`` (instead of transformers'), and may name its global
batch (``Trainer(..., global_batch_size=48)``; else the first start's ``per_device_train_batch_size x
gradient_accumulation_steps x world size``, kept by every later start). A subclass, not a callback: a callback
cannot replace Trainer's data loader, its gradient accumulation, where it saves or what it resumes from. What it
changes, each in one overridden method:

- **Resume** from the newest checkpoint the run's lineage records (``train``), never from a folder found on disk.
- **Save** Trainer's ``checkpoint-N`` into the lineage, committed atomically (``_save_checkpoint``,
  :mod:`~elasticd.worker.trainer.commits`) at ``save_steps``, when the daemon asks (a drain, a SIGTERM, a cold
  join) and at the end of training.
- **The global batch** stays constant: ``gradient_accumulation_steps`` is recomputed from the world size at each
  start (``train``), and a world that does not split it becomes spares, as with ``run.dataloader``.
- **The data**: every world size trains the same micro-batches at the same step
  (:mod:`~elasticd.worker.trainer.steps`), so Trainer's own resume arithmetic lands on the exact sample.
- **The arithmetic**, so the weights do not depend on the world size history: the loss is scaled by
  ``1/accumulation`` after the backward pass, on the fp32 gradients (Trainer scales the loss before it; under bf16
  autocast that rounding differs between an accumulation of 2 and of 3 by 0.28 % of a micro-batch's gradient,
  measured here), and the RNG is seeded per micro-batch from (seed, step, micro-batch), not per rank, so dropout
  draws the same masks at any world size.
- **Beats, the hang watchdog, the NaN guard and checkpoint requests** through :mod:`~elasticd.worker.trainer.callback`.

Recovery is cold: a lost or joining node restarts the workers from the newest commit. In place needs the step
boundary ``run.batches``/``run.step`` drive, and Trainer owns its loop; the start says so (``trainer_started``).
Without a daemon (plain ``python``/``accelerate launch``) it trains as Trainer does, its checkpoints committed to
``--checkpoint-dir``'s default on disk.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import structlog
import torch
import transformers
from transformers.trainer_utils import set_seed

from elasticd.board import NullSlotWriter, Phase, SlotWriter
from elasticd.layout import slot_path
from elasticd.logging import configure_logging, get_logger
from elasticd.messages import Capability, FatalReason, Kind
from elasticd.worker.beats import BeatClient
from elasticd.worker.coordination import Coordinator, park
from elasticd.worker.diagnostics import WorkerDiagnostics
from elasticd.worker.faults import FaultInjector
from elasticd.worker.guard import NonFiniteGuard, Verdict
from elasticd.worker.planning import Planner, TrainingStopped
from elasticd.worker.save_events import SaveEvents
from elasticd.worker.settings import WorkerSettings
from elasticd.worker.step_beats import StepBeats
from elasticd.worker.trainer.callback import ElasticCallback
from elasticd.worker.trainer.commits import TrainerCommits, trainer_folder
from elasticd.worker.trainer.steps import StepBatches, StepLoader

# Trainer's private methods this subclass overrides or calls (read from transformers 5.25): checked at construction,
# so a transformers release that renamed one fails at start with one line, not silently mid-run.
TRAINER_PRIVATES = (
    "_save_checkpoint",
    "_load_rng_state",
    "_maybe_log_save_evaluate",
    "_get_output_dir",
    "_get_collator_with_removed_columns",
)
CHECKED_WITH = "5.25"
RECOVERY = "cold"
RECOVERY_WHY = "Trainer owns the training loop; in place needs the step boundary run.batches/run.step drive"


class Trainer(transformers.Trainer):
    """``transformers.Trainer``, elastic (see the module docstring); ``global_batch_size``: samples per optimizer
    step, all ranks together, at every world size."""

    def __init__(self, *args: Any, global_batch_size: int | None = None, **kwargs: Any) -> None:
        moved = [name for name in TRAINER_PRIVATES if not callable(getattr(transformers.Trainer, name, None))]
        if moved:
            raise TrainingStopped(
                f"elasticd: error: transformers {transformers.__version__}'s Trainer has no {', '.join(moved)}, which"
                f" elasticd.Trainer overrides (checked with transformers {CHECKED_WITH}.x)"
            )
        super().__init__(*args, **kwargs)
        self.elastic_settings = settings = WorkerSettings.from_env()
        self._global_batch = global_batch_size
        accelerator = self.accelerator
        self._rank, self._world = int(accelerator.process_index), int(accelerator.num_processes)
        if not structlog.is_configured():
            configure_logging(stdlib=False)
        self.elastic_log = get_logger(rank=self._rank, run_id=settings.run_id)
        self._beats = BeatClient.from_env()
        board = settings.board
        self._slot = SlotWriter(slot_path(board, settings.local_rank)) if board else NullSlotWriter()
        self._diagnostics = WorkerDiagnostics(board, settings.local_rank, self._slot) if board else None
        self._faults = FaultInjector.from_env(self._rank)
        events = SaveEvents(lambda: self.elastic_log, self._beats, self._faults)
        self._commits = TrainerCommits(settings, accelerator, self._beats, self.elastic_log, events.bad_checkpoint)
        self._planner = Planner(settings, self._beats)
        self._guard = NonFiniteGuard(settings.on_nan)
        self._coordinator = Coordinator(
            rank=self._rank, world_size=self._world, every_seconds=settings.checkpoint_every_seconds
        )
        self._micro = 0  # micro-batches of the current optimizer step done on this rank
        self._saving_into: Path | None = None
        self._saved_step = 0  # the newest step committed or resumed from
        self._step_loss: Any = 0.0
        self._raw_loss: torch.Tensor | None = None
        self._rescale = False  # Trainer divided this micro-batch's loss by the accumulation: undone until the clip
        self._elastic = ElasticCallback(self._slot, StepBeats(self._beats), self._coordinator, 0)
        self.add_callback(self._elastic)
        self._scale_after_backward()

    # -- resume, batch and start -----------------------------------------------------------------------------------

    def train(  # type: ignore[override]  # trial and ignore_keys_for_eval pass through as keywords
        self, resume_from_checkpoint: str | bool | None = None, **kwargs: Any
    ) -> Any:
        """Trainer's ``train``, resumed from the lineage's newest commit (``resume_from_checkpoint``: None or True;
        a path is taken as given)."""
        self._slot.set_phase(Phase.LOADING)
        checkpoint = None
        if resume_from_checkpoint in (None, True):
            checkpoint = self._commits.resume_point()
            resume_from_checkpoint = str(trainer_folder(checkpoint)) if checkpoint is not None else None
        saved = checkpoint.manifest().get("global_batch_size") if checkpoint is not None else None
        self._saved_step = checkpoint.step if checkpoint is not None else 0
        self._plan(saved)
        self._greet(checkpoint.step if checkpoint is not None else 0)
        self._coordinator.listen()
        try:
            output = super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)
            if self.state.global_step not in (0, self._saved_step):  # the end is committed: a restart trains nothing
                self._save_checkpoint(self.model_wrapped, None)
        finally:
            self._slot.set_phase(Phase.DONE)
            if self._diagnostics is not None:
                self._diagnostics.close()
        return output

    def _plan(self, saved: int | None) -> None:
        args = self.args
        micro = int(args.per_device_train_batch_size)
        wanted = self._global_batch or saved or micro * int(args.gradient_accumulation_steps) * self._world
        if saved is not None and wanted != saved:
            message = (
                f"the run's checkpoints were trained with a global batch of {saved}, this start asks for {wanted};"
                " keep it constant or start a new --run-id"
            )
            self._beats.send(Kind.FATAL, reason=FatalReason.CONFIG, message=message, exit_code=2)
            raise TrainingStopped(f"elasticd: error: {message}")
        plan = self._planner.plan(wanted, micro, self._world, self.elastic_log)
        self._global_batch = plan.global_batch_size
        args.gradient_accumulation_steps = plan.accumulation  # Trainer accumulates itself (accelerate's stays 1)
        self._elastic.samples_per_step = plan.global_batch_size

    def _greet(self, step: int) -> None:
        capabilities = [Capability.CHECKPOINT_REQUEST, *([Capability.STACKS] if self._diagnostics else [])]
        self._beats.send(Kind.HELLO, capabilities=capabilities, pid=os.getpid())
        self._beats.send(Kind.RESUMED, step=step)
        if self.accelerator.is_main_process:
            self.elastic_log.info(
                "trainer_started",
                step=step,
                world_size=self._world,
                global_batch_size=self._global_batch,
                accumulation=self.args.gradient_accumulation_steps,
                mixed_precision=self.accelerator.mixed_precision,
                recovery=RECOVERY,
                why=RECOVERY_WHY,
            )

    # -- data ------------------------------------------------------------------------------------------------------

    def get_train_dataloader(self) -> StepLoader:
        dataset = self.train_dataset
        if dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        assert self._global_batch is not None, "train() plans the batch before Trainer asks for its loader"
        collator = self._get_collator_with_removed_columns(self.data_collator, description="training")
        batches = StepBatches(
            len(dataset),  # type: ignore[arg-type]
            self._global_batch,
            int(self.args.per_device_train_batch_size),
            self._rank,
            self._world,
            seed=self.args.data_seed if self.args.data_seed is not None else self.args.seed,
        )
        left = len(dataset) % self._global_batch  # type: ignore[arg-type]
        if left and self.accelerator.is_main_process:
            self.elastic_log.warning("trainer_batches", untrained_per_epoch=left, global_batch_size=self._global_batch)
        return StepLoader(dataset, batches, collate_fn=collator, num_workers=self.args.dataloader_num_workers)

    def get_resumed_dataloader(self, dataloader: Any, num_batches: int) -> Any:
        if isinstance(dataloader, StepLoader):
            return dataloader.skipping(num_batches)  # this rank's share of the steps trained (steps.py)
        return super().get_resumed_dataloader(dataloader, num_batches)

    def _load_rng_state(self, checkpoint: str | None) -> None:
        """Nothing to restore: every micro-batch seeds the RNG itself (``training_step``); the files of a world of
        another size would not fit anyway."""

    # -- one micro-batch -------------------------------------------------------------------------------------------

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        accumulation = int(self.args.gradient_accumulation_steps)
        step = self.state.global_step + 1
        micro = self._micro * self._world + self._rank  # the micro-batch's index within the step (steps.py)
        set_seed((self.args.seed * 1_000_003 + step * 7919 + micro) % (2**31))
        if self._micro == 0:
            self._faults.before_step(step)
        self._rescale = not self._loss_scaled_for_accumulation(num_items_in_batch)
        loss = super().training_step(model, inputs, num_items_in_batch)
        self._step_loss = loss if self._micro == 0 else self._step_loss + loss
        self._micro = (self._micro + 1) % accumulation
        self._elastic.last_loss = self._step_loss
        return loss

    def compute_loss(
        self, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        computed = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if model.training and self._faults.nan_at(self.state.global_step + 1):  # tests: a non-finite step
            nan = float("nan")
            computed = (computed[0] * nan, *computed[1:]) if isinstance(computed, tuple) else computed * nan
        raw = computed[0] if isinstance(computed, tuple) else computed
        self._raw_loss = raw  # the backward takes it before Trainer divides it
        return computed

    def _loss_scaled_for_accumulation(self, num_items_in_batch: Any) -> bool:
        """Trainer's own test (``training_step``): True when the loss came normalized over the whole accumulation
        (by ``num_items_in_batch``), so Trainer does not divide it by the accumulation and neither is undone here."""
        if self.loss_is_scaled_for_ga is not None:
            return bool(self.loss_is_scaled_for_ga)
        return (self.model_accepts_loss_kwargs and num_items_in_batch is not None) or self.compute_loss_func is not None

    def _scale_after_backward(self) -> None:
        """Backward the loss unscaled, and scale the accumulated fp32 gradients by ``1/accumulation`` once, before
        they are clipped or measured (see the module docstring)."""
        accelerator = self.accelerator
        backward, clip = accelerator.backward, accelerator.clip_grad_norm_

        def unscaled_backward(loss: torch.Tensor, **kwargs: Any) -> None:
            # the loss as the model computed it, not ``loss * accumulation``: that product can be an ulp off, and
            # an ulp moves the bf16 rounding of some gradients (measured: 2e-4 apart after 10 steps)
            raw = self._raw_loss if self._rescale and self._raw_loss is not None else loss
            self._raw_loss = None
            backward(raw, **kwargs)

        def scaled_clip(parameters: Any, max_norm: float, norm_type: float = 2) -> Any:
            parameters = list(parameters)
            if self._rescale and self.current_gradient_accumulation_steps != 1:
                inverse = 1.0 / self.current_gradient_accumulation_steps
                for p in parameters:
                    if p.grad is not None:
                        p.grad.mul_(inverse)
            return clip(parameters, max_norm, norm_type)

        accelerator.backward = unscaled_backward
        accelerator.clip_grad_norm_ = scaled_clip

    # -- steps, saves ----------------------------------------------------------------------------------------------

    def _maybe_log_save_evaluate(self, *args: Any, **kwargs: Any) -> None:
        self._after_step()
        with self._slot.busy():  # an evaluation or a save: the watchdog allows it the start-up timeout
            super()._maybe_log_save_evaluate(*args, **kwargs)

    def _after_step(self) -> None:
        step = self.state.global_step
        verdict = self._guard.verdict(step)
        if verdict in (Verdict.OK, Verdict.OVERFLOW):
            self._faults.after_step(step)
            return
        action = Verdict.SKIPPED.value if verdict is Verdict.SKIPPED else Verdict.STOP.value
        self._beats.send(Kind.NONFINITE, step=step, action=action)
        self.elastic_log.warning("nonfinite_step", step=step, action=action)
        if action == Verdict.STOP.value:
            message = (
                f"stopping: non-finite loss/gradients at step {step} (--on-nan {self.elastic_settings.on_nan}; under"
                " Trainer a rollback is a stop: the daemon does not restart a run that fails the same way)"
            )
            self._beats.send(Kind.FATAL, reason=FatalReason.NAN, message=message, exit_code=1)
            raise TrainingStopped(message)

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        # Trainer creates the scheduler once the optimizer is prepared: the guard wraps that one's step, after the
        # scheduler's own wrapper (which needs a bound method)
        scheduler = super().create_scheduler(num_training_steps, optimizer)
        self._guard.install(self.optimizer, self.model_wrapped.parameters)
        return scheduler

    def _get_output_dir(self, trial: Any) -> str:
        if self._saving_into is not None:
            return str(self._saving_into)
        return super()._get_output_dir(trial)

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """Trainer's save, into this writer's partial directory, then the commit (``commits.py``)."""
        started = time.monotonic()
        step = self.state.global_step
        self._slot.set_phase(Phase.CHECKPOINT)
        partial = self._commits.begin(step)
        with self._into(partial):
            super()._save_checkpoint(model, trial)
        self._faults.during_checkpoint(step)  # every rank's files are written, nothing is committed
        meta = {
            "global_batch_size": self._global_batch,
            "world_size": self._world,
            "trainer_folder": f"checkpoint-{step}",
        }
        committed = self._commits.commit(step, meta, started)
        self._saved_step = step
        self._coordinator.checkpointed()
        self._slot.set_phase(Phase.TRAINING)
        if self._elastic.requested:
            self._elastic.requested = False
            self._beats.send(Kind.CHECKPOINT_SAVED, step=step, requested=True, committed=committed is not None)
            park(self._slot, self.elastic_log, step)

    @contextlib.contextmanager
    def _into(self, partial: Path) -> Iterator[None]:
        self._saving_into = partial
        try:
            yield
        finally:
            self._saving_into = None
