"""Fixtures of the integration tests that more than one module uses."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from tests.integration.netns import Network
from tests.integration.on_hosts import undisturbed_parameters


@pytest.fixture
def network() -> Iterator[Network]:
    """A private network of hosts (netns.py) for one test, deleted afterwards."""
    with Network() as net:
        yield net


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The final parameters of ``on_hosts``' job undisturbed: computed once per test process, for every module."""
    return undisturbed_parameters(tmp_path_factory.mktemp("undisturbed"))


@pytest.fixture
def world_of_one() -> Iterator[None]:
    """torch's default group: gloo, this process alone (a real DDP model needs one)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
