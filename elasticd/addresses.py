"""This host's addresses: is an address ours, which interface holds it, does a name resolve to loopback.

DESIGN.md "Addresses": ``--local-addr`` is the address other nodes reach this one at, for the rendezvous, the
workers' store, the probe port and the collectives. gloo and NCCL do not read it: unless told an interface
(``GLOO_SOCKET_IFNAME``, ``NCCL_SOCKET_IFNAME``) they bind the address the host name resolves to, which on a host
whose ``/etc/hosts`` maps its name to a loopback address (Debian's default) is 127.0.x.1. Peers on other hosts then
dial a loopback address and the group never forms ("Gloo connectFullMesh failed ... Connection refused"), worker
restart after worker restart. :func:`collective_env` names the interface that holds ``--local-addr`` for both.

The interfaces come from ``psutil.net_if_addrs()`` (getifaddrs(3); psutil is already installed with accelerate, and
the standard library has no portable way to list an interface's addresses). Plain sockets otherwise; no torch.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Mapping
from dataclasses import dataclass

import psutil

from elasticd import envvars
from elasticd import options as o
from elasticd.errors import ConfigError

# the collectives' interface variables, each honoured when the user set it
_IFNAME_VARS = (envvars.GLOO_SOCKET_IFNAME, envvars.NCCL_SOCKET_IFNAME)


def resolve(host: str) -> list[str]:
    """The IP addresses ``host`` (a name or an address) stands for, IPv4 first; [] when it does not resolve."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return []
    found: list[str] = []
    for family in (socket.AF_INET, socket.AF_INET6):
        for info in infos:
            address = str(info[4][0]).split("%")[0]  # an IPv6 link-local address carries its zone
            if info[0] == family and address not in found:
                found.append(address)
    return found


def interfaces() -> dict[str, list[str]]:
    """This host's interfaces and their IP addresses (this network namespace's)."""
    inet = (socket.AF_INET, socket.AF_INET6)
    return {
        name: [str(a.address).split("%")[0] for a in addrs if a.family in inet]
        for name, addrs in psutil.net_if_addrs().items()
    }


def interface_of(host: str) -> str | None:
    """The interface that holds the address ``host`` resolves to, or None: not an address of this host."""
    wanted = {ipaddress.ip_address(a) for a in resolve(host)}
    for name, addresses in interfaces().items():
        if any(ipaddress.ip_address(a) in wanted for a in addresses):
            return name
    return None


def is_loopback(host: str) -> bool:
    """Does ``host`` resolve, and to loopback addresses only?"""
    addresses = resolve(host)
    return bool(addresses) and all(ipaddress.ip_address(a).is_loopback for a in addresses)


def listen_address(advertised: str) -> str:
    """The IPv4 address to listen on so that peers dialling ``advertised`` reach us (never all interfaces unless
    ``advertised`` does not resolve to an IPv4 address)."""
    ipv4 = [a for a in resolve(advertised) if ipaddress.ip_address(a).version == 4]
    return ipv4[0] if ipv4 else "0.0.0.0"


@dataclass(frozen=True, slots=True)
class CollectiveInterface:
    """What :func:`collective_env` decided: the variables to set, and what to say about it in one start event."""

    env: dict[str, str]
    fields: dict[str, str]


def collective_env(local_addr: str, environ: Mapping[str, str]) -> CollectiveInterface:
    """The collectives' interface variables for workers of a node at ``local_addr`` (an address of this host).

    A variable the user set is kept as it is (and reported as theirs); the others name the interface that holds
    ``local_addr``."""
    interface = interface_of(local_addr)
    env: dict[str, str] = {}
    fields = {"local_addr": local_addr, "interface": str(interface)}
    for name in _IFNAME_VARS:
        if environ.get(name):
            fields[name] = f"{environ[name]} (set by the user)"
        elif interface is not None:
            env[name] = interface
            fields[name] = interface
    return CollectiveInterface(env, fields)


def check_local_addr(local_addr: str | None, etcd_hosts: list[str], max_nodes: int) -> None:
    """At the daemon's start: ``--local-addr`` must be an address of this host; left out, the host name stands for
    it, and must not be a loopback address while the nodes meet at an etcd on another host (DESIGN.md,
    "Addresses"). A :class:`ConfigError` (one line, exit 2) otherwise. Not part of resolving the configuration,
    which must give the same answer on any machine (the deployment tests resolve a pod's on theirs)."""
    if local_addr is not None:
        if interface_of(local_addr) is None:
            ours = sorted({a for found in interfaces().values() for a in found})
            raise ConfigError(
                o.LOCAL_ADDR.flag, f"{local_addr!r} is not an address of this host (its addresses: {', '.join(ours)})"
            )
        return
    if max_nodes < 2 or not etcd_hosts or all(is_loopback(host) for host in etcd_hosts):
        return  # one node, or every node on this host: loopback reaches them all
    name = socket.getfqdn()
    if is_loopback(name):
        raise ConfigError(
            o.LOCAL_ADDR.flag,
            f"not set, and this host's name {name!r} resolves to {', '.join(resolve(name))}, a loopback address, "
            f"while etcd is at {', '.join(etcd_hosts)}: nodes on other hosts could not reach this one. "
            "Set --local-addr to the address they reach this node at",
        )
