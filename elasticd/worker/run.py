"""``elasticd.attach(accelerator)`` and the :class:`Run` it returns: resume, data, steps, checkpoints, NaN guard.

The training loop of DESIGN.md §2::

    run = elasticd.attach(accelerator)
    loader = run.dataloader(dataset, global_batch_size=256, micro_batch_size=32, shuffle=True, seed=0)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    run.resume(model, optimizer, scheduler)
    for batch in run.batches(loader, epochs=3):
        with accelerator.accumulate(model):
            loss = loss_fn(model(batch["x"]), batch["y"])
            accelerator.backward(loss)
            optimizer.step(); scheduler.step(); optimizer.zero_grad()
        run.step(loss)

A :class:`Run` owns the :class:`~elasticd.worker.state.TrainingState`; ``run.step`` is the single place where an
optimizer step is accounted for: data position, guard verdict, beats, checkpoint decisions, faults.
"""

from __future__ import annotations

import contextlib
import os
import random
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import numpy as np
import structlog
import torch

from elasticd.board import NullSlotWriter, Phase, SlotWriter
from elasticd.layout import slot_path
from elasticd.logging import configure_logging, get_logger
from elasticd.messages import Capability, FatalReason, Kind
from elasticd.privates.check import check_worker
from elasticd.privates.surface import Fallback
from elasticd.worker import hybrid, resume_point
from elasticd.worker.batch_tensors import poison, to_device
from elasticd.worker.batching import BatchPlan
from elasticd.worker.beats import BeatClient
from elasticd.worker.checkpoints import Checkpoint, CheckpointStore
from elasticd.worker.coordination import Coordinator, park
from elasticd.worker.diagnostics import WorkerDiagnostics
from elasticd.worker.faults import FaultInjector
from elasticd.worker.fence import EtcdFence
from elasticd.worker.guard import NonFiniteGuard, Verdict
from elasticd.worker.hot_path import HotPath
from elasticd.worker.own_time import OwnTime
from elasticd.worker.planning import Planner, TrainingStopped
from elasticd.worker.sampler import ElasticSampler, StepSlice, micro_batch_loader
from elasticd.worker.save_events import SaveEvents
from elasticd.worker.saver import CheckpointFailedError, CheckpointSaver
from elasticd.worker.settings import WorkerSettings
from elasticd.worker.state import TrainingState
from elasticd.worker.step_beats import StepBeats


@dataclass(frozen=True, slots=True)
class ElasticLoader:
    """What :meth:`Run.dataloader` returns; iterate it through :meth:`Run.batches`, never ``accelerator.prepare``."""

    dataset: Any
    plan: BatchPlan
    sampler: ElasticSampler
    collate_fn: Any = None
    num_workers: int = 0

    def for_plan(self, plan: BatchPlan, rank: int) -> ElasticLoader:
        """The same loader (dataset, order, position rule) planned for another world, as ``rank`` of it."""
        old = self.sampler
        sampler = ElasticSampler(
            old.dataset_len, plan, rank, shuffle=old.shuffle, seed=old.seed, drop_last=old.drop_last
        )
        return replace(self, plan=plan, sampler=sampler)


