"""Where elasticd keeps its files, defined in one place: every file and directory name it writes or reads on disk, and
the functions that build their paths. The names are a contract (DESIGN.md §3, "Checkpoint layout"): outside tools
and the tests read these paths, so a name changes only together with everything that reads it.

The run directory ``<checkpoint-dir>/<run-id>/`` on the shared filesystem (:class:`RunLayout`)::

    step-000000001200/                      a committed checkpoint: accelerate save_state files + elasticd.json
    step-000000001300.<writer>.partial/     being written by one writer (elasticd/lineage.py); never loaded
        .rank-<rank>.done                   an asynchronous save's marker: this rank's files are written
    diagnostics/<UTC time>-hang/            one hang: summary.json, node-<node>/evidence.json and the ranks' dumps
    diagnostics/nccl/trace-rank-<rank>      torch's own flight-recorder dumps, when its NCCL watchdog fires first

The daemon's runtime directory on the node, a fresh temporary one removed at exit (:class:`RuntimeLayout`)::

    beats.sock                              the beat socket (elasticd/messages.py)
    torchelastic/                           torch's log directory
    board/                                  the progress board (elasticd/board.py), ``ELASTICD_BOARD`` to workers
        rank-<local rank>                   a worker's progress slot
        stacks-<local rank>.txt             its Python stacks, written by faulthandler on SIGUSR1
        fr-<local rank>.json                its flight-recorder dump, on the daemon's request
        hang-*/                             evidence gathered while a hang is being confirmed
"""

from __future__ import annotations

import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

# --- the run directory -----------------------------------------------------------------------------------------------
# A committed checkpoint's manifest, written last (elasticd/worker/checkpoints.py owns its schema).
MANIFEST = "elasticd.json"
DIAGNOSTICS_DIR = "diagnostics"
_NCCL_DIR = "nccl"
_NCCL_TRACE_PREFIX = "trace-rank-"  # torch appends the rank
_COMMITTED = re.compile(r"^step-(\d{12})$")
# ``step-N.<writer>.partial``; ``step-N.partial`` (no writer) was the layout of elasticd 0.1.
_PARTIAL = re.compile(r"^step-(\d{12})(?:\.([A-Za-z0-9]+))?\.partial$")
# A file that checks the directory can be written (elasticd/rundir.py), removed at once.
PROBE_PREFIX = ".elasticd-probe-"

# --- a hang's directory ----------------------------------------------------------------------------------------------
HANG_SUMMARY = "summary.json"  # the agreed diagnosis, written by the node that claimed the hang
NODE_EVIDENCE = "evidence.json"  # in node-<node>/: each local rank's evidence
_HANG_TIME = "%Y%m%dT%H%M%SZ"

# --- the runtime directory -------------------------------------------------------------------------------------------
RUNTIME_PREFIX = "elasticd-"
HANG_SCRATCH_PREFIX = "hang-"  # in the board dir: evidence before the hang is confirmed

# --- the user's local runs (etcd/local_runs.py) ----------------------------------------------------------------------
LOCAL_RUNS_DIR = "elasticd"  # in $XDG_RUNTIME_DIR
LOCAL_RUN_SUFFIX = ".json"


def local_runs_dir(xdg_runtime_dir: str | None, tmp: str, uid: int) -> Path:
    """This user's directory of local runs: ``$XDG_RUNTIME_DIR/elasticd``, else ``<tmp>/elasticd-<uid>``."""
    return Path(xdg_runtime_dir) / LOCAL_RUNS_DIR if xdg_runtime_dir else Path(tmp) / f"{RUNTIME_PREFIX}{uid}"


def local_run_name(run_id: str, node_id: str, pid: int) -> str:
    return f"{run_id}.{node_id}.{pid}{LOCAL_RUN_SUFFIX}"


def checkpoint_name(step: int) -> str:
    """The directory name of the committed checkpoint of ``step``."""
    return f"step-{step:012d}"


