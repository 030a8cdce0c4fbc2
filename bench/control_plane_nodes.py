"""One process's share of ``bench/control_plane.py``'s simulated nodes: elasticd's own control-plane code, no workers.

A simulated node is what a daemon and its one worker put into etcd, made of the same classes:

- the daemon's registry record (:class:`~elasticd.agent.registry.NodeRegistry`, 10 s lease) and its liveness lease
  (:class:`~elasticd.agent.node_lease.NodeLease`, ``membership/alive/<node>``, holding the rendezvous name too);
- its rendezvous handler (``rendezvous/handler.py``'s :func:`build_handler`: torch's dynamic rendezvous over
  elasticd's etcd backend, with the liveness-lease rule of ``use_liveness_lease``);
- once the round formed, its worker's part of recovery in place: its member record and listener
  (:class:`~elasticd.liveness_probe.ProbeListener`, which the deciders probe), the failure watch
  (:class:`~elasticd.worker.hot.watch.FailureWatch`), and bids and decisions through
  :class:`~elasticd.membership.Membership` with the deciders' verdicts
  (:class:`~elasticd.worker.hot.verdicts.Verdicts`), decided as ``worker/hot/session.py``'s ``_decide`` does it
  (``worker/hot/decide.py``: one decider, the others wait).

What differs from a real node, and why it does not change what etcd sees: no torch process group and no training (a
step boundary is a look every :data:`STEP_S` at whether a joiner waits); a kill stops the node's threads and closes its
listener at once (its leases then expire in etcd as a killed daemon's do), and a survivor whose collective the kill
broke writes the failure notice, as a real one does first thing. What the nodes of one process share, so that the
simulation's threads do not measure the host (a thread per node and per task, a thousand nodes on two cores, starved
the interpreter and the leases lapsed):

- an etcd client (one gRPC connection) per ``--nodes-per-client`` nodes; a daemon has two of its own and each worker
  one;
- the liveness leases' refreshes: :class:`LeaseTicker` calls each node's ``NodeLease.tick`` (what its own thread
  would run) from a pool of 16 threads, as often as the node's own thread would;
- the step boundaries: :class:`Stepper` looks at every member every :data:`STEP_S`; a member that re-forms or admits
  does it on a thread of its own.

The orchestrator speaks JSON lines: commands on stdin, events on stdout, each with a wall-clock ``t`` (every process
of the benchmark runs on one machine).
"""

from __future__ import annotations

import json
import resource
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/control_plane_nodes.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from torch.distributed.elastic.rendezvous import RendezvousParameters

from elasticd.agent.node_lease import NodeLease
from elasticd.agent.registry import NodeRegistry
from elasticd.endpoints import parse_endpoints
from elasticd.etcd.client import EtcdClient, EtcdError
from elasticd.keys import RunKeys
from elasticd.liveness_probe import ProbeListener
from elasticd.membership import Bid, Epoch, Membership
from elasticd.rendezvous.handler import build_handler
from elasticd.rendezvous.lease_handler import create_lease_handler
from elasticd.worker.hot.decide import decide
from elasticd.worker.hot.verdicts import Verdicts
from elasticd.worker.hot.watch import FailureWatch

# today: torch's dynamic rendezvous (rendezvous/handler.py); lease: elasticd's lease rendezvous (lease_handler.py)
DESIGNS = ("today", "lease")
# How often a member looks whether joiners wait, as a worker does at each optimizer step boundary (seconds).
STEP_S = 0.1
# A member's wait for an epoch to be decided before it gives up (session.py's DECIDE_TIMEOUT_S is 120 s).
DECIDE_TIMEOUT_S = 120.0


def emit(event: str, **fields: Any) -> None:
    sys.stdout.write(json.dumps({"event": event, "t": time.time(), **fields}) + "\n")
    sys.stdout.flush()


@dataclass
class Group:
    """The group training in place, as a member knows it: its name, epoch, members in rank order and fence."""

    name: str
    epoch: int
    members: tuple[str, ...]
    fence: str


