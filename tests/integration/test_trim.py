"""Giving freed heap memory back (``worker/hot/trim.py``): pages glibc keeps after a free leave the RSS."""

from __future__ import annotations

import subprocess
import sys

import pytest

from elasticd.worker.hot.trim import _malloc_trim

# In a fresh interpreter: 200 MB in 100 kB blocks (under glibc's mmap threshold: from the heap), all freed but the
# last one, which pins the heap's top so that the heap cannot shrink on its own. RSS before and after the trim.
_SCRIPT = """
import sys
from elasticd.worker.hot.trim import return_free_memory

def rss():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS:")).split()[1]) * 1024

blocks = [bytearray(100_000) for _ in range(2000)]
pin = bytearray(100_000)
del blocks
held = rss()
trimmed = return_free_memory() if sys.argv[1] == "trim" else False
print(held, rss(), trimmed)
"""


def _run(how: str) -> tuple[int, int, bool]:
    out = subprocess.run([sys.executable, "-c", _SCRIPT, how], capture_output=True, text=True, timeout=60, check=True)
    held, after, trimmed = out.stdout.split()
    return int(held), int(after), trimmed == "True"


@pytest.mark.skipif(_malloc_trim() is None, reason="not glibc: nothing to trim (CI runs on glibc)")
def test_freed_heap_pages_stay_in_the_rss_until_the_trim_gives_them_back() -> None:
    held, after, trimmed = _run("keep")
    assert not trimmed and after > held - 50_000_000  # freed, but still counted
    held, after, trimmed = _run("trim")
    assert trimmed and after < held - 150_000_000, (held, after)
