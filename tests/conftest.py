"""Shared fixtures: a real etcd per test (``etcd``) and a client connected to it (``etcd_client``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from elasticd.etcd.client import EtcdClient
from elasticd.etcd.endpoints import parse_endpoints
from elasticd.etcd.server import EmbeddedEtcd
from tests.helpers import ETCD_READY_TIMEOUT_S


@pytest.fixture(autouse=True)
def _fresh_structlog() -> Iterator[None]:
    """Code under test may configure structlog in this process (``Run`` does, the daemon's setup does), binding
    the ``sys.stderr`` of that moment: pytest's capture file of that test, closed when it ends. A later test on the
    same pytest process (test order varies with xdist) would then log into a closed file."""
    yield
    structlog.reset_defaults()


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EmbeddedEtcd]:
    """A real etcd (v3 API only) on free loopback ports, data in tmp_path, no fsync; stopped afterwards."""
    server = EmbeddedEtcd(data_dir=tmp_path / "etcd", unsafe_no_fsync=True)
    server.start(ready_timeout_s=ETCD_READY_TIMEOUT_S)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def etcd_client(etcd: EmbeddedEtcd) -> Iterator[EtcdClient]:
    """An ``EtcdClient`` connected to the ``etcd`` fixture, closed after the test."""
    client = EtcdClient.connect(parse_endpoints(etcd.endpoint), connect_timeout_s=ETCD_READY_TIMEOUT_S)
    try:
        yield client
    finally:
        client.close()
