"""What the demo's nodes wrote: the training's step lines and the daemons' and workers' events, read as they grow.

Each node's daemon writes its events (JSON lines, ``--log-format json``) to ``<node>.err`` and its workers' output
to ``<node>.out``, where rank 0 prints one JSON line per optimizer step (``examples/train.py``: step, world size,
loss, wall time ``t``). :class:`Journal` reads the new complete lines of every file at each call, so the view and
the figures always come from what the job itself printed, never from what the demo expected.

:func:`change_figures` measures one change (a kill, a join) from the step lines alone, with the definitions of
``bench/recovery.py``: the first step at the new size, the time training lost to it (every step interval around the
change, less the run's usual step time, summed: the total, not the longest pause) and the steps trained twice.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# intervals before a change that set its usual step time
BASELINE_STEPS = 20


@dataclass(frozen=True, slots=True)
class Step:
    t: float  # wall time, unix seconds, as the worker printed it
    step: int
    world_size: int
    loss: float | None
    pid: int


@dataclass
class _Tail:
    """One growing file, read from where the last read stopped; a partial last line waits for its newline."""

    path: Path
    offset: int = 0

    def new_lines(self) -> list[str]:
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        self.offset += end
        return data[:end].decode(errors="replace").splitlines()


def _record(line: str) -> dict[str, Any] | None:
    if not line.startswith("{"):
        return None
    with contextlib.suppress(ValueError):
        value = json.loads(line)
        if isinstance(value, dict):
            return value
    return None


@dataclass
class Journal:
    """Every node's step lines (merged, in time order) and events (per node, in file order)."""

    steps: list[Step] = field(default_factory=list)
    events: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    _tails: dict[tuple[str, str], _Tail] = field(default_factory=dict)

    def follow(self, node: str, out: Path, err: Path) -> None:
        self.events.setdefault(node, [])
        self._tails[(node, "out")] = _Tail(out)
        self._tails[(node, "err")] = _Tail(err)

    def read(self) -> None:
        """Take in what every file gained since the last call."""
        fresh = False
        for (node, kind), tail in self._tails.items():
            for line in tail.new_lines():
                record = _record(line)
                if record is None:
                    continue
                if kind == "out" and record.get("event") == "step":
                    step = _step(record)
                    if step is not None:
                        self.steps.append(step)
                        fresh = True
                elif kind == "err" and "event" in record:
                    self.events[node].append(record)
        if fresh:
            self.steps.sort(key=lambda s: s.t)

    def named(self, event: str, nodes: Iterable[str] | None = None) -> list[tuple[str, dict[str, Any]]]:
        """The events called ``event`` (of ``nodes``, or all), with the node that logged each."""
        wanted = self.events if nodes is None else {n: self.events.get(n, []) for n in nodes}
        return [(node, e) for node, found in wanted.items() for e in found if e.get("event") == event]

    @property
    def last(self) -> Step | None:
        return self.steps[-1] if self.steps else None

    def first_step_at(self, world_size: int, after: float) -> Step | None:
        return next((s for s in self.steps if s.t > after and s.world_size == world_size), None)


def _step(record: dict[str, Any]) -> Step | None:
    try:
        loss = record.get("loss")
        return Step(
            t=float(record["t"]),
            step=int(record["step"]),
            world_size=int(record["world_size"]),
            loss=None if loss is None else float(loss),
            pid=int(record.get("pid", 0)),
        )
    except (KeyError, TypeError, ValueError):
        return None


@dataclass(frozen=True, slots=True)
class ChangeFigures:
    first_step_s: float  # from the change to the first step at the new size
    stopped_s: float  # training time lost: each interval's excess over the usual step time, summed
    usual_step_s: float  # the median of the intervals before the change
    redone: int  # steps completed before the change and trained again after it
    resumed_at: int  # the first step completed at the new size


def change_figures(steps: list[Step], at: float, first: Step) -> ChangeFigures:
    """The figures of a change that began at ``at`` (unix seconds) and ended with the step line ``first``."""
    times = [s.t for s in steps]
    gaps = list(itertools.pairwise(times))
    before = [b - a for a, b in gaps if b <= at][-BASELINE_STEPS:]
    during = [b - a for a, b in gaps if b > at and a < first.t]
    usual = statistics.median(before) if before else 0.0
    reached = max((s.step for s in steps if s.t < first.t), default=first.step - 1)
    return ChangeFigures(
        first_step_s=round(first.t - at, 3),
        stopped_s=round(sum(max(0.0, g - usual) for g in during), 3),
        usual_step_s=round(usual, 3),
        redone=max(0, reached - (first.step - 1)),
        resumed_at=first.step,
    )
