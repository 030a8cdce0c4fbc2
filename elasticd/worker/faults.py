"""Deterministic fault injection for tests (a testing aid, documented in docs/testing.md; never set it in production).

``ELASTICD_FAULT`` holds ``;``-separated faults, each ``KIND@key=value,...``::

    nan@step=40,rank=1            the loss of rank 1 at step 40 becomes NaN (once)
    nan@step=40-                  every rank, every step from 40 on (persistent NaN)
    nan@samples=17+203+411,epoch=1  every micro-batch that holds sample 17, 203 or 411 (dataset indices) becomes NaN,
                                  in epoch 1 only (without epoch=: in every epoch): bad data, wherever it lands
    kill@step=30,rank=0           rank 0 kills itself with SIGKILL when step 30 completes
    kill@checkpoint=20,rank=0     rank 0 kills itself while writing the checkpoint of step 20
    kill@heal=1,rank=0            rank 0 kills itself in its first heal in place (counted from its start), as it is
                                  about to send its first piece of the state: a sender dying mid-heal
    fail@heal=1,rank=0            rank 0's first heal in place raises there instead (a heal that breaks on a member
                                  that lives on: its peers are released by the epoch's failure notice)
    freeze@commit=20,rank=0       rank 0 stops its daemon and itself (SIGSTOP) with the checkpoint of step 20 durable,
                                  just before asking the fence to commit it (a node frozen mid-commit: a stale writer)
    sleep@step=12,rank=1          rank 1 stops forever before step 12 (a hang inside the next collective)
    slow@rank=1,seconds=0.2       rank 1 sleeps 0.2 s every step (a straggler)
    jitter@seconds=0.1            every rank sleeps a random 0-0.1 s every step (seeded by rank and step)
    device_error@step=8,rank=1    rank 1 indexes out of bounds on its device before step 8: on a GPU a real CUDA error
                                  (a device-side assert, which leaves the process's CUDA context unusable), on the
                                  CPU the same operation's IndexError (bench/gpu_check.py: the fallback from it)

``round=N`` limits a fault to the workers of rendezvous round N (``ELASTICD_ROUND``), so a fault does not repeat after
the restart it causes; ``restart=N`` does the same with torchrun's ``TORCHELASTIC_RESTART_COUNT``.
Faults come from the environment so that tests inject them into real worker processes (after torchft's
``fail_at(rank, step)``).
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from elasticd import envvars
from elasticd.worker.batch_tensors import has_floating
from elasticd.worker.sampler import StepSlice


class InjectedFault(RuntimeError):
    """A failure a test asked for (``fail@``)."""


@dataclass(frozen=True, slots=True)
class Fault:
    kind: str
    first_step: int | None = None
    last_step: int | None = None  # None with first_step set: only that step; -1: open-ended
    checkpoint: int | None = None
    rank: int | None = None
    round: int | None = None
    restart: int | None = None
    seconds: float = 0.0
    samples: frozenset[int] = frozenset()  # dataset indices (nan@samples=): the fault follows the data, not the step
    epoch: int | None = None
    extra: dict[str, str] = field(default_factory=dict)

    def covers(self, step: int) -> bool:
        if self.first_step is None:
            return True
        if self.last_step == -1:
            return step >= self.first_step
        return step == self.first_step


class FaultInjector:
    """The faults that apply to this process (rank, round and restart already matched)."""

    def __init__(self, faults: list[Fault], rank: int) -> None:
        self.rank = rank
        self.faults = faults
        # checked for every micro-batch, so a run without them pays one truth test
        self.poisons_samples = any(f.kind == "nan" and f.samples for f in faults)
        self._told_unpoisonable = False

    @classmethod
    def from_env(cls, rank: int) -> FaultInjector:
        text = os.environ.get(envvars.FAULT, "")
        round_ = int(os.environ.get(envvars.ROUND, "-1"))
        restart = int(os.environ.get(envvars.TORCHELASTIC_RESTART_COUNT, "-1"))
        mine = [
            f
            for f in parse_faults(text)
            if (f.rank is None or f.rank == rank)
            and (f.round is None or f.round == round_)
            and (f.restart is None or f.restart == restart)
        ]
        return cls(mine, rank)

    def _of(self, kind: str) -> list[Fault]:
        return [f for f in self.faults if f.kind == kind]

    def nan_at(self, step: int) -> bool:
        return any(f.covers(step) for f in self._of("nan") if not f.samples)

    def poisoned(self, step: int, step_slice: StepSlice | None, micro_index: int) -> bool:
        """Is this micro-batch of ``step`` to become NaN (by step, or because it holds a poisoned sample)?"""
        if self.nan_at(step):
            return True
        if step_slice is None or not self.poisons_samples:
            return False
        micro = step_slice.micro_batches[micro_index]
        real = [i for i, valid in zip(micro.indices, micro.valid, strict=True) if valid]
        return self.nan_samples(step_slice.epoch, real)

    def nan_samples(self, epoch: int, indices: Iterable[int]) -> bool:
        """True when a micro-batch of ``epoch`` holding these (real, not padding) dataset indices is to be poisoned."""
        poisoned = [f.samples for f in self._of("nan") if f.samples and f.epoch in (None, epoch)]
        return bool(poisoned) and any(i in s for i in indices for s in poisoned)

    def first_unpoisonable(self, batch: object) -> bool:
        """True the first time a batch to be poisoned holds nothing ``poison`` can make NaN (token ids alone):
        the fault then changes nothing, which the worker says once."""
        if self._told_unpoisonable or has_floating(batch):
            return False
        self._told_unpoisonable = True
        return True

    def before_step(self, step: int, device: torch.device | None = None) -> None:
        """Called before the micro-batches of ``step`` (trained on ``device``): hangs, stragglers, device errors."""
        if device is not None and any(f.covers(step) for f in self._of("device_error")):
            device_error(device)
        for f in self._of("sleep"):
            if f.covers(step):
                while True:  # a rank that stops making progress; the watchdog must find it
                    time.sleep(3600)
        for f in self._of("slow"):
            if f.covers(step):
                time.sleep(f.seconds)
        for f in self._of("jitter"):
            if f.covers(step):
                time.sleep(random.Random(self.rank * 1_000_003 + step).uniform(0, f.seconds))

    def after_step(self, step: int) -> None:
        if any(f.covers(step) for f in self._of("kill") if f.checkpoint is None and "heal" not in f.extra):
            os.kill(os.getpid(), signal.SIGKILL)

    def before_heal_piece(self, heal: int) -> None:
        """Called before this member sends a piece of the state in its ``heal``-th heal (1 = the first)."""
        if any(f.extra.get("heal") == str(heal) for f in self._of("kill")):
            os.kill(os.getpid(), signal.SIGKILL)
        if any(f.extra.get("heal") == str(heal) for f in self._of("fail")):
            raise InjectedFault(f"fail@heal={heal}: this member's heal breaks here")

    def during_checkpoint(self, step: int) -> None:
        if any(f.checkpoint == step for f in self._of("kill")):
            os.kill(os.getpid(), signal.SIGKILL)

    def before_commit(self, step: int) -> None:
        if any(f.extra.get("commit") == str(step) for f in self._of("freeze")):
            # the whole node: its daemon too, so nobody reports for it (a warm-started worker's parent is the
            # daemon's warm server, not the daemon: the daemon's pid is in the environment; torchrun sets none)
            daemon = int(os.environ.get(envvars.DAEMON_PID) or 0) or os.getppid()
            os.kill(daemon, signal.SIGSTOP)
            # Stop this very thread (the checkpoint writer) before it returns: a SIGSTOP sent to the process goes to
            # its main thread first, and a writer that runs on while the main thread waits for a core reaches the
            # fence and commits (seen under load: the "stale" step-20 record of tests/integration/test_lineage.py).
            signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)


def device_error(device: torch.device) -> None:
    """An out-of-bounds index on ``device``, as a buggy kernel makes one: CUDA's index kernel traps (a device-side
    assert, raised at the synchronisation as ``torch.AcceleratorError``; the context is unusable from then on), the
    CPU's raises ``IndexError`` at once."""
    probe = torch.zeros(1, device=device)
    probe[torch.tensor([1], device=device)] += 1.0
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def parse_faults(text: str) -> list[Fault]:
    faults = []
    for item in filter(None, (part.strip() for part in text.split(";"))):
        kind, _, spec = item.partition("@")
        values = dict(kv.split("=", 1) for kv in filter(None, spec.split(",")) if "=" in kv)
        first = last = None
        if "step" in values:
            raw = values.pop("step")
            if raw.endswith("-"):
                first, last = int(raw[:-1]), -1
            else:
                first = int(raw)
        faults.append(
            Fault(
                kind=kind.strip(),
                first_step=first,
                last_step=last,
                checkpoint=int(values.pop("checkpoint")) if "checkpoint" in values else None,
                rank=int(values.pop("rank")) if "rank" in values else None,
                round=int(values.pop("round")) if "round" in values else None,
                restart=int(values.pop("restart")) if "restart" in values else None,
                seconds=float(values.pop("seconds", "0")),
                samples=frozenset(int(i) for i in values.pop("samples", "").split("+") if i),
                epoch=int(values.pop("epoch")) if "epoch" in values else None,
                extra=values,
            )
        )
    return faults
