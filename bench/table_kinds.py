"""Every kind of table docs/benchmarks.md's markers name (``<!-- bench:KIND path -->``), and what renders it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bench.tables import (
    checkpoint_table,
    goodput_table,
    hang_table,
    recovery_table,
    shard_mirror_table,
    step_overhead_table,
)
from bench.tables_control_plane import control_plane_table
from bench.tables_gpu import gpu_check_table
from bench.tables_hot import collective_design_table, heal_table, join_contention_table, recovery_memory_table

KINDS: dict[str, Callable[[dict[str, Any]], str]] = {
    "recovery": recovery_table,
    "goodput": goodput_table,
    "checkpoint": checkpoint_table,
    "step_overhead": step_overhead_table,
    "hang": hang_table,
    "heal": heal_table,
    "collective_design": collective_design_table,
    "recovery_memory": recovery_memory_table,
    "join_contention": join_contention_table,
    "shard_mirror": shard_mirror_table,
    "control_plane": control_plane_table,
    "gpu_check": gpu_check_table,
}
