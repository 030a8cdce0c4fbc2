"""Giving what a change in place freed back to the operating system (glibc's ``malloc_trim``).

A change in place frees buffers of tens of MB: the hook's bucket copies of a failed step, the heal's, an old group's
once released (``given_up.py``). glibc keeps freed heap memory for reuse, and once a large block it had mapped on
its own is freed it raises its mmap threshold (up to 32 MB), so later buffers of that size come from the heap, where
freed pages stay in the process's RSS. Measured with ``bench/recovery_memory.py`` (12.6M parameters, 25 kill / join
cycles): the least RSS of a survivor between steps went up and down by 30-180 MB from one cycle to the next, with
no trend, and ``MALLOC_ARENA_MAX=1`` did not calm it. ``malloc_trim(0)`` returns every free page of every arena.
Elsewhere than glibc (musl, macOS) there is nothing to call and nothing is done.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Any


@functools.cache
def _malloc_trim() -> Any:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


def return_free_memory() -> bool:
    """Give the heap's free pages back to the operating system; False where the C library has no way to."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
