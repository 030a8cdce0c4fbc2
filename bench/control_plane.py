"""The control plane at scale: simulated nodes (elasticd's own rendezvous, registry, leases and membership code, no
workers) against a real 3-member etcd, at N = 8 ... 1,024 nodes (issue 28).

Per N and trial, on a fresh etcd cluster (``tests/integration/etcd_cluster.py``'s members, each in a network
namespace of its own with etcd's default timing; this benchmark's processes reach them through the network's
gateway):

- **form**: every node started (registry record claimed, liveness lease held), then all enter the rendezvous at once:
  seconds until the last one has its rank (``min_nodes = max_nodes = N``: no last call is waited for);
- **steady**: etcd's requests/s and bytes/s from the clients over ``--steady-s`` seconds of nothing happening (every
  member's ``grpc_server_msg_received_total`` and ``etcd_network_client_grpc_received_bytes_total``, summed), and
  per node;
- **node loss**: one node (not rank 0's) killed as by kill -9 and a survivor's failure notice written at that moment
  (as a survivor whose collective broke does): seconds until every survivor has the next epoch decided in place;
- **join**: a new node starts, bids, and the members admit it at their next step boundary: seconds until every
  member and the joiner have the epoch that holds it;
- the etcd database size at the end (``etcd_mvcc_db_total_size_in_bytes``, the largest member's).

Beside each figure: the CPU the simulation's processes used (cores: CPU seconds over wall seconds) and etcd's. A
design that did not form within ``--form-timeout`` at some N is recorded so (with its etcd traffic while it tried)
and not run at larger N. ``bench/control_plane_nodes.py`` holds the nodes and says what a simulated node shares.

    python bench/control_plane.py [--nodes 8 64 256 1024] [--trials 3] [--processes 4] [--nodes-per-client 1]
    python bench/control_plane.py --draw bench/results/control_plane-<commit>.json   # the picture again, from a file

Needs root (network namespaces), as the suite's host tests.
"""

from __future__ import annotations

import argparse
import functools
import json
import queue
import shutil
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/control_plane.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psutil

from bench.common import REPO_ROOT, code_revision, report_header, results_path, write_results
from bench.tables_control_plane import draw
from elasticd.endpoints import parse_endpoints
from elasticd.etcd.client import EtcdClient
from elasticd.keys import RunKeys

NODES = (8, 16, 32, 64, 256, 1024)  # issue 28 names 8, 64, 256, 1,024; 16 and 32 show where today's design stops
# The control planes measured: "today", torch's dynamic rendezvous over one shared state value (issue 28's baseline);
# "lease", elasticd's lease rendezvous (rendezvous/lease_handler.py), the rest of the node as today's.
DESIGNS = ("today", "lease")
_NODES_SCRIPT = Path(__file__).resolve().parent / "control_plane_nodes.py"
_START_TIMEOUT_S = 300.0  # starting every node's registry and leases, before the rendezvous
_CHANGE_TIMEOUT_S = 60.0  # a node loss or a join, decided in place
_GROUP = "0.sim"  # the group's name (and its first lineage token), as a round's token names its group
# etcd's metrics summed over members: what the clients sent, in messages (unary calls and stream messages: lease
# keep-alives, watches) and bytes; what it sent back
_METRICS = {
    "requests": "grpc_server_msg_received_total",
    "bytes_in": "etcd_network_client_grpc_received_bytes_total",
    "bytes_out": "etcd_network_client_grpc_sent_bytes_total",
}
_DB_SIZE = "etcd_mvcc_db_total_size_in_bytes"


class Etcd:
    """A 3-member etcd cluster on hosts of its own, read through its members' /metrics."""

    def __init__(self, stack: ExitStack, workdir: Path) -> None:
        from tests.integration.etcd_cluster import EtcdCluster  # the integration tests' cluster, as bench/hosts.py
        from tests.integration.netns import Network

        network = stack.enter_context(Network())
        self.cluster = EtcdCluster(network, workdir)
        stack.callback(self.cluster.close)
        self.cluster.start()
        self.endpoints = self.cluster.endpoints

    def metrics(self) -> dict[str, float]:
        totals = dict.fromkeys([*_METRICS, "db_size"], 0.0)
        for host in self.cluster.hosts.values():
            with urllib.request.urlopen(f"http://{host.control_addr}:2379/metrics", timeout=5) as answer:
                text = answer.read().decode()
            for line in text.splitlines():
                name = line.split("{", 1)[0].split(" ", 1)[0]
                for key, metric in _METRICS.items():
                    if name == metric:
                        totals[key] += float(line.rsplit(" ", 1)[1])
                if name == _DB_SIZE:
                    totals["db_size"] = max(totals["db_size"], float(line.rsplit(" ", 1)[1]))
        return totals

    def pids(self) -> list[int]:
        return self.cluster.pids()