class SimNode:
    """One simulated daemon and its one worker."""

    def __init__(self, client: EtcdClient, run_id: str, node_id: str, nodes: int, design: str) -> None:
        self.client = client
        self.keys = RunKeys(run_id)
        self.node_id = node_id
        self.listener = ProbeListener("127.0.0.1")
        self.address = f"127.0.0.1:{self.listener.port}"
        self.registry = NodeRegistry(client, self.keys, node_id, probe=self.address)
        self.lease = NodeLease(client, self.keys, node_id)
        params = RendezvousParameters(
            backend="etcd-v3", endpoint="", run_id=run_id, min_nodes=nodes, max_nodes=nodes, local_addr="127.0.0.1"
        )
        self.design = design
        if design == "lease":
            self.handler: Any = create_lease_handler(params, self.lease, client)
        else:
            self.handler = build_handler(client, params)
        self.membership = Membership(client, self.keys)
        self.rank: int | None = None
        self.member = f"join-{node_id}.0"
        self.group: Group | None = None
        self.watch: FailureWatch | None = None
        self.verdicts: Verdicts | None = None
        self.killed = threading.Event()

    def start(self, ticker: LeaseTicker) -> None:
        """What a daemon does before its rendezvous: claim its record, hold its leases (the liveness lease refreshed
        by the process's ticker)."""
        self.registry.claim()
        self.registry.start_keepalive()
        self.lease.start(own_thread=False)
        ticker.add(self.lease)
        if self.design == "today":
            self.handler.use_liveness_lease(self.lease.hold)

    def form(self) -> int:
        info = self.handler.next_rendezvous()
        self.rank = info.rank
        return info.world_size

    def arm(self, group: str, world: int) -> None:
        """The worker's start in place (``session.start``): its member record, then the watch on the group."""
        assert self.rank is not None
        self.member = f"{group}.{self.rank}"
        record = {"node": self.node_id, "addr": self.address}
        self.client.put(self.keys.membership_member(self.member), json.dumps(record))
        members = tuple(f"{group}.{r}" for r in range(world))
        self.group = Group(group, 0, members, fence=f"{group}")
        self._follow()

    def _follow(self) -> None:
        assert self.group is not None
        if self.verdicts is None:  # one per group, as session.py's (its records and verdicts are kept)
            self.verdicts = Verdicts(self.client, self.keys, self.group.name)
        if self.watch is None:
            self.watch = FailureWatch(
                self.client, self.keys, self.group.name, daemon_answers=lambda n: self._verdicts().daemon_answers(n)
            )
        self.watch.follow(self.group.epoch, self._verdicts().nodes_of(self.group.members))

    def _verdicts(self) -> Verdicts:
        assert self.verdicts is not None
        return self.verdicts

    def kill(self) -> None:
        """As kill -9 of the daemon and its worker: everything stops at once, nothing is said to etcd."""
        self.killed.set()
        self.listener.close()
        self.lease._stop.set()  # the keep-alive thread ends; the lease expires in etcd
        self.registry._stop.set()
        self.registry._wake.set()
        if self.design == "lease":
            self.handler.stop()
        else:
            self.handler._stop_heartbeats()
        if self.watch is not None:
            self.watch.close()

    def notice(self, text: str) -> None:
        """What a survivor whose collective the kill broke writes first thing (``session._recover``)."""
        assert self.group is not None
        self.client.create(self.keys.membership_notice(self.group.name, self.group.epoch), f"{self.member}: {text}")

    def reform(self, reason: str) -> Epoch:
        """Bid for the next epoch and decide it with the others (``session._recover`` and ``admit``)."""
        assert self.group is not None
        target = self.group.epoch + 1
        self.membership.bid(target, Bid(self.member, self.group.members.index(self.member), 0))
        decision = self._decide(target, reason)
        self._enter(decision)
        return decision

    def _decide(self, target: int, reason: str) -> Epoch:
        """As ``session._decide``: one decider (``worker/hot/decide.py``), the others wait for its decision."""
        assert self.group is not None
        group, verdicts = self.group, self._verdicts()

        def attempt() -> Epoch | None:
            return self.membership.try_decide(
                target,
                group.members,
                lambda m: verdicts.is_dead(m, target - 1),
                min_members=1,
                round_=0,
                reason=reason,
                fence=group.fence,
                out=verdicts.out_of(target - 1),
            )

        is_gone = lambda m: verdicts.is_gone(m, target - 1)  # noqa: E731
        return decide(self.membership, target, group.members, self.member, is_gone, attempt, DECIDE_TIMEOUT_S)

    def _enter(self, decision: Epoch) -> None:
        assert self.group is not None
        self.group = Group(self.group.name, decision.number, decision.members, decision.token)
        self._follow()

    def join(self) -> Epoch:
        """A joiner's worker (``session._join``): bid with no old rank, wait until an epoch takes it."""
        record = {"node": self.node_id, "addr": self.address}
        self.client.put(self.keys.membership_member(self.member), json.dumps(record))
        while True:
            found = self.membership.current()
            target = 1 if found is None else found[0].number + 1
            self.membership.bid(target, Bid(self.member, None, 0))
            decision = self.membership.wait(target, DECIDE_TIMEOUT_S)
            if decision is None:
                raise TimeoutError(f"epoch {target} was not decided within {DECIDE_TIMEOUT_S:g} s")
            if self.member in decision.members:
                return decision

    def step_boundary(self) -> str | None:
        """What the worker's hook finds at a step boundary: a failure notice or a lease gone fails the step
        (``failure``: re-form), a joiner waiting moves the group to the next epoch (``join``: admit)."""
        watch = self.watch
        if self.killed.is_set() or watch is None:
            return None
        return "failure" if watch.reason() is not None else "join" if watch.joiners() else None