class Run:
    """One worker's view of an elastic run (see the module docstring for the loop)."""

    def __init__(self, accelerator: Any, settings: WorkerSettings | None = None) -> None:
        self.accelerator = accelerator
        self.settings = settings or WorkerSettings.from_env()
        self.rank = int(accelerator.process_index)
        self.world_size = int(accelerator.num_processes)
        self.state = TrainingState()
        s = self.settings
        self.store = CheckpointStore(s.checkpoint_dir, s.run_id, keep=s.keep_checkpoints, token=s.fence_token)
        self.beats = BeatClient.from_env()
        board = s.board  # where this rank is now, for the daemon's hang watchdog; stacks, flight recorder on request
        self.slot = SlotWriter(slot_path(board, s.local_rank)) if board else NullSlotWriter()
        self.diagnostics = WorkerDiagnostics(board, s.local_rank, self.slot) if board else None
        self.faults = FaultInjector.from_env(self.rank)
        self.guard = NonFiniteGuard(self.settings.on_nan)
        self.planner = Planner(self.settings, self.beats)
        self.coordinator = Coordinator(
            rank=self.rank,
            world_size=self.world_size,
            every_steps=self.settings.checkpoint_every_steps,
            every_seconds=self.settings.checkpoint_every_seconds,
        )
        # under a daemon: commits are recorded in the run's lineage, and only what it records is ever loaded
        self.fence = EtcdFence(s.etcd_connect_args, s.run_id) if s.etcd and s.fence_token else None
        self.save_events = SaveEvents(lambda: self.log, self.beats, self.faults)
        self.saver = CheckpointSaver(
            accelerator,
            self.store,
            fence=self.fence,
            on_event=self.save_events,
            sweep=lambda: resume_point.sweep_lost_writers(self.store, self.fence, self.log),
        )
        if not structlog.is_configured():
            configure_logging(stdlib=False)
        self.log = get_logger(rank=self.rank, run_id=self.settings.run_id)
        self.hybrid = hybrid.take_sharded_path(accelerator, self.log)  # before prepare(): FSDP on gloo, HSDP
        self.plan: BatchPlan | None = None
        self._seed = 0
        self._micro = 0
        self._slice: StepSlice | None = None
        self._bad: list[tuple[int, int]] = []  # (epoch, position) of the current run of skipped steps
        self._generation = 0  # bumped by a rollback: batches() restarts from the rolled-back position
        self._step_started = time.perf_counter()
        self._loss: Any = None
        self.step_beats = StepBeats(self.beats)
        self.own_time = OwnTime()
        self.hot: HotPath | None = None  # in place (--recovery hot): armed by resume(); None: cold restarts
        self._loaders: list[ElasticLoader] = []  # every loader made by dataloader(), by identity
        self._replanned: dict[int, ElasticLoader] = {}  # id(original) -> the same loader planned for the new world
        # (a joiner does not: the group it joins may be writing a checkpoint right now)
        if self.accelerator.is_main_process and self.settings.join_round is None:
            resume_point.remove_partials(self.store, self.fence)
        self.accelerator.wait_for_everyone()

    # -- setup ---------------------------------------------------------------------------------------------------

    def dataloader(
        self,
        dataset: Any,
        *,
        global_batch_size: int,
        micro_batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        collate_fn: Any = None,
        num_workers: int = 0,
    ) -> ElasticLoader:
        """A loader whose global batch stays ``global_batch_size`` at any world size (accumulation adapts)."""
        plan = self.planner.plan(global_batch_size, micro_batch_size, self.world_size, self.log)
        self.plan = plan
        self._seed = seed
        self.accelerator.gradient_accumulation_steps = plan.accumulation
        sampler = ElasticSampler(len(dataset), plan, self.rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
        loader = ElasticLoader(dataset, plan, sampler, collate_fn, num_workers)
        self._loaders.append(loader)
        return loader

    def resume(self, model: Any, optimizer: Any, scheduler: Any = None) -> TrainingState:
        """Load the newest committed checkpoint that verifies (a no-op on a fresh run) and arm the guard."""
        self.guard.install(optimizer, model.parameters)
        self.own_time.time_forward(model)
        if scheduler is not None:
            # once per optimizer step whatever the world size (accelerate would step it W times)
            scheduler.split_batches = True
        self.slot.set_phase(Phase.LOADING)
        # a joiner takes its state from a live peer when it is admitted (in HotPath.arm), not from disk
        checkpoint = self._resume_point(self.world_size) if self.settings.join_round is None else None
        if checkpoint is not None:
            self._load(checkpoint)
            self.log.info("resumed", step=self.state.step, epoch=self.state.data.epoch, path=str(checkpoint.path))
        reseed(self._seed, self.state.step, self.rank)
        hybrid.install_replicas(self.hybrid, model)  # the hot path's waits replace it when armed
        self.hot = HotPath.arm(self, model, optimizer, scheduler)
        self.coordinator.listen()
        _greet_daemon(self)
        self.slot.resumed(self.state.step)
        self._step_started = time.perf_counter()
        return self.state

    def _resume_point(self, world: int) -> Checkpoint | None:
        """The checkpoint every rank loads (a collective call; ``resume_point.py``), for ``world`` ranks."""
        return resume_point.choose(
            self.accelerator, self.store, self.fence, world, self.log, self.save_events.bad_checkpoint
        )

    def reload(self) -> TrainingState | None:
        """In place, a sharded job whose state no member holds: every rank of the re-formed group loads the newest
        committed checkpoint (None: none). ``state`` stays the step reached: regrouped() counts steps redone."""
        self.saver.regroup()  # a write of the old group in flight stays the old group's
        checkpoint = self._resume_point(int(self.accelerator.num_processes))  # the re-formation told accelerate
        if checkpoint is None:
            return None
        reached, loaded = self.state, self._load(checkpoint)
        self.state = reached
        self.log.info("reloaded_in_place", step=loaded.step, path=str(checkpoint.path))
        return loaded

    def _load(self, checkpoint: Checkpoint) -> TrainingState:
        manifest = self.saver.load(checkpoint)
        saved_batch = manifest.get("global_batch_size")
        if self.plan is not None and saved_batch not in (None, self.plan.global_batch_size):
            raise TrainingStopped(
                f"checkpoint {checkpoint.path} was trained with global batch {saved_batch}, this run asks for"
                f" {self.plan.global_batch_size}; keep it constant or start a new --run-id"
            )
        self.state = TrainingState.from_meta(manifest)
        # accelerate's own step counter (gradient accumulation) differs per rank after load_state: reset it
        self.accelerator.step = 0
        self._micro = 0
        return self.state

    # -- the loop ------------------------------------------------------------------------------------------------

    def batches(self, loader: ElasticLoader, epochs: int = 1) -> Iterator[Any]:
        """This rank's micro-batches from the saved position until ``epochs`` epochs are done, exactly once each."""
        original = loader
        while True:
            generation = self._generation
            loader = self._replanned.get(id(original), original)  # a recovery in place re-planned it
            accumulation = loader.plan.accumulation
            slices: deque[StepSlice] = deque()

            def micro_stream(slices: deque[StepSlice] = slices, loader: ElasticLoader = loader) -> Iterator[Any]:
                data, skipped = self.state.data, self.state.skipped_steps
                for step_slice in loader.sampler.steps(data, epochs, skipped, on_skip=partial(_log_skipped, self)):
                    slices.append(step_slice)
                    yield from step_slice.micro_batches

            stream = iter(micro_batch_loader(loader.dataset, micro_stream(), loader.collate_fn, loader.num_workers))
            index = 0
            while True:
                # everything from here to the yield is this rank's own time (data wait, faults, host-to-device)
                started = time.perf_counter()
                batch = next(stream, _END)
                if batch is _END:
                    break
                if index % accumulation == 0:
                    self._slice = slices.popleft()
                    self.faults.before_step(self.state.step + 1, self.accelerator.device)
                    self.slot.enter(self.state.step + 1)
                if self.faults.poisoned(self.state.step + 1, self._slice, index % accumulation):
                    batch = _poisoned(self, batch)
                batch = to_device(batch, self.accelerator.device)
                self.own_time.add(time.perf_counter() - started)
                index += 1
                yield batch
                if self._generation != generation:
                    break
            if self._generation == generation:
                _say_if_finished_before(self, epochs, trained=index > 0 or original is not loader)
                self.slot.set_phase(Phase.DONE)
                self.saver.wait(everyone=True)
                return

    def step(self, loss: Any = None) -> bool:
        """Account for one micro-batch; after the last of an optimizer step, everything an optimizer step implies.

        True when an optimizer step was completed and counted (``run.state.step`` moved on); False while micro-batches
        accumulate, and for a step that failed (re-formed in place: discarded, its samples come again; or, when a
        member had completed it, healed forward to that member's state, so ``run.state.step`` moves on unreported).
        """
        self._micro += 1
        self._loss = loss
        if self.plan is not None and self._micro < self.plan.accumulation:
            return False
        self._micro = 0
        assert self._slice is not None, "run.step() called outside run.batches()"
        if self.hot is not None and self.hot.recovered_from_failure():
            return False  # discarded on every rank; batches() goes on from the same sample at the new size
        now = time.perf_counter()
        step_time_s, self._step_started = now - self._step_started, now
        step_slice = self._slice
        self.state = self.state.advanced(step_slice.next_position())
        step = self.state.step
        verdict = self.guard.verdict(step)
        own_s = self.own_time.take()
        self.slot.completed(step, step_time_s, own_s)
        samples = sum(sum(m.valid) for m in step_slice.micro_batches)
        self.step_beats.completed(
            step,
            now=now,
            samples=samples,
            step_time_s=step_time_s,
            own_s=own_s,
            loss=self._loss,
            urgent=verdict is not Verdict.OK,
        )
        if verdict is Verdict.OK:
            self._bad.clear()
        elif verdict is not Verdict.OVERFLOW:
            self._nonfinite(verdict, step_slice)
        self.faults.after_step(step)
        if self.hot is not None:
            self.hot.stepped()
        outcome = self.coordinator.at_step(step, step_time_s)
        if outcome.checkpoint:
            self.save(planned=outcome.requested)
        if outcome.requested:
            park(self.slot, self.log, step)
        if outcome.admit and self.hot is not None:
            self.hot.admit()  # joiners come in at this boundary, on every rank alike
        self._step_started = time.perf_counter()
        return True

    @property
    def epoch(self) -> int:
        """The membership epoch this worker trains in (0 before any recovery in place, and without one)."""
        return self.hot.session.epoch if self.hot is not None else 0

    def plan_for(self, world_size: int) -> BatchPlan | None:
        """The batch plan of the current loaders for ``world_size`` workers (same global batch); None without one."""
        if self.plan is None:
            return None
        return self.planner.plan_for(self.plan.global_batch_size, self.plan.micro_batch_size, world_size)

    def regrouped(
        self,
        rank: int,
        world_size: int,
        state: TrainingState,
        plan: BatchPlan | None,
        token: str,
        *,
        planned: bool = False,
    ) -> None:
        """After a recovery in place: train as ``rank`` of ``world_size`` from ``state`` (the healed one).

        ``planned``: a join at an agreed step boundary (no failure)."""
        self.rank, self.world_size, self.state = rank, world_size, state
        self.beats.rank = rank  # the daemon names this worker by its rank in the group (hang diagnoses, reports)
        if plan is not None:
            self.plan = plan
            self._replanned = {id(loader): loader.for_plan(plan, rank) for loader in self._loaders}
        self.coordinator.regroup(rank, world_size, planned=planned)
        self.saver.regroup()  # a background write in flight stays the old group's (saver.py)
        self.store.adopt_token(token)
        self._micro = 0
        self.accelerator.step = 0
        self.log = get_logger(rank=rank, run_id=self.settings.run_id)
        reseed(self._seed, self.state.step, self.rank)
        self._generation += 1  # batches() restarts from the healed position with the new plan
        self.slot.resumed(self.state.step)
        self._step_started = time.perf_counter()

    def _nonfinite(self, verdict: Verdict, step_slice: StepSlice) -> None:
        self._bad.append((step_slice.epoch, step_slice.position))
        self.state = replace(
            self.state,
            nonfinite_steps=self.state.nonfinite_steps + 1,
            skipped_steps=self.state.skipped_steps | {(step_slice.epoch, step_slice.position)},
        )
        self.beats.send(Kind.NONFINITE, step=self.state.step, action=verdict.value)
        self.log.warning("nonfinite_step", step=self.state.step, action=verdict.value)
        if verdict is Verdict.ROLLBACK:
            self._rollback()
        elif verdict is Verdict.STOP:
            message = (
                f"stopping: non-finite loss/gradients at step {self.state.step} "
                f"({self.state.nonfinite_steps} non-finite steps, {self.state.rollbacks} rollbacks; --on-nan "
                f"{self.settings.on_nan})"
            )
            self.beats.send(Kind.FATAL, reason=FatalReason.NAN, message=message, exit_code=1)
            self.saver.wait()
            raise TrainingStopped(message)

    def _rollback(self) -> None:
        """Every rank reloads the last checkpoint and will step over the batches that went non-finite."""
        bad = set(self._bad)
        self._bad.clear()
        self.slot.set_phase(Phase.LOADING)
        self.saver.wait(everyone=True)  # the last save is decided before rank 0 chooses what to load
        checkpoint = self._resume_point(self.world_size)
        keep = replace(self.state, skipped_steps=self.state.skipped_steps | bad, rollbacks=self.state.rollbacks + 1)
        if checkpoint is not None:
            self._load(checkpoint)
            self.state = replace(
                self.state,
                skipped_steps=self.state.skipped_steps | keep.skipped_steps,
                nonfinite_steps=keep.nonfinite_steps,
                rollbacks=keep.rollbacks,
            )
            reseed(self._seed, self.state.step, self.rank)
        else:
            self.state = keep  # nothing to roll back to: the bad batches are already behind us
        self._generation += 1
        self.slot.resumed(self.state.step)
        self.log.warning("rolled_back", to_step=self.state.step, skipped=sorted(bad))

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """Wrap the script's own long work between steps (an evaluation, a custom export) in ``with run.busy():``.

        The hang watchdog then allows it ``--startup-timeout`` instead of the step timeout, which it would
        otherwise take for a hang (``--hang-timeout auto`` is a few step times). Without a daemon it does nothing.
        """
        with self.slot.busy():
            yield

    # -- checkpoints ---------------------------------------------------------------------------------------------

    def save(self, *, planned: bool = False) -> None:
        """Checkpoint now; every rank must call it at the same step. A planned save (for a restart) is synchronous."""
        meta = {
            **self.state.to_meta(),
            "global_batch_size": self.plan.global_batch_size if self.plan else None,
            "world_size": self.world_size,
            "round": self.settings.round,
        }
        self.slot.set_phase(Phase.CHECKPOINT)
        try:
            committed = self.saver.save(self.state.step, meta, asynchronous=self.settings.asynchronous and not planned)
        except CheckpointFailedError:
            committed = False  # reported as checkpoint_failed; training goes on, the next save tries again
        self.slot.set_phase(Phase.TRAINING)
        self.coordinator.checkpointed()
        if planned:
            # the daemon waits for this before a planned change; a refused or failed commit: the steps since are redone
            self.beats.send(Kind.CHECKPOINT_SAVED, step=self.state.step, requested=True, committed=bool(committed))

    def close(self) -> None:
        """Finish the background checkpoint write; call on every rank before exit."""
        self.slot.set_phase(Phase.DONE)
        self.saver.wait(everyone=True)
        if self.diagnostics is not None:
            self.diagnostics.close()
        if self.hot is not None:
            self.hot.close()


_END = object()


def attach(accelerator: Any, settings: WorkerSettings | None = None) -> Run:
    """Join the elastic run this process belongs to (or act locally when no daemon started it).

    Raises :class:`~elasticd.privates.check.SurfacesMoved` when a private torch/accelerate name the worker cannot do
    without moved; saves block when the ones asynchronous saves copy from moved (``elasticd/privates/``)."""
    run = Run(accelerator, settings)
    if Fallback.BLOCKING_SAVES in check_worker(run.log):
        run.settings = replace(run.settings, asynchronous=False)
    return run


def reseed(seed: int, step: int, rank: int) -> None:
    """RNG streams derived from (seed, step, rank): the same for a rank whatever the world size history."""
    derived = (seed * 1_000_003 + step * 7919 + rank) % (2**31)
    random.seed(derived)
    np.random.seed(derived)
    torch.manual_seed(derived)


def _greet_daemon(run: Run) -> None:
    """Once resumed: only now may the daemon send SIGUSR2 (its default action would kill this process), and SIGUSR1
    for stacks; the capabilities say which it may."""
    capabilities = [
        Capability.CHECKPOINT_REQUEST,
        *([Capability.STACKS] if run.diagnostics else []),
        *([Capability.IN_PLACE] if run.hot is not None else []),
    ]
    run.beats.send(Kind.HELLO, capabilities=capabilities, pid=os.getpid())
    run.beats.send(Kind.RESUMED, step=run.state.step)


def _poisoned(run: Run, batch: Any) -> Any:
    """``batch`` made NaN by its fault; one without floating tensors (token ids alone) stays as it is: said once."""
    if run.faults.first_unpoisonable(batch):
        reason = "the batch holds no floating-point tensor to make NaN (token ids?): the fault changes nothing"
        run.log.warning("fault_not_applied", fault="nan", step=run.state.step + 1, reason=reason)
    return poison(batch)


def _log_skipped(run: Run, step_slice: StepSlice) -> None:
    run.log.info("batch_skipped", epoch=step_slice.epoch, position=step_slice.position)


def _say_if_finished_before(run: Run, epochs: int, *, trained: bool) -> None:
    """A run started again after it had finished (the newest commit is its last step) trains nothing: say so, with
    how to start a new one, instead of exiting in silence (rank 0)."""
    if trained or run.state.step == 0 or not run.accelerator.is_main_process:
        return
    s = run.settings
    run.log.warning(
        "run_already_finished",
        step=run.state.step,
        epochs=epochs,
        message=f"run {s.run_id!r} finished before this start (step {run.state.step}, {epochs} epochs): nothing left to"
        f" train; to train again, start with another --run-id, or remove {s.checkpoint_dir / s.run_id}",
    )
