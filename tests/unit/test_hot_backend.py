"""What re-forming asks of each backend, as far as it can be checked without a GPU (no process, no network).

The NCCL class itself only runs where torch has NCCL and a GPU is visible (bench/gpu_check.sh); here it must refuse
cleanly, and its pure parts (the shrink decision, the environment it needs) must hold.
"""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from elasticd import envvars
from elasticd.worker.hot.backend import (
    GlooGroups,
    NcclGroups,
    collective_device,
    groups_for,
    groups_named,
    require_nccl,
    shrink_exclusions,
    worker_env,
)
from elasticd.worker.hot.errors import UnsupportedSetup

TIMEOUT = timedelta(seconds=30)


def test_gloo_is_picked_by_its_name() -> None:
    groups = groups_named("gloo", timeout=TIMEOUT, environ={})
    assert isinstance(groups, GlooGroups) and groups.timeout == TIMEOUT
    assert not groups.can_shrink(object())  # type: ignore[arg-type]  # the point: not a group


def test_nccl_refuses_in_one_line_where_torch_has_no_nccl_or_no_gpu() -> None:
    if dist.is_nccl_available() and torch.cuda.is_available():
        pytest.skip("this machine can run NCCL: bench/gpu_check.sh is the check here")
    with pytest.raises(UnsupportedSetup) as error:
        groups_named("nccl", timeout=TIMEOUT, environ=dict(NcclGroups.env))
    message = str(error.value)
    assert message.startswith("hot recovery does not support NCCL here: ") and "\n" not in message
    assert ("has no NCCL" in message) or ("no CUDA device" in message)


@pytest.fixture
def gpu_visible(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch claims NCCL and a GPU, so that the checks after those two run on this CPU-only machine."""
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


@pytest.mark.parametrize("mode", [None, "1", "3", " 3 "])
def test_nccl_refuses_an_error_handling_mode_that_ends_the_process(gpu_visible: None, mode: str | None) -> None:
    environ = {} if mode is None else {envvars.TORCH_NCCL_ASYNC_ERROR_HANDLING: mode}
    with pytest.raises(UnsupportedSetup) as error:
        require_nccl(environ)
    shown = "3" if mode is None else mode  # unset: torch's default, 3, tears the process down
    assert f"TORCH_NCCL_ASYNC_ERROR_HANDLING={shown}" in str(error.value)


@pytest.mark.parametrize("mode", ["0", "2"])
def test_nccl_accepts_the_modes_that_keep_the_process(gpu_visible: None, mode: str) -> None:
    require_nccl({envvars.TORCH_NCCL_ASYNC_ERROR_HANDLING: mode})


def test_an_unknown_backend_is_named() -> None:
    with pytest.raises(UnsupportedSetup) as error:
        groups_named("mpi", timeout=TIMEOUT, environ={})
    assert "the 'mpi' backend" in str(error.value) and "gloo or nccl" in str(error.value)


def test_a_job_without_a_process_group_is_refused() -> None:
    with pytest.raises(UnsupportedSetup, match="without a process group"):
        groups_for(None, timeout=TIMEOUT, environ={})


def test_the_daemon_sets_the_nccl_defaults_unless_the_user_chose() -> None:
    assert worker_env({}) == {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",  # abort the communicators, keep the process
        "TORCH_NCCL_USE_COMM_NONBLOCKING": "1",  # an abort from another thread cannot hang
    }
    assert worker_env({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0", "PATH": "/bin"}) == {
        "TORCH_NCCL_USE_COMM_NONBLOCKING": "1"
    }


def test_a_pure_shrink_excludes_the_lost_ranks_the_same_way_on_every_survivor() -> None:
    # 4 -> [0, 2, 3] (old rank 1 lost): each survivor passes the same list and finds the same exclusions
    survivors = [0, 2, 3]
    assert {shrink_exclusions(4, old, survivors, new) == [1] for new, old in enumerate(survivors)} == {True}
    assert shrink_exclusions(3, 2, [1, 2], 1) == [0]  # rank 0 lost: the others move down


def test_a_change_that_is_not_a_pure_shrink_gets_a_new_communicator() -> None:
    assert shrink_exclusions(3, 2, [2, 0], 0) is None  # survivors reordered (the most advanced first)
    assert shrink_exclusions(2, 0, [0, 1], 0) is None  # nobody lost


@pytest.mark.parametrize(
    ("old_rank", "previous", "rank"),
    [(1, [0, 2], 1), (0, [0, 0], 0), (0, [0, 5], 0), (0, [0], 3)],
)
def test_previous_ranks_that_contradict_the_member_are_a_callers_bug(
    old_rank: int, previous: list[int], rank: int
) -> None:
    with pytest.raises(ValueError):
        shrink_exclusions(3, old_rank, previous, rank)


def test_collectives_run_on_the_groups_gpu_for_nccl_and_on_the_cpu_for_gloo() -> None:
    assert collective_device(SimpleNamespace(bound_device_id=None, name=lambda: "gloo")) == torch.device("cpu")
    bound = SimpleNamespace(bound_device_id=torch.device("cuda", 1), name=lambda: "nccl")
    assert collective_device(bound) == torch.device("cuda", 1)