def _cpu(pids: Sequence[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            times = psutil.Process(pid).cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total


class Simulation:
    """The node processes of one trial: commands out, events in (one queue for all)."""

    def __init__(
        self, stack: ExitStack, endpoints: str, run_id: str, design: str, nodes: int, processes: int, per_client: int
    ) -> None:
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.procs: list[subprocess.Popen[str]] = []
        self.home: dict[str, int] = {}  # node -> index of its process
        ids = [f"n{i:04d}" for i in range(nodes)]
        for p in range(processes):
            mine = ids[p::processes]
            proc = subprocess.Popen(
                [sys.executable, str(_NODES_SCRIPT)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
                cwd=REPO_ROOT,
                start_new_session=True,
            )
            stack.callback(self._end, proc)
            self.procs.append(proc)
            threading.Thread(target=self._read, args=(proc,), daemon=True).start()
            self.home.update(dict.fromkeys(mine, p))
            setup = {
                "endpoints": endpoints, "run_id": run_id, "design": design, "nodes": nodes, "node_ids": mine,
                "nodes_per_client": per_client,
            }  # fmt: skip
            self.send(p, setup)

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            try:
                self.events.put(json.loads(line))
            except ValueError:
                continue

    def send(self, process: int, command: dict[str, Any]) -> None:
        stdin = self.procs[process].stdin
        assert stdin is not None
        stdin.write(json.dumps(command) + "\n")
        stdin.flush()

    def to_all(self, command: dict[str, Any]) -> None:
        for p in range(len(self.procs)):
            self.send(p, command)

    def collect(self, until: Any, timeout_s: float) -> list[dict[str, Any]]:
        """Events until ``until(events so far)`` holds, or the timeout (then whatever came)."""
        got: list[dict[str, Any]] = []
        deadline = time.monotonic() + timeout_s
        while not until(got):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                got.append(self.events.get(timeout=min(remaining, 1.0)))
            except queue.Empty:
                continue
        return got

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    @staticmethod
    def _end(proc: subprocess.Popen[str]) -> None:
        with suppress(psutil.Error):
            psutil.Process(proc.pid).kill()
        with suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)


@contextmanager
def _measured(etcd: Etcd, sim: Simulation) -> Iterator[dict[str, float]]:
    """Wall seconds, etcd traffic and both sides' CPU over the block (filled in when it ends)."""
    out: dict[str, float] = {}
    before, wall = etcd.metrics(), time.monotonic()
    sim_cpu, etcd_cpu = _cpu(sim.pids()), _cpu(etcd.pids())
    yield out
    seconds = time.monotonic() - wall
    after = etcd.metrics()
    out["seconds"] = round(seconds, 3)
    for key in _METRICS:
        out[key] = after[key] - before[key]
    out["sim_cores"] = round((_cpu(sim.pids()) - sim_cpu) / seconds, 3)
    out["etcd_cores"] = round((_cpu(etcd.pids()) - etcd_cpu) / seconds, 3)


def trial(args: argparse.Namespace, design: str, nodes: int, index: int, workdir: Path) -> dict[str, Any]:
    """One trial of ``design`` at ``nodes`` on a fresh etcd: form, steady state, node loss, join."""
    result: dict[str, Any] = {"design": design, "nodes": nodes, "trial": index}
    with ExitStack() as stack:
        data = workdir / f"etcd-{design}-{nodes}-{index}"
        shutil.rmtree(data, ignore_errors=True)  # a member's data dir from an earlier run would hold its old cluster
        data.mkdir(parents=True)
        stack.callback(shutil.rmtree, data, True)
        etcd = Etcd(stack, data)
        run_id = f"cp{nodes}t{index}"
        sim = Simulation(stack, etcd.endpoints, run_id, design, nodes, args.processes, args.nodes_per_client)
        started = sim.collect(lambda got: sum(e["event"] == "started" for e in got) == len(sim.procs), _START_TIMEOUT_S)
        if sum(e["event"] == "started" for e in started) < len(sim.procs):
            result["error"] = "the simulated nodes did not start"
            return result
        with _measured(etcd, sim) as forming:
            t0 = time.time()
            sim.to_all({"do": "form"})
            got = sim.collect(
                lambda g: sum(e["event"] in ("formed", "form_failed") for e in g) >= nodes, args.form_timeout
            )
        formed = [e for e in got if e["event"] == "formed"]
        result["forming"] = forming
        result["formed_nodes"] = len(formed)
        failures = sorted({e["error"] for e in got if e["event"] == "form_failed"})
        if failures:
            result["form_errors"] = failures[:5]
        if len(formed) < nodes:
            return result
        result["form_s"] = round(max(e["t"] for e in formed) - t0, 3)
        rank_of = {e["node"]: e["rank"] for e in formed}
        by_rank = {r: n for n, r in rank_of.items()}
        _set_fence(etcd.endpoints, run_id)
        sim.to_all({"do": "arm", "group": _GROUP, "world": nodes})
        sim.collect(lambda g: sum(e["event"] == "armed" for e in g) == len(sim.procs), _START_TIMEOUT_S)
        time.sleep(1.0)  # the watches' first reads
        with _measured(etcd, sim) as steady:
            time.sleep(args.steady_s)
        result["steady"] = steady
        victim, witness = by_rank[nodes // 2], by_rank[0]
        with _measured(etcd, sim) as loss:
            t_kill = time.time()
            sim.send(sim.home[victim], {"do": "kill", "node": victim})
            sim.send(sim.home[witness], {"do": "notice", "node": witness, "text": f"{victim}: connection reset"})
            got = sim.collect(lambda g: _decided(g, 1) >= nodes - 1, _CHANGE_TIMEOUT_S)
        result["loss"] = loss
        result["loss_spread"] = _spread(got, 1, t_kill)
        if _decided(got, 1) >= nodes - 1:
            result["loss_s"] = round(
                max(e["t"] for e in got if e["event"] == "decided" and e["epoch"] == 1) - t_kill, 3
            )
        else:
            result["loss_decided"] = _decided(got, 1)
            return result
        with _measured(etcd, sim) as joining:
            t_join = time.time()
            sim.send(0, {"do": "join", "node": "joiner"})
            got = sim.collect(lambda g: _decided(g, 2) >= nodes, _CHANGE_TIMEOUT_S)
        result["join"] = joining
        result["join_spread"] = _spread(got, 2, t_join)
        if _decided(got, 2) >= nodes:
            result["join_s"] = round(
                max(e["t"] for e in got if e["event"] == "decided" and e["epoch"] == 2) - t_join, 3
            )
        else:
            result["join_decided"] = _decided(got, 2)
        result["db_size"] = etcd.metrics()["db_size"]
        sim.to_all({"do": "exit"})
    return result


def _set_fence(endpoints: str, run_id: str) -> None:
    """The round's lineage token, which rank 0 writes as its group starts: the first epoch's fence."""
    client = EtcdClient.connect(parse_endpoints(endpoints), connect_timeout_s=30)
    try:
        client.put(RunKeys(run_id).lineage_token, _GROUP)
    finally:
        client.close()


def _spread(events: Sequence[dict[str, Any]], epoch: int, t0: float) -> dict[str, float]:
    """When the nodes had ``epoch`` decided, from ``t0``: the first (the decider), the median and the last one."""
    times = sorted(e["t"] - t0 for e in events if e["event"] == "decided" and e["epoch"] == epoch)
    if not times:
        return {}
    return {"first": round(times[0], 3), "median": round(statistics.median(times), 3), "last": round(times[-1], 3)}


def _decided(events: Sequence[dict[str, Any]], epoch: int) -> int:
    return len({e["node"] for e in events if e["event"] == "decided" and e["epoch"] == epoch})


def summarize(trials: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per N: medians over the trials that got that far, and every sample."""
    rows = []
    for nodes in sorted({t["nodes"] for t in trials}):
        mine = [t for t in trials if t["nodes"] == nodes]
        row: dict[str, Any] = {"nodes": nodes, "trials": len(mine)}
        for key in ("form_s", "loss_s", "join_s", "db_size"):
            samples = [t[key] for t in mine if key in t]
            row[key] = {"median": statistics.median(samples) if samples else None, "samples": samples}
        steady = [t["steady"] for t in mine if "steady" in t]
        if steady:
            per_s = [{k: s[k] / s["seconds"] for k in _METRICS} for s in steady]
            row["steady"] = {
                "requests_per_s": statistics.median(p["requests"] for p in per_s),
                "bytes_per_s": statistics.median(p["bytes_in"] for p in per_s),
                "bytes_out_per_s": statistics.median(p["bytes_out"] for p in per_s),
                "bytes_per_node_per_s": statistics.median(p["bytes_in"] for p in per_s) / nodes,
                "sim_cores": statistics.median(s["sim_cores"] for s in steady),
                "etcd_cores": statistics.median(s["etcd_cores"] for s in steady),
            }
        for phase in ("forming", "loss", "join"):
            seen = [t[phase] for t in mine if phase in t]
            if seen:
                row[f"{phase}_cores"] = {
                    "sim": statistics.median(s["sim_cores"] for s in seen),
                    "etcd": statistics.median(s["etcd_cores"] for s in seen),
                }
        unformed = [t for t in mine if "form_s" not in t]
        if unformed:
            t = unformed[0]
            f = t.get("forming", {})
            row["not_formed"] = {
                "formed_nodes": t.get("formed_nodes"),
                "seconds": f.get("seconds"),
                "requests": f.get("requests"),
                "bytes_in": f.get("bytes_in"),
                "errors": t.get("form_errors", []),
            }
        rows.append(row)
    return rows


def run_design(
    args: argparse.Namespace, design: str, keep: Callable[[list[dict[str, Any]]], None] = lambda _trials: None
) -> list[dict[str, Any]]:
    """Every N's trials of one design; a design that did not form at some N is not run at larger N. ``keep(trials)``
    after each trial: the results so far are written, so a run stopped midway keeps what it measured."""
    trials: list[dict[str, Any]] = []
    for nodes in sorted(args.nodes):
        for index in range(args.trials):
            result = trial(args, design, nodes, index, args.workdir)
            trials.append(result)
            keep(trials)
            print(json.dumps({k: v for k, v in result.items() if not isinstance(v, dict)}), file=sys.stderr)
            if "form_s" not in result:
                return trials
    return trials


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, nargs="+", default=list(NODES))
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--processes", type=int, default=4, help="processes the simulated nodes are spread over")
    p.add_argument("--nodes-per-client", type=int, default=1, help="simulated nodes sharing one etcd client")
    p.add_argument("--form-timeout", type=float, default=60.0, help="seconds the first round may take to form")
    p.add_argument("--steady-s", type=float, default=10.0, help="seconds of steady state measured")
    p.add_argument("--designs", nargs="+", choices=DESIGNS, default=list(DESIGNS), help="control planes to measure")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--png", type=Path, default=Path("docs/control_plane.png"), help="the picture of time and bytes")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/elasticd-control-plane"))
    p.add_argument("--draw", type=Path, default=None, help="only draw --png from this results file, run nothing")
    args = p.parse_args(argv)
    if args.draw is not None:
        return 0 if draw(json.loads(args.draw.read_text()), args.png) else 1
    revision = code_revision()
    report = report_header("bench/control_plane.py", argv, revision)
    config = {
        k: getattr(args, k) for k in ("nodes", "trials", "processes", "nodes_per_client", "form_timeout", "steady_s")
    }
    report["config"] = {**config, "etcd": "3 members, etcd's default timing (100 ms heartbeat, 1 s election)"}
    began = time.monotonic()
    report["designs"] = {}
    path = args.json or results_path("control_plane", revision)

    def keep(design: str, trials: list[dict[str, Any]]) -> None:
        report["designs"][design] = {"trials": trials, "summary": summarize(trials)}
        report["duration_s"] = round(time.monotonic() - began, 1)
        write_results(path, report)

    for design in args.designs:
        keep(design, run_design(args, design, functools.partial(keep, design)))
    draw(report, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
