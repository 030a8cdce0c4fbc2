"""bench/recovery.py's sharded (FSDP2) job, recovered in place from shard mirrors in peers' memory: issue 26's
targets, and what a change in place records beyond its seconds: the steps the survivors redo (rank 0's
``reconfigured`` event) and whether a surviving node's worker processes were replaced.

Issue 26, on the ~100M-parameter job (``SHARDED_LARGE``) and judged on the 3.2M one (``SHARDED``) alike: a kill -9
of one node trains at world 2 within 2 s of the kill (``seconds``: the kill -> the first step line at world 2), redoes
at most K - 1 steps (K: ``--shard-mirror-every``, elasticd's default here), restarts no survivor's process, and is at
least 5x faster than the same job's cold restart (``elasticd-cold``) in the same run; a join 2 -> 3 pauses the
running group at most 2 s in total (``stall_total``)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from elasticd.options import SHARD_MIRROR_EVERY as SHARD_MIRROR_EVERY_OPTION

TARGET_NODE_LOSS_S = 2.0
TARGET_JOIN_S = 2.0
TARGET_COLD_RATIO = 5.0
# K: the bench passes no --shard-mirror-every, so every elasticd node runs the default
SHARD_MIRROR_EVERY: int = SHARD_MIRROR_EVERY_OPTION.default


def in_place_report(
    events: Iterable[dict[str, Any]], after: float, stamp: Callable[[dict[str, Any]], float]
) -> dict[str, Any]:
    """``lost_steps`` and ``step`` (the step training went on from) of rank 0's first ``reconfigured`` event after
    ``after`` that is not a join's (the worker and its daemon both log it, alike); empty without one."""
    for e in sorted(events, key=stamp):
        if e.get("rank") == 0 and e.get("reason") != "join" and stamp(e) > after and "lost_steps" in e:
            return {"lost_steps": e.get("lost_steps"), "resumed_step": e.get("step")}
    return {}


def restarted(before: dict[str, set[int]], after: dict[str, set[int]]) -> bool | None:
    """Whether any surviving node's worker processes differ after the recovery from before the fault; None when a
    node's workers were not found before it."""
    if not before or not all(before.values()):
        return None
    return any(after.get(name) != pids for name, pids in before.items())


def verdict(join: bool, hot: dict[str, Any] | None, cold_ratio: float | None) -> str:
    """Issue 26's targets on elasticd hot's row data (``summarize``'s: median, phase medians, the samples' steps
    redone and restarts) and the cold restart's median over elasticd hot's."""
    if not hot or hot.get("median_s") is None:
        return ""
    if join:
        total = hot.get("phase_medians_s", {}).get("stall_total")
        if total is None:
            return ""
        return f"pause in total <= {TARGET_JOIN_S:g} s: {_met(total <= TARGET_JOIN_S)}"
    parts = [f"first step at 2 <= {TARGET_NODE_LOSS_S:g} s: {_met(hot['median_s'] <= TARGET_NODE_LOSS_S)}"]
    lost = hot.get("lost_steps") or []
    if lost:
        known = [n for n in lost if n is not None]
        worst = max(known) if len(known) == len(lost) else None
        most = SHARD_MIRROR_EVERY - 1
        parts.append(f"steps redone <= {most}: " + ("not recorded" if worst is None else _met(worst <= most)))
    if (replaced := hot.get("survivor_workers_restarted")) and None not in replaced:
        parts.append(f"no survivor restarted: {_met(not any(replaced))}")
    if cold_ratio is not None:
        shown = "inf" if math.isinf(cold_ratio) else f"{cold_ratio:.1f}x"
        parts.append(f">= {TARGET_COLD_RATIO:g}x cold ({shown}): {_met(cold_ratio >= TARGET_COLD_RATIO)}")
    return "; ".join(parts)


def _met(ok: bool) -> str:
    return "met" if ok else "MISSED"


def notes(rows: Sequence[dict[str, Any]], systems: Sequence[str], label: Callable[[str], str]) -> list[str]:
    """Per scenario and system that recorded them: the steps redone and whether a survivor's workers were replaced,
    every trial's (x: not recorded); empty when no sample recorded either."""
    lines = []
    for row in rows:
        for system in systems:
            data = row.get(system) or {}
            lost, replaced = data.get("lost_steps"), data.get("survivor_workers_restarted")
            parts = []
            if lost:
                parts.append("steps redone " + ", ".join("x" if n is None else str(n) for n in lost))
            if replaced:
                parts.append(
                    "survivors' workers restarted "
                    + ", ".join({None: "x", True: "yes", False: "no"}[r] for r in replaced)
                )
            if parts:
                lines.append(f"- {label(row['scenario'])}, {system}: {'; '.join(parts)}")
    if not lines:
        return []
    head = (
        "Steps the survivors redid (rank 0's `reconfigured` event: `lost_steps`; elasticd hot only) and whether any"
        " surviving node's worker processes were replaced (their pids before the fault against those at the first"
        " step at the new size), per trial; x: not recorded:"
    )
    return ["", head, "", *lines]