class LeaseTicker:
    """Refreshes the liveness leases of this process's nodes from a few threads, each lease every ``refresh_s``
    (``NodeLease.tick``, the code a daemon's own lease thread runs). A thread per node (a thousand, waking four times
    a second) starved the process: its leases lapsed while their answers waited for the interpreter, which measured
    the host, not the design. etcd sees the same refreshes."""

    def __init__(self, threads: int = 16) -> None:
        self._leases: list[NodeLease] = []
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="sim-lease")
        threading.Thread(target=self._run, name="sim-lease-ticker", daemon=True).start()

    def add(self, lease: NodeLease) -> None:
        with self._lock:
            self._leases.append(lease)

    def remove(self, lease: NodeLease) -> None:
        with self._lock:
            self._leases.remove(lease)

    def _run(self) -> None:
        while True:
            began = time.monotonic()
            with self._lock:
                leases = list(self._leases)
            list(self._pool.map(NodeLease.tick, leases))
            interval = min((lease.refresh_s for lease in leases), default=0.25)
            time.sleep(max(interval - (time.monotonic() - began), 0.0))


class Stepper:
    """The step boundaries of this process's members, every :data:`STEP_S` (one thread, not one per node): a member
    that must re-form or admit does it on a thread of its own, as its worker would, and is stepped again after."""

    def __init__(self, on_decided: Callable[[SimNode, str, Epoch], None]) -> None:
        self._on_decided = on_decided
        self._nodes: list[SimNode] = []
        self._busy: set[str] = set()
        self._lock = threading.Lock()
        threading.Thread(target=self._run, name="sim-steps", daemon=True).start()

    def add(self, node: SimNode) -> None:
        with self._lock:
            self._nodes.append(node)

    def _run(self) -> None:
        while True:
            time.sleep(STEP_S)
            with self._lock:
                idle = [n for n in self._nodes if n.node_id not in self._busy and not n.killed.is_set()]
            for node in idle:
                reason = node.step_boundary()
                if reason is not None:
                    with self._lock:
                        self._busy.add(node.node_id)
                    threading.Thread(target=self._reform, args=(node, reason), daemon=True).start()

    def _reform(self, node: SimNode, reason: str) -> None:
        try:
            self._on_decided(node, reason, node.reform(reason))
        except (EtcdError, TimeoutError) as exc:
            emit("decide_failed", node=node.node_id, error=str(exc))
            node.killed.set()  # as a worker that gave up: stepped no more
        finally:
            with self._lock:
                self._busy.discard(node.node_id)


def _raise_open_files() -> None:
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def main() -> int:
    _raise_open_files()
    setup = json.loads(sys.stdin.readline())
    if setup["design"] not in DESIGNS:
        raise SystemExit(f"unknown control plane design {setup['design']!r}")
    endpoints = parse_endpoints(setup["endpoints"])
    per_client = int(setup["nodes_per_client"])
    clients: list[EtcdClient] = []
    nodes: dict[str, SimNode] = {}

    def client_for(index: int) -> EtcdClient:
        while len(clients) <= index // per_client:
            clients.append(EtcdClient.connect(endpoints, connect_timeout_s=30))
        return clients[index // per_client]

    ticker = LeaseTicker()

    def decided(node: SimNode, reason: str, decision: Epoch) -> None:
        emit("decided", node=node.node_id, reason=reason, epoch=decision.number, members=len(decision.members))

    stepper = Stepper(decided)

    def make(node_id: str, index: int) -> SimNode:
        node = SimNode(client_for(index), setup["run_id"], node_id, int(setup["nodes"]), setup["design"])
        node.start(ticker)
        nodes[node_id] = node
        return node

    def in_thread(fn: Callable[[], None]) -> None:
        threading.Thread(target=fn, daemon=True).start()

    for index, node_id in enumerate(setup["node_ids"]):
        make(node_id, index)
    emit("started", nodes=len(nodes))
    for line in sys.stdin:
        command = json.loads(line)
        what = command["do"]
        if what == "form":
            for node in list(nodes.values()):

                def form(node: SimNode = node) -> None:
                    try:
                        world = node.form()
                    except Exception as exc:  # torch's RendezvousError and its kin: reported, the bench judges
                        emit("form_failed", node=node.node_id, error=f"{type(exc).__name__}: {exc}")
                        return
                    emit("formed", node=node.node_id, rank=node.rank, world=world)

                in_thread(form)
        elif what == "arm":
            for node in nodes.values():
                node.arm(command["group"], int(command["world"]))
                stepper.add(node)
            emit("armed", nodes=len(nodes))
        elif what == "kill":
            ticker.remove(nodes[command["node"]].lease)
            nodes[command["node"]].kill()
            emit("killed", node=command["node"])
        elif what == "notice":
            nodes[command["node"]].notice(command["text"])
        elif what == "join":
            node = make(command["node"], len(nodes))

            def join(node: SimNode = node) -> None:
                decision = node.join()
                emit(
                    "decided", node=node.node_id, reason="joined", epoch=decision.number, members=len(decision.members)
                )

            in_thread(join)
        elif what == "exit":
            break
    return 0


if __name__ == "__main__":
    sys.exit(main())
