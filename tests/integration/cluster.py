"""Real elasticd nodes as real processes on 127.0.0.1 (or each on its own host: ``netns.py``), for integration tests.

A :class:`Cluster` starts ``elasticd start`` processes against one etcd, each with its own stdout (the workers'
JSON step lines) and stderr (the daemon's JSON events) files, and kills every process tree it started when closed.
``Node.kill()`` is a node dying: SIGKILL to the daemon and to its workers at once. A node on 127.0.0.1 is a fork of
a server that imported torch once (``daemon_forks.py``); one on a host of its own is a new interpreter.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from tests.integration import daemon_forks
from tests.integration.daemon_forks import DaemonForks, ForkedDaemon

if TYPE_CHECKING:
    from tests.integration.netns import Host

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train.py"


STEPS_PER_EPOCH = 10  # train_args' dataset: 480 samples in global batches of 48
CHECKPOINT_EVERY_STEPS = 10  # every Cluster's --checkpoint-every-steps, unless a test passes its own


def train_args(steps: int, sleep_s: float = 0.05, *extra: str) -> tuple[str, ...]:
    """examples/train.py arguments for a run of ``steps`` optimizer steps (a multiple of 10)."""
    assert steps % STEPS_PER_EPOCH == 0
    epochs = steps // STEPS_PER_EPOCH
    return (
        "--epochs",
        str(epochs),
        "--dataset-size",
        "480",
        "--global-batch",
        "48",
        "--micro-batch",
        "4",
        "--sleep",
        str(sleep_s),
        *extra,
    )


def _json_record(line: str) -> dict[str, Any] | None:
    line = line.strip()
    if not line.startswith("{"):
        return None
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


@dataclass
class _Parsed:
    """What one file's complete lines held, up to ``offset`` (a log only grows while a test reads it)."""

    inode: int
    offset: int = 0
    records: list[dict[str, Any]] = field(default_factory=list)


# Tests poll the nodes' logs at 20 Hz and each poll used to parse every line again: ~10 % of the suite's CPU went to
# re-reading logs of thousands of step lines. Each file is now parsed once, as it grows (the newest files only).
_PARSED: OrderedDict[Path, _Parsed] = OrderedDict()
_PARSED_FILES = 64


def read_json_lines(path: Path) -> Iterator[dict[str, Any]]:
    """The JSON object lines of ``path`` so far (none when it does not exist); callers must not change them."""
    try:
        with path.open("rb") as f:
            st = os.fstat(f.fileno())
            parsed = _PARSED.get(path)
            if parsed is None or parsed.inode != st.st_ino or st.st_size < parsed.offset:  # new, replaced, truncated
                parsed = _Parsed(st.st_ino)
            f.seek(parsed.offset)
            data = f.read()
    except FileNotFoundError:
        return
    complete = data.rfind(b"\n") + 1
    for line in data[:complete].decode(errors="replace").splitlines():
        record = _json_record(line)
        if record is not None:
            parsed.records.append(record)
    parsed.offset += complete
    _PARSED[path] = parsed
    _PARSED.move_to_end(path)
    while len(_PARSED) > _PARSED_FILES:
        _PARSED.popitem(last=False)
    yield from list(parsed.records)
    last = _json_record(data[complete:].decode(errors="replace"))  # a last line without its newline (yet)
    if last is not None:
        yield last


def step_after(t: float, world_size: int) -> Callable[[dict[str, Any]], bool]:
    """``Cluster.wait_step``'s condition: a step line printed after ``t`` (unix s) at ``world_size`` workers."""
    return lambda step: step["t"] > t and step["world_size"] == world_size


