"""A daemon that dies while a round forms, on cue (a testing aid, like ``worker/faults.py``; never in production).

``ELASTICD_FAULT_DIE_AFTER_RDZV`` holds ``PHASE[@key=value,...]``; the daemon SIGKILLs itself (and its workers, if
any run) at that point of a round it takes part in::

    joined      the round is decided (next_rendezvous joined it), before rank 0 publishes the worker store address
    published   the store address is published, before ranks and node ids are exchanged
    started     the round formed and this node's workers were started (they die with it)

Conditions, all optional: ``rank=R`` (only as the round's group rank R), ``round=N`` (only in rendezvous round N),
``armed=PATH`` (only while the file PATH exists, so a test picks the moment and the node). Before dying it logs
``fault_injected`` so a test knows when the node died. A real SIGKILL at a chosen point of the round is what a node
lost to the OOM killer or a power cut does; no timing race in the test can hit these points reliably.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elasticd import envvars
from elasticd.logging import get_logger

PHASES = ("joined", "published", "started")


@dataclass(frozen=True, slots=True)
class DieAfterRendezvous:
    phase: str
    rank: int | None = None
    round: int | None = None
    armed: Path | None = None

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> DieAfterRendezvous | None:
        text = (os.environ if environ is None else environ).get(envvars.FAULT_DIE_AFTER_RDZV, "").strip()
        return parse(text) if text else None

    def applies(self, phase: str, rank: int, round_: int | None) -> bool:
        return (
            phase == self.phase
            and (self.rank is None or self.rank == rank)
            and (self.round is None or self.round == round_)
            and (self.armed is None or self.armed.exists())
        )


def parse(text: str) -> DieAfterRendezvous:
    """``PHASE[@rank=R,round=N,armed=PATH]``; ValueError naming what is wrong."""
    phase, _, spec = text.partition("@")
    phase = phase.strip()
    if phase not in PHASES:
        raise ValueError(f"{envvars.FAULT_DIE_AFTER_RDZV}: phase {phase!r} is not one of {', '.join(PHASES)}")
    values = dict(kv.split("=", 1) for kv in filter(None, spec.split(",")) if "=" in kv)
    unknown = set(values) - {"rank", "round", "armed"}
    if unknown:
        raise ValueError(f"{envvars.FAULT_DIE_AFTER_RDZV}: unknown key(s) {', '.join(sorted(unknown))}")
    return DieAfterRendezvous(
        phase,
        rank=int(values["rank"]) if "rank" in values else None,
        round=int(values["round"]) if "round" in values else None,
        armed=Path(values["armed"]) if "armed" in values else None,
    )


def maybe_die(
    phase: str,
    *,
    rank: int,
    round_: int | None,
    pids: Iterable[int] = (),
    log: Callable[..., Any] | None = None,
    fault: DieAfterRendezvous | None = None,
) -> None:
    """SIGKILL this daemon (after ``pids``, its workers) when the configured fault applies; otherwise nothing."""
    fault = fault if fault is not None else DieAfterRendezvous.from_env()
    if fault is None or not fault.applies(phase, rank, round_):
        return
    log = log or get_logger().warning
    log("fault_injected", fault=envvars.FAULT_DIE_AFTER_RDZV, phase=phase, group_rank=rank, round=round_)
    with contextlib.suppress(Exception):
        sys.stderr.flush()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(os.getpgid(pid), signal.SIGKILL)  # torch starts each worker in a session of its own
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)
