"""The progress watchdog: a hang is a local worker that made no progress within its phase's allowance.

Progress is read from the board (``elasticd/board.py``): a completed step, or a phase change. Each phase has its own
allowance, because a 100 ms step and a 3-minute checkpoint load must not share one timeout:

- ``TRAINING`` after the first step of the process: the **hang timeout**, fixed (``--hang-timeout S``) or learned
  (``auto``: after :data:`AUTO_WARMUP_STEPS` steps, ``clamp(max(AUTO_FACTOR * p99 of the last AUTO_WINDOW step
  times, LONGEST_FACTOR * the longest step seen), AUTO_FLOOR_S, AUTO_CAP_S)``; until then the start-up allowance);
- start-up (process start to the first completed step, which includes imports, the process group, the checkpoint
  load and the first step's one-off work), checkpoint saves and loads, the script's own long work between steps
  (``with run.busy():``, an evaluation say) and the final waits: the **start-up allowance** (``--startup-timeout``);
- ``PARKED`` (the worker waits for us after a checkpoint we asked for): never a hang;
- ``EXITING`` (an exception escaped the script; the process tears down, which can take seconds): the **exit
  allowance**, :data:`EXIT_ALLOWANCE_S`. A failure on its way is torch's monitor's to report, not a hang;
- a worker whose process has exited (a zombie the agent has not reaped yet, or gone): never a hang, whatever its
  slot says. Its exit is a failure that torch's monitor reports at its next poll (restart reason ``failure``);
- a worker that has not attached (``elasticd.attach``), or a script that does not use the library: not watched.

Step times come from the workers (checkpoint saves excluded), so a run that checkpoints does not teach the watchdog
that a step may take as long as a save. :meth:`Watchdog.check` is pure apart from reading slots; tests drive it with
a fake clock and hand-written slots.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from elasticd.agent.evidence import process_exited
from elasticd.board import Phase, Slot

AUTO_WARMUP_STEPS = 5
AUTO_WINDOW = 100
# k * p99: a step k times the slowest of the last hundred is not a slow step any more.
AUTO_FACTOR = 5.0
# A slow step that recurs rarely (logging or a sync every few hundred steps) drops out of the window; twice the
# longest step ever seen keeps the timeout above it once it has been seen.
LONGEST_FACTOR = 2.0
# Seconds. The floor keeps a burst of fast steps from making a 100 ms hiccup a hang; the cap keeps auto below the
# NCCL heartbeat timeout elasticd sets (docs/architecture.md, "timeout hierarchy").
AUTO_FLOOR_S = 0.5
AUTO_CAP_S = 300.0
# Seconds a worker that is exiting (an uncaught exception) may take to be gone: interpreter teardown and the process
# group's destructor take 1-3 s on a busy machine. One that is still there after this is stuck in its exit.
EXIT_ALLOWANCE_S = 30.0


# Phases judged by the start-up allowance: one-off work whose length has nothing to do with a step's.
_STARTUP_PHASES = (Phase.STARTING, Phase.LOADING, Phase.CHECKPOINT, Phase.DONE, Phase.BUSY)


class AutoTimeout:
    """Learns the hang timeout from step times; ``value`` is None until warmed up."""

    def __init__(
        self,
        *,
        factor: float = AUTO_FACTOR,
        floor_s: float = AUTO_FLOOR_S,
        cap_s: float = AUTO_CAP_S,
        warmup: int = AUTO_WARMUP_STEPS,
        window: int = AUTO_WINDOW,
    ) -> None:
        self.factor, self.floor_s, self.cap_s, self.warmup = factor, floor_s, cap_s, warmup
        self._samples: deque[float] = deque(maxlen=window)
        self.longest_s = 0.0

    def observe(self, step_s: float) -> None:
        if step_s > 0 and math.isfinite(step_s):
            self._samples.append(step_s)
            self.longest_s = max(self.longest_s, step_s)

    @property
    def p99(self) -> float | None:
        if not self._samples:
            return None
        ordered = sorted(self._samples)
        return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]

    @property
    def value(self) -> float | None:
        p99 = self.p99
        if p99 is None or len(self._samples) < self.warmup:
            return None
        return min(self.cap_s, max(self.floor_s, self.factor * p99, LONGEST_FACTOR * self.longest_s))


@dataclass(frozen=True, slots=True)
class Suspicion:
    """Local ranks silent beyond their allowance."""

    local_ranks: tuple[int, ...]
    silent_s: float  # the longest silence among them
    allowance_s: float
    step: int  # the step that did not complete: the furthest any local rank entered


class Watchdog:
    """Reads one slot per local rank and says whether any of them hangs."""

    def __init__(
        self,
        read: Callable[[int], Slot | None],
        *,
        timeout_s: float | None,
        startup_s: float,
        auto: AutoTimeout | None = None,
        exited: Callable[[int], bool] = process_exited,
    ) -> None:
        self._read = read
        self._exited = exited
        self.fixed_s = timeout_s
        self.startup_s = startup_s
        self.auto = auto or AutoTimeout()
        self._started_at = 0.0
        self._seen_step: dict[int, int] = {}
        self._local_ranks: tuple[int, ...] = ()
        self._excused_until = 0.0

    def reset(self, local_ranks: tuple[int, ...], started_at: float) -> None:
        """A new worker generation started at ``started_at`` (monotonic); learned step times are kept."""
        self._local_ranks = local_ranks
        self._started_at = started_at
        self._seen_step.clear()

    def excuse(self, until: float) -> None:
        """No suspicion before ``until`` (monotonic): the workers wait for a hung peer elsewhere to be killed, then
        re-form in place (their failed step moves them to a phase with the startup allowance)."""
        self._excused_until = until

    @property
    def timeout_s(self) -> float | None:
        """The training-phase timeout in force (None: auto, not yet warmed up)."""
        return self.fixed_s if self.fixed_s is not None else self.auto.value

    def slots(self) -> dict[int, Slot | None]:
        return {rank: self._read(rank) for rank in self._local_ranks}

    def check(self, now: float, slots: Mapping[int, Slot | None] | None = None) -> Suspicion | None:
        slots = self.slots() if slots is None else slots
        if now < self._excused_until:
            for rank, slot in slots.items():
                self._learn(rank, slot)
            return None
        hung: list[tuple[int, float, float]] = []
        entered = 0
        for rank, slot in slots.items():
            self._learn(rank, slot)
            allowance = self.allowance(slot)
            if allowance is None or slot is None:
                continue
            silent = now - slot.progress_t
            entered = max(entered, slot.entered_step)
            # an exited process is a failure for torch's monitor (asked only of the silent: one read of /proc)
            if silent > allowance and not self._exited(slot.pid):
                hung.append((rank, silent, allowance))
        if not hung:
            return None
        return Suspicion(
            local_ranks=tuple(r for r, _, _ in hung),
            silent_s=max(s for _, s, _ in hung),
            allowance_s=min(a for _, _, a in hung),
            step=entered,
        )

    def _learn(self, rank: int, slot: Slot | None) -> None:
        if slot is None or slot.step_done_t == 0:
            return
        previous = self._seen_step.get(rank)
        self._seen_step[rank] = slot.completed_step
        # the first step seen in a generation carries one-off work (first DDP pass, warm caches): not a sample
        if previous is not None and slot.completed_step > previous:
            self.auto.observe(slot.step_s)

    def allowance(self, slot: Slot | None) -> float | None:
        """Seconds of silence allowed to a worker in ``slot``'s phase; None: not watched."""
        if slot is None:
            # Not attached (yet): a script without the worker library never reports progress, so silence means
            # nothing. Hangs before attach (in the process group's creation) are left to torch's init timeout.
            return None
        if slot.phase in _STARTUP_PHASES:
            return self.startup_s
        if slot.phase in (Phase.PARKED, Phase.JOINING):
            return None
        if slot.phase is Phase.EXITING:
            return min(EXIT_ALLOWANCE_S, self.startup_s)
        if slot.step_done_t == 0:  # the first step of this process
            return self.startup_s
        timeout = self.timeout_s
        return self.startup_s if timeout is None else timeout
