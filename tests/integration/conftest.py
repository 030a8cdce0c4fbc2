"""Fixtures of the integration tests that more than one module uses."""

from __future__ import annotations

import pytest
import torch

from tests.integration.on_hosts import undisturbed_parameters


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The final parameters of ``on_hosts``' job undisturbed: computed once per test process, for every module."""
    return undisturbed_parameters(tmp_path_factory.mktemp("undisturbed"))
