"""Which process this is, written down so that another process on the same machine can tell whether it still runs.

A pid alone says little: it is reused, and a restarted container numbers its processes from 1 again. The boot id and
the pid namespace say whether a recorded pid means the same thing here, and the process's start time (in clock
ticks since boot) tells the recorded process from a later one with the same pid. Linux only; elsewhere
:func:`identity` is empty and nothing is ever judged from it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def identity(pid: int | None = None) -> dict[str, Any]:
    """``boot_id``, ``pid_ns``, ``pid`` and ``pid_start`` of ``pid`` (default: this process); {} if unknown."""
    pid = os.getpid() if pid is None else pid
    try:
        return {
            "boot_id": _BOOT_ID.read_text().strip(),
            "pid_ns": os.stat(f"/proc/{pid}/ns/pid").st_ino,
            "pid": pid,
            "pid_start": _start_ticks(pid),
        }
    except (OSError, ValueError, IndexError):
        return {}


def _start_ticks(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    # field 22 (starttime); the command name before it is in parentheses and may hold spaces
    return int(stat[stat.rindex(")") + 2 :].split()[19])


def same_machine(record: dict[str, Any]) -> bool:
    """Whether ``record`` (from :func:`identity`) was written on this machine, in this pid namespace."""
    mine = identity()
    return bool(mine) and record.get("boot_id") == mine["boot_id"] and record.get("pid_ns") == mine["pid_ns"]


def still_running(record: dict[str, Any]) -> bool:
    """Whether the process ``record`` names runs (only meaningful when :func:`same_machine`)."""
    pid, start = record.get("pid"), record.get("pid_start")
    if not isinstance(pid, int) or not isinstance(start, int) or pid <= 0:
        return False
    try:
        return _start_ticks(pid) == start
    except (OSError, ValueError, IndexError):
        return False
