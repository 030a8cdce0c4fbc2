"""Evidence a hung worker can still give: all-thread Python stacks and the collective flight recorder.

Both are answered without the main thread, which is the one that hangs:

- **Stacks**: ``faulthandler`` registered on :data:`STACKS_SIGNAL` writes every thread's Python stack from its C
  signal handler straight to a file opened in advance (``<board-dir>/stacks-<local_rank>.txt``), so it works while
  the main thread is blocked inside a collective, holds the GIL in C code, or spins. (torch issue #122694 asks for
  exactly this before a hung rank is killed.)
- **Exiting**: an exception that escapes the script (a collective that failed because a peer died, say) marks the
  slot ``EXITING`` before the traceback is printed. The process may then take seconds to finish (interpreter
  teardown, the process group's destructor); meanwhile its silence is a failure on its way, not a hang.
- **Flight recorder**: torch records the last ``TORCH_FR_BUFFER_SIZE`` collectives of every process group (gloo and
  NCCL alike in torch ≥ 2.10). A daemon thread of this module watches the board slot's dump-request counter and
  answers with ``_dump_fr_trace_json`` into ``<board-dir>/fr-<local_rank>.json``: a hung rank shows the collective
  it waits in (``scheduled``/``started``), a culprit shows that it never reached it.

Without a daemon nothing is registered: the script's signals stay the script's.
"""

from __future__ import annotations

import contextlib
import faulthandler
import signal
import sys
import threading
from pathlib import Path
from types import TracebackType
from typing import IO

from elasticd.board import Phase, SlotWriter
from elasticd.layout import flight_recorder_path, stacks_path

STACKS_SIGNAL = signal.SIGUSR1
# Seconds between two looks at the dump-request counter: a memory read, no system call.
_REQUEST_POLL_S = 0.1


class WorkerDiagnostics:
    """Registers the stack dump and starts the flight-recorder answering thread; :meth:`close` undoes both."""

    def __init__(self, board_dir: str | Path, local_rank: int, slot: SlotWriter) -> None:
        self._stacks: IO[str] = stacks_path(board_dir, local_rank).open("w")
        previous = signal.getsignal(STACKS_SIGNAL)
        # chaining to the default action would end the process; chaining to the script's own handler keeps it
        chain = previous not in (signal.SIG_DFL, signal.SIG_IGN, None)
        faulthandler.register(STACKS_SIGNAL, file=self._stacks, all_threads=True, chain=chain)
        self._fr_path = flight_recorder_path(board_dir, local_rank)
        self._slot = slot
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._answer_requests, name="elasticd-diagnostics", daemon=True)
        self._thread.start()
        self._previous_hook = sys.excepthook
        sys.excepthook = self._on_uncaught

    def _on_uncaught(self, kind: type[BaseException], value: BaseException, traceback: TracebackType | None) -> None:
        with contextlib.suppress(ValueError, OSError):  # a closed map: nothing to tell the daemon any more
            self._slot.set_phase(Phase.EXITING)
        self._previous_hook(kind, value, traceback)

    def _answer_requests(self) -> None:
        answered = self._slot.dump_request
        while not self._stop.wait(_REQUEST_POLL_S):
            request = self._slot.dump_request
            if request == answered:
                continue
            answered = request
            self._fr_path.write_bytes(flight_recorder_dump())
            self._slot.answered_dump(request)

    def close(self) -> None:
        if sys.excepthook == self._on_uncaught:
            sys.excepthook = self._previous_hook
        self._stop.set()
        self._thread.join(timeout=1)
        with contextlib.suppress(RuntimeError, ValueError):
            faulthandler.unregister(STACKS_SIGNAL)
        self._stacks.close()


def flight_recorder_dump() -> bytes:
    """torch's flight-recorder trace as JSON bytes; ``{}`` where this torch build has none."""
    try:
        import torch._C._distributed_c10d as c10d

        return bytes(c10d._dump_fr_trace_json(includeCollectives=True))  # type: ignore[attr-defined]  # private, not in stubs
    except Exception as exc:  # an old torch, a build without distributed: no recorder, still an answer
        return f'{{"error": "{type(exc).__name__}"}}'.encode()
