"""A worker ends while an all-reduce it gave up on is still pending in gloo (``test_exit_guard.py``).

Two ranks of one gloo group over a TCPStore. Rank 0 issues an all-reduce through the hot path's hook that rank 1
never joins, gives the step up (as a failure notice does), closes the hook as ``run.close()`` does and ends. Rank 1
closes its connections (exits) only once rank 0 is tearing its interpreter down: a finaliser that runs in that
teardown tells it to, then holds the teardown open, so the given-up collective fails in gloo's thread right then.

argv: PORT RANK [--no-guard] [--raise] [--exit HOW:N] [--write PATH] [--fallback N]: without the guard the process
aborts; ``--raise`` lets an exception escape the script at its end; ``--exit sys.exit:3`` ends it with
``sys.exit(3)`` (``raise:3``: ``raise SystemExit(3)``); ``--write`` opens PATH and writes a line to it, never flushed
or closed (the interpreter's teardown would flush it); ``--fallback 5`` ends the script as the hot path's fallback
exits do (``exit_guard.exit_now(5)``) instead of through the guard
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from elasticd.worker.hot import exit_guard
from elasticd.worker.hot.comm_hook import GroupHolder, ResilientAllReduce
from elasticd.worker.hot.failure import StepHealth
from elasticd.worker.hot.given_up import GIVEN_UP

port, rank = int(sys.argv[1]), int(sys.argv[2])


def flag(name: str) -> str | None:
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else None


WRITTEN = "written by the script, never flushed\n"
store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=30))
group = dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=60))
if rank == 1:
    # an exception: rank 0 exited without a teardown (its store went with it), or never got there
    with contextlib.suppress(Exception):
        store.wait(["rank0_tearing_down"], timedelta(seconds=20))
    print("rank 1 closes its connections", flush=True)
    os._exit(0)


class Bucket:
    """The part of ``dist.GradBucket`` the hook uses."""

    def index(self) -> int:
        return 0

    def buffer(self) -> torch.Tensor:
        return torch.ones(4)


class InTeardown:
    """Its finaliser runs while the interpreter tears down (a module global of ``__main__``)."""

    def __init__(self, store: Any) -> None:
        self.store, self.sleep = store, time.sleep

    def __del__(self) -> None:
        self.store.set("rank0_tearing_down", "1")
        self.sleep(3.0)  # rank 1 exits meanwhile: the given-up collective fails now, in gloo's thread


hook = ResilientAllReduce(GroupHolder(group), StepHealth())  # type: ignore[arg-type]  # a bare gloo backend stands in for a ProcessGroup: it has all the hook calls
future = hook.reduce(Bucket())  # type: ignore[arg-type]  # stands in for torch's GradBucket
hook.abort("the test gives the step up")
future.wait()  # completed unreduced: the collective is given up on, still pending in gloo
hook.close()
pending = GIVEN_UP.pending()
print(f"pending given-up collectives: {pending}", flush=True)
if pending and "--no-guard" not in sys.argv and flag("--fallback") is None:
    exit_guard.install(lambda event, **fields: print(event, fields, flush=True), pending=pending)
atexit.register(lambda: print("another exit handler ran", flush=True))
in_teardown = InTeardown(store)
if (path := flag("--write")) is not None:
    unflushed = open(path, "w")  # noqa: SIM115  # held open to the end, as a script's log file may be
    unflushed.write(WRITTEN)
print("script ends", flush=True)
if (fallback := flag("--fallback")) is not None:
    exit_guard.exit_now(int(fallback))
if "--raise" in sys.argv:
    raise RuntimeError("the script failed after run.close()")
if (how := flag("--exit")) is not None:
    kind, code = how.split(":")
    if kind == "sys.exit":
        sys.exit(int(code))
    raise SystemExit(int(code))