def wait_until(predicate: Callable[[], Any], timeout_s: float, what: str, poll_s: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


@dataclass
class Node:
    name: str
    proc: subprocess.Popen[bytes] | ForkedDaemon
    out: Path
    err: Path
    started_at: float = field(default_factory=time.time)

    def events(self, name: str | None = None) -> list[dict[str, Any]]:
        return [e for e in read_json_lines(self.err) if "event" in e and (name is None or e["event"] == name)]

    def steps(self) -> list[dict[str, Any]]:
        return [e for e in read_json_lines(self.out) if e.get("event") == "step"]

    def wait_event(
        self, name: str, timeout_s: float = 60, where: Callable[[dict[str, Any]], bool] = lambda e: True
    ) -> dict[str, Any]:
        def found() -> dict[str, Any] | None:
            matches = [e for e in self.events(name) if where(e)]
            if not matches and self.proc.poll() is not None:
                raise AssertionError(f"{self.name} exited {self.proc.returncode} before {name}:\n{self.tail()}")
            return matches[-1] if matches else None

        return wait_until(found, timeout_s, f"{self.name}: event {name}")

    def worker_pids(self) -> list[int]:
        """Every process below the daemon but its reaper (elasticd/agent/reaper.py) and its warm server with its
        resource tracker (elasticd/agent/warm_start.py), which are no workers."""
        return [
            c.pid
            for c in psutil.Process(self.proc.pid).children(recursive=True)
            if not _is_reaper(c) and not _is_warm_server(c, self.proc.pid)
        ]

    def kill(self) -> None:
        """The node dies: SIGKILL to the daemon and every process below it, at the same moment."""
        kill_nodes(self)

    def processes(self) -> list[psutil.Process]:
        """The daemon and every process below it."""
        return [psutil.Process(self.proc.pid), *psutil.Process(self.proc.pid).children(recursive=True)]

    def freeze(self) -> list[psutil.Process]:
        """The node stops (a paused VM, a stalled kernel): SIGSTOP to the daemon and every process below it. Nothing
        resets a connection and its leases lapse; :meth:`kill` (SIGKILL ends a stopped process) or SIGCONT to the
        processes returned ends it."""
        procs = [psutil.Process(self.proc.pid), *psutil.Process(self.proc.pid).children(recursive=True)]
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.send_signal(signal.SIGSTOP)
        return procs

    def wait(self, timeout_s: float = 120) -> int:
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.name} did not exit within {timeout_s}s:\n{self.tail()}") from None

    def tail(self, lines: int = 40, out_lines: int | None = None) -> str:
        """The last ``lines`` of the node's stderr (the daemon's and workers' events) and stdout (the script's steps:
        the last ``out_lines``, default ``lines``)."""
        text = []
        for path, count in ((self.err, lines), (self.out, lines if out_lines is None else out_lines)):
            if path.exists():
                text.append(f"--- {path.name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-count:]))
        return "\n".join(text)


def kill_nodes(*nodes: Node) -> None:
    """The nodes die together: every process of every one SIGKILLed before any is waited for (a node reaped first
    would leave the others alive long enough, under load, to re-form without it: not "at once")."""
    procs = [p for node in nodes for p in node.processes()]
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(signal.SIGKILL)
    for node in nodes:
        node.proc.wait(timeout=10)


class Cluster:
    """Nodes of one run; ``close()`` (or the context manager) kills whatever is still running."""

    def __init__(
        self,
        etcd: str,
        workdir: Path,
        *,
        run_id: str = "test",
        min_nodes: int = 1,
        max_nodes: int = 1,
        nproc_per_node: int = 1,
        script: Path = EXAMPLE,
        script_args: tuple[str, ...] | None = None,
        extra: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        self.etcd = etcd
        self.workdir = workdir
        self.run_id = run_id
        self.checkpoint_dir = workdir / "checkpoints"
        self.base_args = [
            "--etcd",
            etcd,
            "--run-id",
            run_id,
            "--min-nodes",
            str(min_nodes),
            "--max-nodes",
            str(max_nodes),
            "--nproc-per-node",
            str(nproc_per_node),
            "--local-addr",
            "127.0.0.1",
            "--checkpoint-dir",
            str(self.checkpoint_dir),
            "--checkpoint-every-steps",
            str(CHECKPOINT_EVERY_STEPS),
            "--metrics-port",
            "0",
            "--log-format",
            "json",
            *extra,
        ]
        self.script = [str(script), *(train_args(60) if script_args is None else script_args)]
        self.nodes: dict[str, Node] = {}
        self.env = dict(env or {})

    def start(self, name: str, *extra: str, host: Host | None = None) -> Node:
        """Start node ``name`` on 127.0.0.1, or inside ``host``'s namespace with ``--local-addr`` its data address."""
        out, err = self.workdir / f"{name}.out", self.workdir / f"{name}.err"
        env = dict(os.environ, **daemon_forks.NODE_ENVIRONMENT, **self.env)
        cmd = [
            sys.executable,
            "-m",
            "elasticd",
            "start",
            *self.base_args,
            "--node-id",
            name,
            *(("--local-addr", host.data_addr) if host is not None else ()),  # the last one given counts
            *extra,
            *self.script,
        ]
        proc: subprocess.Popen[bytes] | ForkedDaemon
        if host is None and daemon_forks.enabled():
            # a fork of a process that imported torch already: the same daemon, ~3 s of CPU sooner (daemon_forks.py)
            proc = DaemonForks.shared().start(cmd[3:], env, self.workdir, out, err)
        else:
            if host is not None:
                cmd = host.command(cmd)
            with out.open("ab") as fo, err.open("ab") as fe:
                proc = subprocess.Popen(cmd, stdout=fo, stderr=fe, cwd=self.workdir, env=env, start_new_session=True)
        node = Node(name, proc, out, err)
        self.nodes[name] = node
        return node

    def stop_run(self) -> None:
        """``elasticd stop``: the run drains (a checkpoint, then every node exits 0)."""
        stop = subprocess.run(
            [sys.executable, "-m", "elasticd", "stop", "--etcd", self.etcd, "--run-id", self.run_id],
            capture_output=True, text=True, timeout=120, cwd=self.workdir,
        )  # fmt: skip
        assert stop.returncode == 0, stop.stderr

    def all_steps(self) -> list[dict[str, Any]]:
        return sorted((s for n in self.nodes.values() for s in n.steps()), key=lambda s: s["t"])

    def last_step(self) -> dict[str, Any] | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def newest_step(self) -> dict[str, Any]:
        """The last step line; fails the test when there is none yet."""
        step = self.last_step()
        assert step is not None, "no step line yet"
        return step

    def wait_step(
        self, where: Callable[[dict[str, Any]], bool], timeout_s: float = 90, what: str = ""
    ) -> dict[str, Any]:
        def found() -> dict[str, Any] | None:
            return next((s for s in self.all_steps() if where(s)), None)

        return wait_until(found, timeout_s, what or "a matching step", poll_s=0.05)

    def close(self) -> None:
        for node in self.nodes.values():
            if node.proc.poll() is None:
                with contextlib.suppress(psutil.NoSuchProcess, subprocess.TimeoutExpired):
                    node.kill()
            else:
                # The daemon is gone; make sure nothing it started outlives the test.
                for p in _orphans_of(node):
                    p.kill()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is not None:
            # a failed test shows every node's changes in time order, then each node's last lines (pytest prints a
            # failing test's stdout): the only trace a CI run keeps of the daemons it ran, and a CI record keeps only
            # a part of it, so the steps come last and short
            print(f"===== changes, every node\n{self.changes()}")
            print("\n".join(f"===== {name}\n{node.tail(25, out_lines=3)}" for name, node in self.nodes.items()))
        self.close()

    def diagnostics(self, lines: int = 40) -> str:
        return "\n".join(f"===== {name}\n{node.tail(lines)}" for name, node in self.nodes.items())

    def changes(self) -> str:
        """Every node's membership changes, failures and restarts, one line each, in time order: what a failed
        assertion about the steps needs (a tail of 40 lines is often all lease warnings)."""
        names = {"step_failed", "regrouped", "reconfigured", "hot_fallback", "restart", "node_lost", "worker_failed"}
        names |= {"rendezvous_done", "workers_started", "resumed", "decision_timeout", "left_in_place", "joined"}
        names |= {"lineage_token", "lineage_lost", "round_abandoned", "round_member_lost", "hang_detected", "exit"}
        lines = [
            (e.get("timestamp", ""), name, {k: v for k, v in e.items() if k not in ("timestamp", "level", "run_id")})
            for name, node in self.nodes.items()
            for e in node.events()
            if e.get("event") in names
        ]
        return "\n".join(f"{t} {name} {e}" for t, name, e in sorted(lines, key=lambda line: line[0]))


def _is_reaper(process: psutil.Process) -> bool:
    from elasticd.agent.reaper import MODULE

    try:
        return MODULE in process.cmdline()
    except psutil.NoSuchProcess:
        return False


def _is_warm_server(process: psutil.Process, daemon_pid: int) -> bool:
    """The daemon's own forkserver child and the resource tracker multiprocessing starts with it (the workers are the
    server's children, with the server's command line)."""
    try:
        command = " ".join(process.cmdline())
        ours = "multiprocessing.forkserver" in command or "multiprocessing.resource_tracker" in command
        return process.ppid() == daemon_pid and ours
    except psutil.NoSuchProcess:
        return False


# Set by pytest-xdist in each of its worker processes, and inherited by every daemon and worker a test starts: a
# scan for a node's processes must not find those of a test that another xdist worker runs at the same time
# (node names repeat across tests). Without xdist it is unset everywhere, and every process matches.
_XDIST_WORKER = "PYTEST_XDIST_WORKER"


def _ours(env: dict[str, str]) -> bool:
    return env.get(_XDIST_WORKER) == os.environ.get(_XDIST_WORKER)


def _orphans_of(node: Node) -> list[psutil.Process]:
    """Processes still running whose command line names this node (workers re-parented to init)."""
    found = []
    for p in psutil.process_iter(["cmdline", "environ"]):
        try:
            env = p.info.get("environ") or {}
            if env.get("ELASTICD_NODE_ID") == node.name and _ours(env) and p.pid != os.getpid():
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def leftover_processes(names: list[str]) -> list[psutil.Process]:
    """Live processes started for any of ``names`` (workers carry ELASTICD_NODE_ID)."""
    left = []
    for p in psutil.process_iter(["environ"]):
        try:
            env = p.info.get("environ") or {}
            if env.get("ELASTICD_NODE_ID") in names and _ours(env) and p.status() != psutil.STATUS_ZOMBIE:
                left.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return left
