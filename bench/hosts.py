"""Where a benchmark job's nodes run: all on 127.0.0.1 (:class:`Loopback`, the default), or each on a host of its
own (:class:`Namespaces`, ``bench/recovery.py --netns``).

A placement owns what differs between the two and nothing else: the address a node advertises (its
``--local-addr``), how its command line is started (inside its host's network namespace), where etcd listens, what
torchrun's workers need to bind the right interface, whether a node's store port is open, and the one fault only
separate hosts have: cutting a host off the network. The jobs themselves are the same code either way.

The hosts are ``tests/integration/netns.py``'s: one network namespace per node on a data and a control network
(veth pairs on two Linux bridges in a switch namespace); the benchmark's own namespace has a leg on the control
network only (:attr:`Network.gateway`: etcd listens there). It is imported only by ``--netns``, so the default run
needs nothing from ``tests/``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from bench.common import Node, listening_on

if TYPE_CHECKING:
    from tests.integration.etcd_cluster import EtcdCluster
    from tests.integration.netns import Host, Network

LOOPBACK = "127.0.0.1"
# tests/integration/netns.py names each host's interface after its network: gloo binds "data" (torchrun's workers
# get GLOO_SOCKET_IFNAME; elasticd derives it from --local-addr itself).
DATA_INTERFACE = "data"
# What a --netns result says about its network (bench/recovery.py's JSON config "network").
NETNS_NETWORK = (
    "each node in its own network namespace, veth pairs on a Linux bridge, data and control networks: the workers'"
    " gloo and torchrun's c10d store, hosted by n0, on the data network; elasticd's etcd on the control network's"
    " gateway, in the benchmark's own namespace"
)
_TCP_LISTEN = "0A"  # /proc/net/tcp's state column for LISTEN


class Placement(Protocol):
    """Where the nodes of one job run."""

    @property
    def etcd_host(self) -> str:
        """The address etcd listens on, reachable from every node."""
        ...

    @property
    def interface(self) -> str | None:
        """The interface workers' collectives must bind (GLOO_SOCKET_IFNAME), or None for gloo's own choice."""
        ...

    def local_addr(self, name: str) -> str:
        """Node ``name``'s address: its ``--local-addr``, and where a store it hosts is reached."""
        ...

    def command(self, name: str, argv: list[str]) -> list[str]:
        """``argv`` as node ``name`` runs it."""
        ...

    def listening(self, node: Node, port: int) -> bool:
        """Whether a process of ``node`` listens on TCP ``port``."""
        ...


class Loopback:
    """Every node on this host's 127.0.0.1: the benchmark as it has always run."""

    etcd_host = LOOPBACK
    interface: str | None = None

    def local_addr(self, name: str) -> str:
        return LOOPBACK

    def command(self, name: str, argv: list[str]) -> list[str]:
        return argv

    def listening(self, node: Node, port: int) -> bool:
        return listening_on(node, port)


class Namespaces:
    """Each node on a host of its own in ``network``, made the first time the node is named.

    :meth:`isolate` cuts a host off both networks (frames dropped at the switch, no reset); :meth:`heal` undoes it."""

    interface: str | None = DATA_INTERFACE

    def __init__(self, network: Network) -> None:
        self.network = network
        self.etcd_cluster: EtcdCluster | None = None  # a job on a 3-member etcd: its members, on hosts of this network

    @property
    def etcd_host(self) -> str:
        return self.network.gateway

    def host(self, name: str) -> Host:
        return self.network.hosts.get(name) or self.network.add(name)

    def local_addr(self, name: str) -> str:
        return self.host(name).data_addr

    def command(self, name: str, argv: list[str]) -> list[str]:
        return self.host(name).command(argv)

    def listening(self, node: Node, port: int) -> bool:
        # psutil matches sockets against the benchmark's own /proc/net/tcp; the node's namespace has its own, which
        # /proc/<pid>/net/ shows. Only this node runs in its namespace, so any listener on the port is its.
        return listening_in(Path(f"/proc/{node.proc.pid}/net"), port)

    def isolate(self, name: str) -> None:
        self.network.cut(name, "all")

    def heal(self, name: str) -> None:
        self.network.heal(name, "all")


def listening_in(net_dir: Path, port: int) -> bool:
    """Whether ``net_dir``'s ``tcp`` or ``tcp6`` table (a ``/proc/<pid>/net``) has a listener on ``port``."""
    for table in ("tcp", "tcp6"):
        try:
            lines = (net_dir / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            # "  0: 0A0A010A:1F90 00000000:0000 0A ...": local address:port in hex, then the remote, then the state
            if len(fields) > 3 and fields[3] == _TCP_LISTEN and int(fields[1].rsplit(":", 1)[1], 16) == port:
                return True
    return False
