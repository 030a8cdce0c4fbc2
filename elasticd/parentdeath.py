"""The kernel's parent-death signal (Linux ``prctl(PR_SET_PDEATHSIG)``), for processes that must not outlive the
daemon: the worker launcher and the reaper.

The signal is sent when the *thread* that created the process exits, not the whole parent process; the daemon
creates both from its main thread (torch's agent starts workers from the thread that calls ``agent.run()``), which
lives as long as the daemon. It survives ``execve`` and is not inherited by children.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def set_parent_death_signal(signum: int) -> bool:
    """Ask for ``signum`` when the parent dies; False where the platform has no such request (not Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl(PR_SET_PDEATHSIG): {os.strerror(errno)}")
    return True


def parent_is(expected_pid: int) -> bool:
    """Whether the parent is still ``expected_pid``. Checked *after* :func:`set_parent_death_signal`: a parent that
    died before the request would never trigger the signal, and the process was then re-parented already."""
    return os.getppid() == expected_pid
