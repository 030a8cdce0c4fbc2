"""The demo's nodes: real ``elasticd start`` daemons on this machine, one etcd they share, and a real kill -9.

Each node is one daemon process (in its own session) with its workers below it, started with the options a node of
a real cluster gets: the shared etcd and its login, the run id, the elastic range, its own node id, the loopback
address for its data. Its events go to ``<logs>/<node>.err`` and its workers' output to ``<logs>/<node>.out``.
Killing a node sends SIGKILL to the daemon and every process below it at once (the workers run in sessions of their
own, as torch's agent starts them, so the daemon's process group would not reach them): what a lost host looks like
to the others. Whatever is still running when the demo ends, or is interrupted, is killed the same way.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import psutil

from elasticd import envvars
from elasticd.etcd.access import EtcdAccess


@dataclass(frozen=True, slots=True)
class NodePlan:
    """What every node of the demo is started with."""

    endpoint: str  # the shared etcd, HOST:PORT
    access: EtcdAccess
    run_id: str
    min_nodes: int
    max_nodes: int
    checkpoint_dir: Path
    checkpoint_every_steps: int
    script: tuple[str, ...]  # the training script and its arguments

    def command(self, node_id: str) -> list[str]:
        login = ["--etcd-user", self.access.user] if self.access.user else []
        if self.access.password_file:
            login += ["--etcd-password-file", self.access.password_file]
        return [
            sys.executable, "-m", "elasticd", "start",
            "--etcd", self.endpoint, *login,
            "--run-id", self.run_id,
            "--node-id", node_id,
            "--min-nodes", str(self.min_nodes),
            "--max-nodes", str(self.max_nodes),
            "--nproc-per-node", "1",
            "--local-addr", "127.0.0.1",
            "--checkpoint-dir", str(self.checkpoint_dir),
            "--checkpoint-every-steps", str(self.checkpoint_every_steps),
            "--metrics-port", "0",  # several daemons on one host: no port to share
            "--log-format", "json",
            *self.script,
        ]  # fmt: skip


@dataclass
class LocalNode:
    name: str
    proc: subprocess.Popen[bytes]
    out: Path
    err: Path
    killed: bool = False

    @property
    def running(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """kill -9 of the node: the daemon and every process below it, found before any is signalled."""
        with contextlib.suppress(psutil.NoSuchProcess):
            root = psutil.Process(self.proc.pid)
            everyone = [root, *root.children(recursive=True)]
            for process in everyone:
                with contextlib.suppress(psutil.NoSuchProcess):
                    process.send_signal(signal.SIGKILL)
        self.killed = True
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)


class LocalNodes:
    """The demo's nodes, by name, in the order they were started."""

    def __init__(self, plan: NodePlan, logs: Path) -> None:
        self.plan = plan
        self.logs = logs
        self.nodes: dict[str, LocalNode] = {}

    def clear_logs(self) -> None:
        """Remove the node logs an earlier demo of this run id left (this one writes its own)."""
        for old in self.logs.glob("node-*.*"):
            if old.suffix in (".out", ".err"):
                old.unlink()

    def start(self, name: str) -> LocalNode:
        self.logs.mkdir(parents=True, exist_ok=True)
        out, err = self.logs / f"{name}.out", self.logs / f"{name}.err"
        with out.open("wb") as fo, err.open("wb") as fe:
            proc = subprocess.Popen(
                self.plan.command(name),
                stdout=fo,
                stderr=fe,
                stdin=subprocess.DEVNULL,
                env=_node_environment(),
                start_new_session=True,
            )
        node = LocalNode(name, proc, out, err)
        self.nodes[name] = node
        return node

    def running(self) -> list[LocalNode]:
        return [n for n in self.nodes.values() if n.running]

    def close(self) -> None:
        """Kill whatever still runs (an interrupted or failed demo)."""
        for node in self.nodes.values():
            if node.running:
                node.kill()


def _node_environment() -> dict[str, str]:
    """The demo's environment, with one compute thread per worker unless the user chose: all the nodes share this
    machine's cores, where each real node would have its own (elasticd would give a lone worker all of them)."""
    env = dict(os.environ)
    env.setdefault(envvars.OMP_NUM_THREADS, "1")
    return env
