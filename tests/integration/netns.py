"""Hosts of their own for integration tests: one network namespace per node, joined by two virtual switches.

A :class:`Network` is a private network of hosts on two bridges, as a cluster's nodes are: ``data`` (what
``--local-addr`` names: the collectives, the workers' store, the liveness probes) and ``control`` (etcd). The
bridges live in a namespace of their own, the switch; the test's own namespace gets a single leg on the control
network, whose address (:attr:`Network.gateway`) is where the test's etcd listens and where the test process reaches
it from. Each host has a loopback of its own, so 127.0.0.1 there reaches nobody else, and this machine's host name
resolves to 127.0.0.1 everywhere (as Debian's ``/etc/hosts`` makes it): the setting where a node that binds its
host name's address is unreachable.

Faults are real: :meth:`Network.cut` takes the switch's side of a host's link down, so the bridge drops every frame
to and from the host without a word (no reset, as a real partition or a dead switch port does) until
:meth:`Network.heal`. Killing a process inside a host is ``Node.kill()``, as on 127.0.0.1.

Needs root and iproute2 (the suite's CI runs as root); :func:`unavailable` says why not, for a skip. Every name this
creates carries a random tag, and :meth:`Network.close` deletes every namespace it made, with their links (a veth
pair goes with either end). Processes inside must be ended first (``Cluster.close()``).
"""

from __future__ import annotations

import ipaddress
import os
import random
import secrets
import shutil
import subprocess
from dataclasses import dataclass
from typing import Literal

Link = Literal["data", "control", "all"]
DATA_SUBNET = ipaddress.ip_network("10.10.1.0/24")  # inside the switch and the hosts only: the same in every test
_IP_TIMEOUT_S = 10.0


def unavailable() -> str | None:
    """Why namespaces cannot be made here (a reason for a skip), or None."""
    if os.geteuid() != 0:
        return "network namespaces need root (the suite's CI runs as root)"
    if shutil.which("ip") is None:
        return "iproute2's ip command is not installed"
    return None


def ip(*args: str) -> str:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=_IP_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


@dataclass(frozen=True, slots=True)
class Host:
    name: str
    netns: str
    data_addr: str  # its --local-addr
    control_addr: str

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run inside this host's namespace (``ip netns exec`` execs it: the pid is the command's)."""
        return ["ip", "netns", "exec", self.netns, *argv]


class Network:
    """Hosts on a data and a control network; ``close()`` (or the context manager) deletes them all."""

    def __init__(self) -> None:
        self.tag = secrets.token_hex(3)
        self.switch = f"ed-{self.tag}-sw"
        self.hosts: dict[str, Host] = {}
        self._made: list[str] = []
        self.control = _free_subnet()
        self.gateway = str(self.control.network_address + 1)  # the test's own leg: etcd listens here
        try:
            self._make_switch()
        except BaseException:
            self.close()
            raise

    def _make_switch(self) -> None:
        ip("netns", "add", self.switch)
        self._made.append(self.switch)
        for bridge in ("data", "control"):
            ip("-n", self.switch, "link", "add", bridge, "type", "bridge")
            ip("-n", self.switch, "link", "set", bridge, "up")
        leg = f"ed{self.tag}"  # in the test's namespace: the tag keeps it apart from other tests' legs
        ip("link", "add", leg, "type", "veth", "peer", "name", "uplink", "netns", self.switch)
        ip("addr", "add", f"{self.gateway}/{self.control.prefixlen}", "dev", leg)
        ip("link", "set", leg, "up")
        ip("-n", self.switch, "link", "set", "uplink", "master", "control", "up")

    def add(self, name: str) -> Host:
        """A new host ``name`` (at most 12 characters) with an address on each network."""
        assert len(name) <= 12 and name not in self.hosts, name
        index = len(self.hosts) + 10
        host = Host(
            name,
            f"ed-{self.tag}-{name}",
            str(DATA_SUBNET.network_address + index),
            str(self.control.network_address + index),
        )
        ip("netns", "add", host.netns)
        self._made.append(host.netns)
        ip("-n", host.netns, "link", "set", "lo", "up")
        for network, address, subnet in (
            ("data", host.data_addr, DATA_SUBNET),
            ("control", host.control_addr, self.control),
        ):
            port = _port(network, name)
            ip("-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", network, "netns", host.netns)
            ip("-n", self.switch, "link", "set", port, "master", network, "up")
            ip("-n", host.netns, "addr", "add", f"{address}/{subnet.prefixlen}", "dev", network)
            ip("-n", host.netns, "link", "set", network, "up")
        self.hosts[name] = host
        return host

    def cut(self, name: str, link: Link = "all") -> None:
        """Partition host ``name`` from the data network, the control network, or both: frames are dropped."""
        for network in _links(link):
            ip("-n", self.switch, "link", "set", _port(network, name), "down")

    def heal(self, name: str, link: Link = "all") -> None:
        for network in _links(link):
            ip("-n", self.switch, "link", "set", _port(network, name), "up")

    def close(self) -> None:
        """Delete every namespace made here (their links with them; the test's leg goes with its peer)."""
        for netns in reversed(self._made):
            subprocess.run(["ip", "netns", "del", netns], capture_output=True, timeout=_IP_TIMEOUT_S)
        self._made.clear()

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _port(network: str, host: str) -> str:
    return f"{network[0]}-{host}"  # the switch's side of the host's link: d-<host>, c-<host>


def _links(link: Link) -> tuple[str, ...]:
    return ("data", "control") if link == "all" else (link,)


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 for the control network that no route of the test's namespace uses (other tests' legs included)."""
    used = [ipaddress.ip_network(r.split()[0], strict=False) for r in ip("-4", "route").splitlines() if r[:1].isdigit()]
    for _ in range(100):
        candidate = ipaddress.IPv4Network(f"10.{random.randint(64, 127)}.{random.randint(0, 255)}.0/24")
        if not any(candidate.overlaps(u) for u in used):
            return candidate
    raise RuntimeError("no free /24 in 10.64.0.0/10 for a test network")
