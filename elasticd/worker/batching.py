"""The batch plan: how a constant global batch splits over the current world (DESIGN.md §2, "Constant global batch").

:func:`plan_batches` is computed at every (re)start: it keeps ``micro_batch * world_size * accumulation ==
global_batch_size`` so that the optimizer sees the same batch, and the LR schedule the same steps, whatever the world
size. Where no integer accumulation fits, :class:`BatchPlanError` says so on one line and names the node counts of
the elastic range where it does fit, or sizes that would (as DeepSpeed's elastic config does).

:class:`BatchConstraint` is the same arithmetic seen from the daemons: which node counts of the elastic range can
train at all (:meth:`BatchConstraint.training_nodes`), so that a round whose node count does not split the global
batch trains on the largest count that does while the other nodes wait as spares (``elasticd/agent/spares.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from elasticd.errors import ConfigError

# A suggested global batch larger than this many times the one asked for is no use as advice (lcm(1..n) explodes).
_MAX_SUGGESTION_FACTOR = 16
# How many global batches that fit every node count of the range the spare warning names.
_EVERY_COUNT_SUGGESTIONS = 3


@dataclass(frozen=True, slots=True)
class BatchPlan:
    """One optimizer step: ``world_size`` ranks * ``accumulation`` micro-batches * ``micro_batch_size`` samples."""

    global_batch_size: int
    micro_batch_size: int
    world_size: int
    accumulation: int

    def __post_init__(self) -> None:
        if self.micro_batch_size * self.world_size * self.accumulation != self.global_batch_size:
            raise ValueError(
                f"inconsistent batch plan: {self.micro_batch_size} * {self.world_size} * {self.accumulation}"
                f" != {self.global_batch_size}; build plans with plan_batches()"
            )

    @property
    def per_rank(self) -> int:
        """Samples one rank consumes per optimizer step."""
        return self.micro_batch_size * self.accumulation


class BatchPlanError(ConfigError):
    """The global batch does not split into whole micro-batches over the world; carries the node counts that fit."""

    def __init__(
        self,
        message: str,
        *,
        global_batch_size: int,
        micro_batch_size: int,
        world_size: int,
        fitting_nodes: tuple[int, ...],
    ) -> None:
        super().__init__("global_batch_size", message)
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.world_size = world_size
        self.fitting_nodes = fitting_nodes


def plan_batches(
    global_batch_size: int,
    micro_batch_size: int,
    world_size: int,
    *,
    nproc_per_node: int = 1,
    min_nodes: int | None = None,
    max_nodes: int | None = None,
) -> BatchPlan:
    """The plan for ``world_size`` workers, with ``accumulation = global / (micro * world)``.

    ``min_nodes``/``max_nodes`` (default: 1 and the current node count) only shape the error: when the sizes do not
    fit, the message lists the node counts in that range (``world = nodes * nproc_per_node``) that do, or, if none
    does, a global batch that fits this world and one that fits every node count of the range.

    Raises :class:`~elasticd.errors.ConfigError` naming the argument for a value that is not a positive int, and
    :class:`BatchPlanError` when no integer accumulation fits.
    """
    _require_positive("global_batch_size", global_batch_size)
    _require_positive("micro_batch_size", micro_batch_size)
    _require_positive("world_size", world_size)
    _require_positive("nproc_per_node", nproc_per_node)
    low = 1 if min_nodes is None else _require_positive("min_nodes", min_nodes)
    high = (
        max(low, -(-world_size // nproc_per_node)) if max_nodes is None else _require_positive("max_nodes", max_nodes)
    )
    if low > high:
        raise ConfigError("min_nodes", f"min_nodes {low} is greater than max_nodes {high}")

    step_unit = micro_batch_size * world_size
    if global_batch_size % step_unit == 0:
        return BatchPlan(global_batch_size, micro_batch_size, world_size, global_batch_size // step_unit)

    node_unit = micro_batch_size * nproc_per_node
    fitting = tuple(n for n in range(low, high + 1) if global_batch_size % (node_unit * n) == 0)
    per_node = f"{nproc_per_node} process{'es' if nproc_per_node != 1 else ''} per node"
    head = (
        f"global batch {global_batch_size} does not split into micro-batches of {micro_batch_size}"
        f" over {world_size} worker{'s' if world_size != 1 else ''} (it must be a multiple of {step_unit})"
    )
    micro_fix = _largest_micro(global_batch_size, world_size, micro_batch_size)
    if fitting:
        tail = f"it fits at {_join(fitting)} nodes ({per_node}) of the range {low}..{high}"
        if micro_fix:
            tail += f"; micro_batch_size {micro_fix} fits this world"
    else:
        nearest = -(-global_batch_size // step_unit) * step_unit
        tail = f"it fits no node count in {low}..{high} ({per_node}); for this world try "
        tail += f"micro_batch_size {micro_fix} or " if micro_fix else ""
        tail += f"global_batch_size {nearest}"
        every = node_unit * math.lcm(*range(low, high + 1))
        if every != nearest and every <= _MAX_SUGGESTION_FACTOR * max(nearest, global_batch_size):
            tail += f", or global_batch_size {every} for every node count in the range"
    raise BatchPlanError(
        f"{head}; {tail}",
        global_batch_size=global_batch_size,
        micro_batch_size=micro_batch_size,
        world_size=world_size,
        fitting_nodes=fitting,
    )


@dataclass(frozen=True, slots=True)
class BatchConstraint:
    """What decides which node counts can train: ``global_batch_size % (micro * nproc_per_node * nodes) == 0``."""

    global_batch_size: int
    micro_batch_size: int
    nproc_per_node: int

    def __post_init__(self) -> None:
        for key in ("global_batch_size", "micro_batch_size", "nproc_per_node"):
            _require_positive(key, getattr(self, key))

    @property
    def node_unit(self) -> int:
        """Samples one node takes per micro-batch round: every count that trains splits the global batch by it."""
        return self.micro_batch_size * self.nproc_per_node

    def fits(self, nodes: int) -> bool:
        return nodes >= 1 and self.global_batch_size % (self.node_unit * nodes) == 0

    def fitting(self, low: int, high: int) -> tuple[int, ...]:
        """The node counts in ``low..high`` that split the global batch."""
        return tuple(n for n in range(max(1, low), high + 1) if self.fits(n))

    def training_nodes(self, nodes: int, low: int, high: int) -> int:
        """How many of ``nodes`` train: the largest count in ``low..min(high, nodes)`` that fits, 0 when none does."""
        return max(self.fitting(low, min(high, nodes)), default=0)

    def batches_for_every_count(self, low: int, high: int, count: int = _EVERY_COUNT_SUGGESTIONS) -> tuple[int, ...]:
        """The smallest ``count`` global batches that split over every node count in ``low..high``."""
        unit = self.node_unit * math.lcm(*range(max(1, low), high + 1))
        return tuple(unit * k for k in range(1, count + 1))

    def to_json(self) -> dict[str, int]:
        return {
            "global_batch_size": self.global_batch_size,
            "micro_batch_size": self.micro_batch_size,
            "nproc_per_node": self.nproc_per_node,
        }

    @classmethod
    def from_json(cls, data: Any) -> BatchConstraint | None:
        """The constraint in ``data`` (a beat or the etcd record), or None when it is not a valid one."""
        if not isinstance(data, dict):
            return None
        values = [data.get(key) for key in ("global_batch_size", "micro_batch_size", "nproc_per_node")]
        numbers = [v for v in values if isinstance(v, int) and not isinstance(v, bool) and v >= 1]
        return cls(*numbers) if len(numbers) == len(values) else None


def spare_warning(constraint: BatchConstraint, nodes: int, training: int, low: int, high: int) -> str:
    """One line for a round of ``nodes`` whose node count does not split the global batch: who trains, what fits."""
    spares = nodes - training
    per_node = f"{constraint.nproc_per_node} process{'es' if constraint.nproc_per_node != 1 else ''} per node"
    head = (
        f"global batch {constraint.global_batch_size} does not split into micro-batches of"
        f" {constraint.micro_batch_size} over {nodes} node{'s' if nodes != 1 else ''} ({per_node})"
    )
    if training:
        who = f"{training} train and " + ("1 waits as a spare" if spares == 1 else f"{spares} wait as spares")
    elif fitting := constraint.fitting(low, high):
        who = f"all {nodes} wait as spares until the round has {_join(fitting)} nodes"
    else:
        who = f"no node count in {low}..{high} can train"
    every = ", ".join(str(b) for b in constraint.batches_for_every_count(low, high))
    return f"{head}: {who}; global batches that fit every node count in {low}..{high}: {every}"


def _require_positive(key: str, value: object) -> int:
    # bool is an int subclass, and True as a batch size is always a mistake.
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(key, f"must be a positive integer, got {value!r}")
    return value


def _largest_micro(global_batch_size: int, world_size: int, at_most: int) -> int | None:
    """The largest micro batch up to ``at_most`` that keeps the global batch at this world size, if any."""
    if global_batch_size % world_size:
        return None
    per_rank = global_batch_size // world_size
    return max(d for d in range(1, min(at_most, per_rank) + 1) if per_rank % d == 0)


def _join(values: tuple[int, ...]) -> str:
    words = [str(v) for v in values]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"
