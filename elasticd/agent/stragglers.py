"""Stragglers: a rank whose own time per step stays well above the others', reported (never killed).

In synchronous data-parallel training every rank finishes a step at the same moment: the collective makes the fast
ranks wait for the slow one, so step times cannot tell who is slow. What differs is the time a rank spends *before*
it waits: loading its data and running its forward passes. The worker library measures that (``own_s`` in each
step beat, see ``elasticd/worker/run.py``). A rank is a straggler when, over a sustained ``window_s``, its median own
time is at least ``factor`` times the median of the other ranks' *and* the excess costs at least
:data:`MIN_SHARE` of a step (a 4 ms rank beside 2 ms ones is not worth an alert). A uniformly slow group has no
straggler. Other nodes' ranks arrive through their registry records (``peers``).
"""

from __future__ import annotations

import statistics
import threading
from collections import deque
from dataclasses import dataclass

# The excess must cost at least this share of the group's step time to matter.
MIN_SHARE = 0.05
_MIN_SAMPLES = 3


@dataclass(frozen=True, slots=True)
class StragglerEvent:
    kind: str  # "detected" or "recovered"
    rank: int
    own_s: float = 0.0
    others_s: float = 0.0
    step_s: float = 0.0

    @property
    def ratio(self) -> float:
        return self.own_s / self.others_s if self.others_s > 0 else float("inf")


class StragglerDetector:
    def __init__(self, *, factor: float, window_s: float) -> None:
        self.factor = factor
        self.window_s = window_s
        self._own: dict[int, deque[tuple[float, float]]] = {}
        self._step: deque[tuple[float, float]] = deque()
        self._peers: dict[int, float] = {}
        self._since: dict[int, float] = {}
        self._reported: set[int] = set()
        self._lock = threading.Lock()  # beats arrive on the receiver's thread, checks run on the supervisor's

    @property
    def enabled(self) -> bool:
        return self.factor > 0

    def observe(self, rank: int, own_s: float, step_s: float, now: float) -> None:
        """A local rank's step beat (own time and step time, averaged since its previous beat)."""
        with self._lock:
            self._own.setdefault(rank, deque()).append((now, own_s))
            self._step.append((now, step_s))

    def reset(self) -> None:
        """A new worker generation: ranks may have moved; start over."""
        with self._lock:
            self._own.clear()
            self._step.clear()
            self._since.clear()
            self._reported.clear()

    def peers(self, medians: dict[int, float]) -> None:
        """Other nodes' ranks and their median own times (from the registry)."""
        self._peers = dict(medians)

    def local_medians(self, now: float) -> dict[int, float]:
        with self._lock:
            return self._local_medians(now)

    def _local_medians(self, now: float) -> dict[int, float]:
        medians = {}
        for rank, samples in self._own.items():
            _trim(samples, now - self.window_s)
            if len(samples) >= _MIN_SAMPLES:
                medians[rank] = statistics.median(s for _, s in samples)
        return medians

    def check(self, now: float) -> list[StragglerEvent]:
        if not self.enabled:
            return []
        with self._lock:
            return self._check(now)

    def _check(self, now: float) -> list[StragglerEvent]:
        local = self._local_medians(now)
        _trim(self._step, now - self.window_s)
        if not self._step:
            return []
        step_s = statistics.median(s for _, s in self._step)
        everyone = {**self._peers, **local}
        events = []
        for rank, own in sorted(local.items()):
            others = [m for r, m in everyone.items() if r != rank]
            if not others:
                continue
            others_s = statistics.median(others)
            slow = own >= self.factor * others_s and own - others_s >= MIN_SHARE * step_s
            if not slow:
                self._since.pop(rank, None)
                if rank in self._reported:
                    self._reported.discard(rank)
                    events.append(StragglerEvent("recovered", rank, own, others_s, step_s))
                continue
            since = self._since.setdefault(rank, now)
            if rank not in self._reported and now - since >= self.window_s:
                self._reported.add(rank)
                events.append(StragglerEvent("detected", rank, own, others_s, step_s))
        return events


def _trim(samples: deque[tuple[float, float]], oldest: float) -> None:
    while samples and samples[0][0] < oldest:
        samples.popleft()
