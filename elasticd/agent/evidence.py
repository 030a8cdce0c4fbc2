"""Evidence from this node's workers before a hang is acted on: stacks, flight recorder, process state, position.

:func:`collect` asks every local worker for its all-thread Python stacks (``SIGUSR1``, answered by faulthandler in
the worker, see ``elasticd/worker/diagnostics.py``) and its flight-recorder dump (through the board slot), waits for
the answers (a stopped process cannot answer: its state says so), copies them under the hang's diagnostics
directory and returns one :class:`RankEvidence` per local rank. The culprit is chosen elsewhere
(``diagnosis.py``), from the evidence of every node.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from elasticd.board import Slot, read_slot, request_dump
from elasticd.layout import (
    NODE_EVIDENCE,
    flight_recorder_evidence,
    flight_recorder_path,
    node_evidence_dir,
    slot_path,
    stacks_evidence,
    stacks_path,
)
from elasticd.worker.diagnostics import STACKS_SIGNAL

# Seconds to wait for the workers' answers; faulthandler answers in microseconds, the recorder thread within its
# 100 ms poll. A worker that has not answered by then is reported without stacks.
ANSWER_TIMEOUT_S = 1.5
# Files whose frames mean "waiting for other ranks": torch's collectives, and autograd, where DDP all-reduces
# gradients during backward.
_COLLECTIVE_PATHS = ("torch/distributed/", "torch/autograd/", "torch/nn/parallel/distributed.py")
_PROC_STATES = {"R": "running", "S": "sleeping", "D": "disk-sleep", "T": "stopped", "t": "traced", "Z": "zombie"}
# A process in one of these states has exited: it is a failure for torch's monitor to report, never a hang.
EXITED_STATES = ("zombie", "gone")
# A process in one of these states is alive but cannot run: it is what the others wait for.
FROZEN_STATES = ("stopped", "traced")


@dataclass(frozen=True, slots=True)
class RankEvidence:
    rank: int
    local_rank: int
    node: str
    pid: int
    process_state: str  # running, sleeping, disk-sleep, stopped, traced, zombie, gone
    phase: str
    entered_step: int | None
    completed_step: int | None
    silent_s: float  # since this rank's last progress
    in_collective: bool | None  # None: no stacks
    where: str  # the main thread's innermost frame, "file:line in function"
    collectives: int | None  # collectives this rank entered (flight recorder); None: no dump
    pending_collective: str  # the collective it waits in, if any
    stacks: str | None  # file names relative to the diagnostics directory
    flight_recorder: str | None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RankEvidence:
        return cls(**{k: data.get(k) for k in cls.__dataclass_fields__})  # type: ignore[arg-type]  # a JSON dict, by field


def collect(
    *,
    node: str,
    board_dir: Path,
    out_dir: Path,
    pids: dict[int, int],
    ranks: dict[int, int],
    can_dump: set[int],
    started_at: float,
    timeout_s: float = ANSWER_TIMEOUT_S,
    stop: Callable[[], bool] = lambda: False,
) -> list[RankEvidence]:
    """Evidence of every local rank in ``pids`` (local rank → pid); files go to ``out_dir/node-<node>/``.

    ``stop`` ends the wait for answers early (a worker exited: it will never answer, and the hang is off)."""
    node_dir = out_dir / node_evidence_dir(node)
    node_dir.mkdir(parents=True, exist_ok=True)
    offsets: dict[int, int] = {}
    requests: dict[int, int] = {}
    for local_rank, pid in pids.items():
        if local_rank not in can_dump or process_state(pid) in FROZEN_STATES:
            continue  # a stopped process cannot answer: waiting for it would only delay the verdict its state gives
        path = stacks_path(board_dir, local_rank)
        offsets[local_rank] = path.stat().st_size if path.exists() else 0
        with contextlib.suppress(OSError):
            requests[local_rank] = request_dump(slot_path(board_dir, local_rank))
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, STACKS_SIGNAL)
    _wait_for_answers(board_dir, offsets, requests, timeout_s, stop)
    now = time.monotonic()
    evidence = []
    for local_rank, pid in sorted(pids.items()):
        rank = ranks.get(local_rank, local_rank)
        slot = read_slot(slot_path(board_dir, local_rank))
        stacks = _read_from(stacks_path(board_dir, local_rank), offsets.get(local_rank))
        stacks_name = fr_name = None
        if stacks:
            stacks_name = stacks_evidence(node, rank)
            (out_dir / stacks_name).write_text(stacks)
        fr = None
        fr_file = flight_recorder_path(board_dir, local_rank)
        if local_rank in requests and slot is not None and slot.dump_done >= requests[local_rank] and fr_file.exists():
            fr_name = flight_recorder_evidence(node, rank)
            (out_dir / fr_name).write_bytes(fr_file.read_bytes())
            fr = _load_json(fr_file)
        main = main_thread(stacks) if stacks else []
        collectives, pending = _collectives(fr)
        evidence.append(
            RankEvidence(
                rank=rank,
                local_rank=local_rank,
                node=node,
                pid=pid,
                process_state=process_state(pid),
                phase=slot.phase.name.lower() if slot else "starting",
                entered_step=slot.entered_step if slot else None,
                completed_step=slot.completed_step if slot else None,
                silent_s=round(now - (slot.progress_t if slot else started_at), 3),
                in_collective=any(_is_collective(f) for f in main) if main else None,
                where=main[0] if main else "",
                collectives=collectives,
                pending_collective=pending,
                stacks=stacks_name,
                flight_recorder=fr_name,
            )
        )
    (node_dir / NODE_EVIDENCE).write_text(json.dumps([e.to_json() for e in evidence], indent=2))
    return evidence


def _wait_for_answers(
    board_dir: Path, offsets: dict[int, int], requests: dict[int, int], timeout_s: float, stop: Callable[[], bool]
) -> None:
    deadline = time.monotonic() + timeout_s
    sizes: dict[int, int] = {}
    while time.monotonic() < deadline and not stop():
        stacks_done = True
        for local_rank, offset in offsets.items():
            path = stacks_path(board_dir, local_rank)
            size = path.stat().st_size if path.exists() else 0
            # written, and not growing since the last look (faulthandler writes thread by thread)
            stacks_done &= size > offset and sizes.get(local_rank) == size
            sizes[local_rank] = size
        slots: dict[int, Slot | None] = {r: read_slot(slot_path(board_dir, r)) for r in requests}
        fr_done = all(s is not None and s.dump_done >= requests[r] for r, s in slots.items())
        if stacks_done and fr_done:
            return
        time.sleep(0.05)


def _read_from(path: Path, offset: int | None) -> str:
    if offset is None or not path.exists():
        return ""
    with path.open("rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace")


def _load_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_bytes())
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def main_thread(stacks: str) -> list[str]:
    """The main thread's frames from a faulthandler dump, innermost first, as ``file:line in function``.

    faulthandler lists each thread as ``Thread 0x… (most recent call first):`` (or ``Current thread``) followed by
    ``  File "path", line N in function`` lines; the main thread is the one whose outermost frame is a module.
    """
    threads: list[list[str]] = []
    for line in stacks.splitlines():
        text = line.strip()
        if text.endswith("(most recent call first):"):
            threads.append([])
        elif text.startswith('File "') and threads:
            path, _, rest = text[6:].partition('", line ')
            number, _, function = rest.partition(" in ")
            threads[-1].append(f"{path}:{number} in {function}")
    for frames in threads:
        if frames and frames[-1].endswith(" in <module>"):
            return frames
    return threads[0] if threads else []


def _is_collective(frame: str) -> bool:
    return any(part in frame for part in _COLLECTIVE_PATHS)


def _collectives(fr: dict[str, Any] | None) -> tuple[int | None, str]:
    """(collectives entered on the default group, the one not yet retired) from a flight-recorder dump."""
    if fr is None or "entries" not in fr:
        return None, ""
    entries = [e for e in fr.get("entries") or [] if isinstance(e, dict) and e.get("pg_id", 0) == 0]
    if not entries:
        return 0, ""
    last = max(entries, key=lambda e: int(e.get("collective_seq_id", 0)))
    pending = "" if last.get("retired") else str(last.get("profiling_name", ""))
    return int(last.get("collective_seq_id", 0)), pending


def process_state(pid: int) -> str:
    """The kernel's view of ``pid`` from /proc (stopped by SIGSTOP shows as ``stopped``)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "gone"
    # the command name is in parentheses and may hold spaces: the state follows the last ')'
    code = stat.rsplit(")", 1)[-1].split()[0]
    return _PROC_STATES.get(code, code)


def process_exited(pid: int) -> bool:
    """Whether ``pid`` has exited (a zombie not yet reaped by the agent, or gone)."""
    return process_state(pid) in EXITED_STATES
