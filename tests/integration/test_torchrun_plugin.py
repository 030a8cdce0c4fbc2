"""The ``etcd-v3`` handler: built from torchrun's parameters in-process, and used by plain ``torchrun``
through the ``torchrun.handlers`` entry point against an etcd that serves the v3 API only."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from elasticd import envvars
from elasticd.errors import ConfigError, EtcdUnavailableError
from elasticd.etcd.server import EmbeddedEtcd
from elasticd.rendezvous import handler as rdzv
from tests.helpers import free_port, kill_tree

pytestmark = pytest.mark.integration

# Two torchrun agents plus their workers on a shared 2-core machine: each normally finishes in ~10 s.
TORCHRUN_TIMEOUT_S = 120

SCRIPT = textwrap.dedent(
    """
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    value = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(value)
    print(f"rank={dist.get_rank()} world={dist.get_world_size()} sum={value.item():g}", flush=True)
    dist.destroy_process_group()
    """
)


def _params(endpoint: str, run_id: str = "h1", **config: Any) -> RendezvousParameters:
    return RendezvousParameters("etcd-v3", endpoint, run_id, 2, 2, **config)


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Processes a test starts (each in its own process group); any still running are killed afterwards."""
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for process in started:
        kill_tree(process)


def test_two_handlers_form_a_round_with_fresh_worker_store_and_report_round_and_participants(
    etcd: EmbeddedEtcd, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(envvars.TORCH_DISABLE_SHARED_STORE, "0")  # restored after the test
    handlers = [rdzv.create_handler(_params(etcd.endpoint)) for _ in range(2)]
    assert all(isinstance(h, rdzv.ElasticdRendezvousHandler) for h in handlers)
    assert handlers[0].get_backend() == "etcd-v3"
    assert handlers[0].round is None
    with ThreadPoolExecutor(2) as pool:
        infos = list(pool.map(lambda h: h.next_rendezvous(), handlers))
    try:
        assert sorted(info.rank for info in infos) == [0, 1]
        assert {info.world_size for info in infos} == {2}
        addresses = {(i.bootstrap_store_info.master_addr, i.bootstrap_store_info.master_port) for i in infos}
        assert len(addresses) == 1  # both got rank 0's freshly picked address
        assert os.environ[envvars.TORCH_DISABLE_SHARED_STORE] == "1"
        assert not handlers[0].use_agent_store
        assert [h.round for h in handlers] == [0, 0]
        assert handlers[0].participants() == 2
        assert handlers[0].num_nodes_waiting() == 0
    finally:
        for handler in handlers:
            handler.shutdown()
    assert handlers[1].is_closed()


def test_leave_takes_a_node_out_without_closing_the_rendezvous(
    etcd: EmbeddedEtcd, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(envvars.TORCH_DISABLE_SHARED_STORE, "0")  # next_rendezvous sets it; restored after
    handlers = [rdzv.create_handler(_params(etcd.endpoint, run_id="leave")) for _ in range(2)]
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda h: h.next_rendezvous(), handlers))
    try:
        assert handlers[0].leave() is True
        deadline = time.monotonic() + 10  # participants() may serve a state cached for up to 1 s
        while handlers[1].participants() != 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert handlers[1].participants() == 1
        assert not handlers[1].is_closed()
    finally:
        handlers[1].shutdown()


def test_handler_uses_elasticd_timing_defaults(etcd: EmbeddedEtcd) -> None:
    handler = rdzv.create_handler(_params(etcd.endpoint))
    settings = handler.settings
    assert settings.keep_alive_interval.total_seconds() == rdzv.KEEP_ALIVE_INTERVAL_S == 1
    assert settings.keep_alive_max_attempt == rdzv.KEEP_ALIVE_MAX_ATTEMPT == 3
    assert settings.timeout.last_call.total_seconds() == 2
    assert settings.timeout.join.total_seconds() == 600
    assert settings.timeout.close.total_seconds() == 30
    assert settings.timeout.heartbeat.total_seconds() == 5
    tuned = rdzv.create_handler(_params(etcd.endpoint, join_timeout="60", keep_alive_interval=2))
    assert tuned.settings.timeout.join.total_seconds() == 60
    assert tuned.settings.keep_alive_interval.total_seconds() == 2


def test_bad_parameters_are_config_errors_naming_the_option(etcd: EmbeddedEtcd) -> None:
    with pytest.raises(ConfigError, match=r"^--rdzv-endpoint: "):
        rdzv.create_handler(_params("host:notaport"))
    with pytest.raises(ConfigError, match=r"^--rdzv-id: "):
        rdzv.create_handler(_params(etcd.endpoint, run_id="../escape"))
    with pytest.raises(ConfigError, match="join_timeout"):
        rdzv.create_handler(_params(etcd.endpoint, join_timeout="soon"))


def test_unreachable_etcd_fails_within_the_connect_timeout() -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    with pytest.raises(EtcdUnavailableError, match=re.escape(endpoint)):
        rdzv.create_handler(_params(endpoint, connect_timeout=1))


def test_registration_is_idempotent_and_torch_builds_our_handler(etcd: EmbeddedEtcd) -> None:
    rdzv.register()
    rdzv.register()
    assert rdzv.handler_factory() is rdzv.create_handler
    handler = get_rendezvous_handler(_params(etcd.endpoint))
    assert isinstance(handler, rdzv.ElasticdRendezvousHandler)
    with pytest.raises(ValueError, match="already registered"):
        rendezvous_handler_registry.register("etcd-v3", lambda params: handler)


def test_plain_torchrun_with_etcd_v3_backend_runs_two_nodes(
    etcd: EmbeddedEtcd, tmp_path: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    torchrun = Path(sys.executable).with_name("torchrun")
    logs = [tmp_path / f"node{i}.log" for i in range(2)]
    command = [str(torchrun), "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "etcd-v3"]
    command += ["--rdzv-endpoint", etcd.endpoint, "--rdzv-id", "t1", str(script)]
    for log in logs:
        with open(log, "wb") as out:
            processes.append(
                subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path, start_new_session=True)
            )
    codes = [process.wait(timeout=TORCHRUN_TIMEOUT_S) for process in processes]
    outputs = [log.read_text() for log in logs]
    assert codes == [0, 0], "\n\n".join(outputs)
    results = sorted(line for text in outputs for line in text.splitlines() if line.startswith("rank="))
    assert results == ["rank=0 world=2 sum=3", "rank=1 world=2 sum=3"], "\n\n".join(outputs)
