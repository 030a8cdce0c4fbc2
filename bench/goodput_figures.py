"""The figures of a goodput run (bench/goodput.py), computed from its raw step lines and its schedule alone, so a run
written before this rule existed is re-rendered by the same arithmetic (bench/tables.py).

Goodput is the share of the window the job spent training at its steady pace::

    goodput = sum over world sizes w of min(distinct steps at w x T(w), the seconds those steps took) / window

where ``T(w)`` is the steady step time at world size ``w`` measured in the same run (the median interval between two
consecutive step numbers both at ``w``), and a step number redone after a restart counts once, at its last
occurrence. Crediting each world size with its own step time means a smaller group's shorter steps are not counted as
3-node steps; the cap means no world size is credited more seconds than its steps took, so the step lines' intervals
(disjoint, inside the window) bound the sum and goodput <= 1 by construction. A world size with no two consecutive
steps has no steady step time and is credited nothing.

Goodput is a share of time; the nodes the schedule provided are a second measure beside it. Capacity is the
node-seconds present (3 nodes, one fewer from each kill until the next join starts a node); idle capacity is the
share of them not spent training at the steady pace (useful seconds at ``w`` x ``w`` nodes), and "outside the group"
is the part of it where a node was present but not in the group that trained: a joiner starting up, a spare, the
nodes of a job that had stopped.
"""

from __future__ import annotations

import bisect
import itertools
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# (seconds since the window started, step number, world size): one step line, as bench/goodput.py records it
StepLine = tuple[float, int, int]
# (seconds since the window started, node name): a kill or a join of the schedule
Event = tuple[float, str]


@dataclass(frozen=True, slots=True)
class Figures:
    goodput: float  # useful training seconds / window seconds, in [0, 1]
    step_time_s: dict[int, float]  # steady step time per world size, this run
    distinct_steps: dict[int, int]  # per world size, each step number once
    useful_s: dict[int, float]  # per world size: min(distinct steps x step time, seconds those steps took)
    capacity_node_s: float  # node-seconds the schedule provided over the window
    useful_node_s: float  # sum over world sizes of useful seconds x world size
    outside_group_node_s: float  # node-seconds of nodes present but not in the training group

    @property
    def idle_capacity(self) -> float:
        """Share of the node-seconds present not spent training at the steady pace."""
        return 1.0 - self.useful_node_s / self.capacity_node_s if self.capacity_node_s else 0.0

    @property
    def outside_group(self) -> float:
        """Share of the node-seconds present spent outside the training group (part of the idle capacity)."""
        return self.outside_group_node_s / self.capacity_node_s if self.capacity_node_s else 0.0


def steady_step_times(line: Sequence[StepLine]) -> dict[int, float]:
    """Per world size, the median seconds between two consecutive step numbers both printed at that size."""
    intervals: dict[int, list[float]] = {}
    for (t_a, step_a, world_a), (t_b, step_b, world_b) in itertools.pairwise(sorted(line)):
        if step_b == step_a + 1 and world_a == world_b:
            intervals.setdefault(world_b, []).append(t_b - t_a)
    return {world: statistics.median(values) for world, values in sorted(intervals.items())}


def nodes_present(start_nodes: int, kills: Sequence[Event], joins: Sequence[Event]) -> list[tuple[float, int]]:
    """(from when, how many nodes) through the window: ``start_nodes`` at 0, one fewer per kill, one more per join."""
    changes = sorted([(t, -1) for t, _ in kills] + [(t, +1) for t, _ in joins])
    steps = [(0.0, start_nodes)]
    for t, change in changes:
        steps.append((t, steps[-1][1] + change))
    return steps


def compute(
    line: Sequence[StepLine],
    steps_before: int,
    window_s: float,
    start_nodes: int,
    kills: Sequence[Event] = (),
    joins: Sequence[Event] = (),
) -> Figures:
    """The run's figures from its step lines in the window and the highest step before it (``steps_before``)."""
    ordered = sorted((min(t, window_s), step, world) for t, step, world in line)
    step_time_s = steady_step_times(ordered)
    # the interval each line closes, at its world size; the last occurrence of a step number is the one that counts
    closing: dict[int, tuple[float, int]] = {}
    previous_t = 0.0
    for t, step, world in ordered:
        if step > steps_before:
            closing[step] = (t - previous_t, world)
        previous_t = t
    distinct: dict[int, int] = {}
    took_s: dict[int, float] = {}
    for interval_s, world in closing.values():
        distinct[world] = distinct.get(world, 0) + 1
        took_s[world] = took_s.get(world, 0.0) + interval_s
    useful_s = {w: min(n * step_time_s.get(w, 0.0), took_s[w]) for w, n in sorted(distinct.items())}
    goodput = sum(useful_s.values()) / window_s if window_s > 0 else 0.0
    assert 0.0 <= goodput <= 1.0 + 1e-9, f"goodput {goodput} outside [0, 1]: the cap by the steps' own seconds broke"
    present = nodes_present(start_nodes, kills, joins)
    capacity, outside = _node_seconds(present, ordered, window_s)
    return Figures(
        goodput=round(goodput, 4),
        step_time_s=step_time_s,
        distinct_steps=dict(sorted(distinct.items())),
        useful_s=useful_s,
        capacity_node_s=capacity,
        useful_node_s=sum(w * s for w, s in useful_s.items()),
        outside_group_node_s=outside,
    )


def of_run(run: Mapping[str, Any], start_nodes: int) -> Figures | None:
    """The figures of one run as bench/goodput.py writes it (``line``, ``steps_before``, ``window_s``, ``kills``,
    ``joins``); None for a run with no step line in its window (not measured)."""
    if not run.get("line") or not run.get("window_s"):
        return None
    return compute(
        [(float(t), int(s), int(w)) for t, s, w in run["line"]],
        int(run.get("steps_before", 0)),
        float(run["window_s"]),
        start_nodes,
        [(float(t), str(n)) for t, n in run.get("kills", [])],
        [(float(t), str(n)) for t, n in run.get("joins", [])],
    )


def _node_seconds(
    present: Sequence[tuple[float, int]], ordered: Sequence[StepLine], window_s: float
) -> tuple[float, float]:
    """Node-seconds present over the window, and of them those outside the group that trained: in each stretch
    between two step lines the group is the world size of the line that ends it (none after the last line)."""
    change_times = [t for t, _ in present]
    line_times = [t for t, _, _ in ordered]
    edges = sorted({0.0, window_s, *(t for t in change_times if t < window_s), *line_times})
    capacity = outside = 0.0
    for start, end in itertools.pairwise(edges):
        nodes = present[bisect.bisect_right(change_times, start) - 1][1]
        closing = bisect.bisect_left(line_times, end)
        world = ordered[closing][2] if closing < len(ordered) else 0
        capacity += nodes * (end - start)
        outside += max(nodes - world, 0) * (end - start)
    return capacity, outside
