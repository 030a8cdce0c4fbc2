"""Shared fixtures: a real etcd per test (``etcd``) and a client connected to it (``etcd_client``); every test leaves
the logging configuration as it found it."""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from elasticd.endpoints import parse_endpoints
from elasticd.etcd.client import EtcdClient
from elasticd.etcd.server import EmbeddedEtcd
from tests.helpers import ETCD_READY_TIMEOUT_S


@pytest.fixture(autouse=True)
def _logging_as_found() -> Iterator[None]:
    """A test that runs the CLI in-process configures logging to write to the ``sys.stderr`` of that moment: under
    ``capsys``, a capture file closed when the test ends. Any later test of the same process that logs (through
    ``elasticd.logging``) would then fail with "I/O operation on closed file"; which test comes later depends on
    the order, so with pytest-xdist it varies. Restore structlog's configuration and the root logger's handlers."""
    config = structlog.get_config()
    handlers, level = list(logging.root.handlers), logging.root.level
    try:
        yield
    finally:
        structlog.configure(**config)
        logging.root.handlers[:] = handlers
        logging.root.setLevel(level)


@pytest.fixture(autouse=True)
def _own_local_runs(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Each test its own per-user runtime directory, where daemons with an embedded etcd publish their run and
    ``elasticd status`` without ``--etcd`` looks (``etcd/local_runs.py``): never another test's run, nor the host's."""
    directory = Path(tempfile.mkdtemp(prefix="xdg-runtime-"))  # 0700
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(directory))
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EmbeddedEtcd]:
    """A real etcd (v3 API only) on free loopback ports, data in tmp_path, no fsync; stopped afterwards."""
    server = EmbeddedEtcd(data_dir=tmp_path / "etcd", unsafe_no_fsync=True)
    server.start(ready_timeout_s=ETCD_READY_TIMEOUT_S)
    try:
        yield server
    finally:
        server.stop()
        # its data is never what a failure is read from (etcd.log is), and it holds a 64 MB preallocated WAL
        shutil.rmtree(server.data_dir / "data", ignore_errors=True)


@pytest.fixture
def etcd_client(etcd: EmbeddedEtcd) -> Iterator[EtcdClient]:
    """An ``EtcdClient`` connected to the ``etcd`` fixture, closed after the test."""
    client = EtcdClient.connect(parse_endpoints(etcd.endpoint), connect_timeout_s=ETCD_READY_TIMEOUT_S)
    try:
        yield client
    finally:
        client.close()