def partial_name(step: int, writer: str) -> str:
    """The directory name ``writer`` saves ``step`` into before the commit renames it."""
    return f"{checkpoint_name(step)}.{writer}.partial"


def committed_step(name: str) -> int | None:
    """The step of a committed checkpoint's directory name; None for any other name."""
    match = _COMMITTED.match(name)
    return int(match.group(1)) if match else None


def is_partial(name: str) -> bool:
    """Whether ``name`` is a directory a save was being written into (of any writer, or of elasticd 0.1)."""
    return _PARTIAL.match(name) is not None


def done_marker(rank: int) -> str:
    """The file a rank leaves in the partial directory once its files are complete: their sizes and sha256."""
    return f".rank-{rank}.done"


def hang_name(utc: time.struct_time) -> str:
    """A hang's directory name: the UTC time it was claimed at (``time.gmtime()``)."""
    return time.strftime(_HANG_TIME, utc) + "-hang"


def node_evidence_dir(node: str) -> str:
    """The directory of one node's evidence, relative to the hang's directory."""
    return f"node-{node}"


def stacks_evidence(node: str, rank: int) -> str:
    """A rank's stacks, relative to the hang's directory (the evidence records this name)."""
    return f"{node_evidence_dir(node)}/rank-{rank}.stacks.txt"


def flight_recorder_evidence(node: str, rank: int) -> str:
    """A rank's flight-recorder dump, relative to the hang's directory (the evidence records this name)."""
    return f"{node_evidence_dir(node)}/rank-{rank}.flight-recorder.json"


@dataclass(frozen=True, slots=True)
class RunLayout:
    """The paths of one run's directory ``<checkpoint_dir>/<run_id>/``."""

    checkpoint_dir: Path
    run_id: str

    @property
    def dir(self) -> Path:
        return self.checkpoint_dir / self.run_id

    def checkpoint(self, step: int) -> Path:
        return self.dir / checkpoint_name(step)

    def partial(self, step: int, writer: str) -> Path:
        return self.dir / partial_name(step, writer)

    @property
    def diagnostics(self) -> Path:
        return self.dir / DIAGNOSTICS_DIR

    def hang(self, name: str) -> Path:
        """The directory of the hang called ``name`` (:func:`hang_name`, as the nodes agreed on it)."""
        return self.diagnostics / name

    @property
    def nccl_trace_prefix(self) -> str:
        """torch's ``TORCH_FR_DUMP_TEMP_FILE``: a path prefix, to which torch appends the rank."""
        return str(self.diagnostics / _NCCL_DIR / _NCCL_TRACE_PREFIX)


@dataclass(frozen=True, slots=True)
class RuntimeLayout:
    """The paths of a daemon's runtime directory (node-local, private to the daemon and its workers)."""

    dir: Path

    @classmethod
    def create(cls) -> RuntimeLayout:
        """A fresh runtime directory (mode 0700, in the system's temporary directory) with its board directory."""
        layout = cls(Path(tempfile.mkdtemp(prefix=RUNTIME_PREFIX)))
        layout.board.mkdir()
        return layout

    @property
    def socket(self) -> Path:
        return self.dir / "beats.sock"

    @property
    def board(self) -> Path:
        return self.dir / "board"

    @property
    def torchelastic_logs(self) -> Path:
        return self.dir / "torchelastic"


def slot_path(board_dir: str | Path, local_rank: int) -> Path:
    """A worker's progress slot in the board directory (workers know only that directory: ``ELASTICD_BOARD``)."""
    return Path(board_dir) / f"rank-{local_rank}"


def stacks_path(board_dir: str | Path, local_rank: int) -> Path:
    return Path(board_dir) / f"stacks-{local_rank}.txt"


def flight_recorder_path(board_dir: str | Path, local_rank: int) -> Path:
    return Path(board_dir) / f"fr-{local_rank}.json"
