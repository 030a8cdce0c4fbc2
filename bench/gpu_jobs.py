"""The jobs bench/gpu_check.py's one-GPU scenarios run: ``elasticd start`` nodes on this machine, one worker each,
every worker on the one GPU (``--device cuda``) or the CPU (``--device cpu``), against an embedded etcd of their own.

A :class:`CheckJob` is bench/recovery.py's :class:`~bench.recovery.ElasticdJob` (its nodes, event reading and group
ranks) with the node range, checkpoint interval, recovery mode and accelerate config a scenario asks for, and a
metrics port per node: the checkpoint scenario reads the save times from the daemons' own Prometheus histograms.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from bench.common import Launcher, Node, free_port, wait_until
from bench.recovery import ElasticdJob, step_lines
from bench.workloads import Workload
from elasticd.etcd.server import EmbeddedEtcd

ETCD_READY_TIMEOUT_S = 30.0
SCRAPE_TIMEOUT_S = 5.0
MAX_RESTARTS = 3  # a scenario that needs more has gone wrong


@dataclass(frozen=True, slots=True)
class Target:
    """Where the scenarios run: ``device`` the workers' (cuda: all on GPU 0; cpu: CUDA hidden from them), ``code``
    the :func:`~bench.common.snapshot_code` copy every node imports elasticd from."""

    device: str
    code: Path

    def env(self) -> dict[str, str]:
        # cpu: the same run on a GPU host must not touch the GPU (accelerate would take it); cuda: every worker is
        # local rank 0 of its node, so all of them train on cuda:0
        return {"CUDA_VISIBLE_DEVICES": ""} if self.device == "cpu" else {}

    def python_path(self) -> str:
        """The nodes' ``PYTHONPATH``: the code under test first, then the caller's (where a machine without a venv
        keeps elasticd's dependencies: README's "On a GPU")."""
        return os.pathsep.join(filter(None, [str(self.code), os.environ.get("PYTHONPATH", "")]))

    def script(self, name: str) -> Path:
        return self.code / "examples" / name


class CheckJob(ElasticdJob):
    """One job of ``elasticd start`` nodes for a scenario; see the module's docstring."""

    def __init__(
        self,
        launcher: Launcher,
        run_id: str,
        checkpoint_dir: Path,
        script: Path,
        etcd: str,
        workload: Workload,
        *,
        recovery: str = "hot",
        nodes: tuple[int, int] = (2, 3),
        checkpoint_every: int = 10,
        accelerate_config: Path | None = None,
    ) -> None:
        super().__init__(launcher, run_id, checkpoint_dir, script, etcd, recovery, workload)
        self.nodes = nodes
        self.checkpoint_every = checkpoint_every
        self.accelerate_config = accelerate_config
        self.metrics_ports: dict[str, int] = {}

    def command(self, name: str) -> list[str]:
        port = self.metrics_ports.setdefault(name, free_port())
        config = ["--accelerate-config", str(self.accelerate_config)] if self.accelerate_config else []
        return [
            sys.executable, "-m", "elasticd", "start",
            "--etcd", self.etcd, "--run-id", self.run_id, "--node-id", name, "--local-addr", "127.0.0.1",
            "--min-nodes", str(self.nodes[0]), "--max-nodes", str(self.nodes[1]), "--nproc-per-node", "1",
            "--metrics-addr", "127.0.0.1", "--metrics-port", str(port), "--log-format", "json",
            "--checkpoint-dir", str(self.checkpoint_dir), "--checkpoint-every-steps", str(self.checkpoint_every),
            "--recovery", self.recovery, "--max-restarts", str(MAX_RESTARTS), *config,
            str(self.script), *self.workload.script_args,
        ]  # fmt: skip

    def start_nodes(self, count: int) -> list[Node]:
        return [self.start_node() for _ in range(count)]

    def metrics(self, node: Node) -> dict[str, float]:
        """The node's daemon's Prometheus samples, ``name{label=value,...}`` -> value; empty when it does not answer."""
        url = f"http://127.0.0.1:{self.metrics_ports[node.name]}/metrics"
        try:
            with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_S) as answer:
                text = answer.read().decode()
        except OSError:
            return {}
        samples = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                samples[f"{s.name}{{{labels}}}" if labels else s.name] = float(s.value)
        return samples

    def step_lines(self, after: float = 0.0) -> list[dict[str, Any]]:
        """Every node's workers' step lines with ``t`` after ``after`` (unix s), in time order."""
        self.launcher.refresh()
        return step_lines(self, after)

    def events(self, name: str) -> list[dict[str, Any]]:
        """The JSON events called ``name`` on every node's stderr (its daemon's and its workers')."""
        self.launcher.refresh()
        return [e for n in self.launcher.nodes.values() for e in n.events(name)]

    def wait_steps(self, count: int, timeout_s: float, what: str, **match: Any) -> list[dict[str, Any]]:
        """Wait for ``count`` step lines whose fields equal ``match``; return them."""

        def enough() -> list[dict[str, Any]] | None:
            lines = [r for r in self.step_lines() if all(r.get(k) == v for k, v in match.items())]
            return lines if len(lines) >= count else None

        return wait_until(enough, timeout_s, f"{self.system}: {what}", poll_s=0.1)


@contextlib.contextmanager
def job(
    workdir: Path, name: str, target: Target, workload: Workload, script: str = "train.py", **options: Any
) -> Iterator[CheckJob]:
    """A :class:`CheckJob` of ``workload`` on an etcd of its own under ``workdir/name``; on the way out every node is
    killed before etcd stops, and its checkpoints are removed."""
    trial_dir = workdir / name
    with ExitStack() as stack:
        # last out: a job's checkpoints go (GBs each on a GPU's state), its logs stay
        stack.callback(shutil.rmtree, trial_dir / "checkpoints", ignore_errors=True)
        etcd = EmbeddedEtcd(data_dir=trial_dir / "etcd", host="127.0.0.1", fast_elections=True)
        etcd.start(ready_timeout_s=ETCD_READY_TIMEOUT_S)
        stack.callback(etcd.stop)
        run_id = f"gpu-check-{name}-{uuid.uuid4().hex[:6]}"
        env = {"PYTHONPATH": target.python_path(), **target.env(), **dict(workload.env)}
        launcher = stack.enter_context(Launcher(trial_dir, tag=run_id, env=env))
        yield CheckJob(
            launcher, run_id, trial_dir / "checkpoints", target.script(script), etcd.endpoint, workload, **options
        )
