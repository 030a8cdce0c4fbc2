"""A 3-member etcd cluster for integration tests, each member on a host of its own (``netns.py``).

What a production job's etcd is: three members with etcd's default timing (100 ms heartbeat, 1 s election
timeout), each on its own address of the control network, so that a member can be killed (:meth:`EtcdCluster.kill`,
SIGKILL: its leadership is lost as in a crash) or partitioned (:meth:`EtcdCluster.cut`: its host's control link
down at the switch, frames dropped without a reset) and quorum lost for real (two members cut). Its
:attr:`EtcdCluster.endpoints` is the ``--etcd`` value the nodes get (all three members: the client fails over).

The members run inside their hosts' namespaces; the test's namespace reaches them through the network's gateway
leg (``Network.gateway``), which is how :meth:`EtcdCluster.leader` asks each member who leads.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from elasticd.etcd.server import find_etcd_binary
from tests.integration.netns import Host, Network

CLIENT_PORT = 2379
PEER_PORT = 2380
_POLL_S = 0.1
_REQUEST_TIMEOUT_S = 0.5


class EtcdCluster:
    """Members ``names`` of one etcd cluster, each on a new host of ``network``; ``close()`` ends them all."""

    def __init__(self, network: Network, workdir: Path, names: tuple[str, ...] = ("etcd1", "etcd2", "etcd3")) -> None:
        self.network = network
        self.workdir = workdir
        self.hosts: dict[str, Host] = {name: network.add(name) for name in names}
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._binary = find_etcd_binary()

    @property
    def endpoints(self) -> str:
        return ",".join(f"{h.control_addr}:{CLIENT_PORT}" for h in self.hosts.values())

    def start(self, timeout_s: float = 60) -> None:
        for name in self.hosts:
            self._launch(name)
        self.wait_healthy(timeout_s)

    def _launch(self, name: str) -> None:
        host = self.hosts[name]
        peers = ",".join(f"{n}=http://{h.control_addr}:{PEER_PORT}" for n, h in self.hosts.items())
        client_url = f"http://{host.control_addr}:{CLIENT_PORT}"
        peer_url = f"http://{host.control_addr}:{PEER_PORT}"
        command = [
            self._binary,
            f"--name={name}",
            f"--data-dir={self.workdir / name}",  # kept across kill and restart: a member that crashed comes back
            f"--listen-client-urls={client_url}",
            f"--advertise-client-urls={client_url}",
            f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster={peers}",
            f"--initial-cluster-token={self.network.tag}",
            "--initial-cluster-state=new",  # ignored once the data dir holds the member
            "--unsafe-no-fsync",  # the suite's disk is not under test here; the consensus is
        ]
        env = {k: v for k, v in os.environ.items() if not k.startswith("ETCD_")}
        with (self.workdir / f"{name}.log").open("ab") as log:
            self._procs[name] = subprocess.Popen(
                host.command(command), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                start_new_session=True,
            )  # fmt: skip

    def wait_healthy(self, timeout_s: float = 60, members: tuple[str, ...] | None = None) -> None:
        """Until each of ``members`` (default: every running one) answers /health with a leader elected."""
        names = members or tuple(n for n in self.hosts if self.running(n))
        deadline = time.monotonic() + timeout_s
        while not all(self._healthy(n) for n in names):
            for name in names:
                code = self._procs[name].poll()
                if code is not None:
                    raise RuntimeError(f"etcd member {name} exited {code}:\n{self.log_tail(name)}")
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"etcd members {names} not healthy within {timeout_s:g}s:\n{self.log_tail(names[0])}"
                )
            time.sleep(_POLL_S)

    def pids(self) -> list[int]:
        """The running members' processes."""
        return [proc.pid for proc in self._procs.values() if proc.poll() is None]

    def running(self, name: str) -> bool:
        proc = self._procs.get(name)
        return proc is not None and proc.poll() is None

    def leader(self) -> str | None:
        """The member that leads, as the members that answer say (None: none answers, or none has a leader)."""
        statuses = {name: self._status(name) for name in self.hosts}
        ids = {str(s["header"]["member_id"]): name for name, s in statuses.items() if s is not None}
        leaders = {str(s["leader"]) for s in statuses.values() if s is not None and s.get("leader")}
        return next((ids[i] for i in leaders if i in ids), None)

    def follower(self) -> str:
        leader = self.leader()
        return next(n for n in self.hosts if n != leader and self.running(n))

    def kill(self, name: str) -> None:
        """SIGKILL the member: a crash (its data dir stays, :meth:`restart` brings it back)."""
        proc = self._procs[name]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)

    def restart(self, name: str, timeout_s: float = 60) -> None:
        assert not self.running(name), name
        self._launch(name)
        self.wait_healthy(timeout_s, members=(name,))

    def cut(self, name: str) -> None:
        """Partition the member from the other members and from every client (its control link down)."""
        self.network.cut(name, "control")

    def heal(self, name: str) -> None:
        self.network.heal(name, "control")

    def close(self) -> None:
        for proc in self._procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=10)

    def log_tail(self, name: str, lines: int = 20) -> str:
        path = self.workdir / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def __enter__(self) -> EtcdCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _url(self, name: str) -> str:
        return f"http://{self.hosts[name].control_addr}:{CLIENT_PORT}"

    def _healthy(self, name: str) -> bool:
        try:
            with urllib.request.urlopen(f"{self._url(name)}/health", timeout=_REQUEST_TIMEOUT_S) as response:
                return bool(json.loads(response.read()).get("health") == "true")
        except (OSError, ValueError, urllib.error.URLError):
            return False

    def _status(self, name: str) -> dict[str, Any] | None:
        if not self.running(name):
            return None
        request = urllib.request.Request(f"{self._url(name)}/v3/maintenance/status", data=b"{}", method="POST")
        try:
            with urllib.request.urlopen(request, timeout=_REQUEST_TIMEOUT_S) as response:
                return dict(json.loads(response.read()))
        except (OSError, ValueError, urllib.error.URLError):
            return None
