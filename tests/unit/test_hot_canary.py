"""The canary: every private torch/accelerate attribute hot recovery relies on is where it expects it.

When this fails after an upgrade, the message names each attribute that moved and the versions the list was checked
with: re-read that part of torch/accelerate, adapt elasticd/worker/hot/, and update CHECKED_WITH.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from accelerate.optimizer import AcceleratedOptimizer
from packaging.requirements import Requirement
from torch.nn.parallel import DistributedDataParallel

from elasticd.worker.hot.canary import CHECKED_WITH, SURFACES, problems, require_surfaces, versions_line
from elasticd.worker.hot.errors import SurfaceChanged


def test_every_private_surface_hot_recovery_relies_on_is_present_and_unchanged() -> None:
    found = problems()
    assert not found, f"hot recovery's private surfaces moved ({versions_line()}):\n" + "\n".join(found)


def test_the_list_covers_the_torch_and_accelerate_attributes_in_use() -> None:
    names = {s.name.rsplit(".", 1)[-1] for s in SURFACES}
    assert {"_update_process_group", "_push_all_rebuilt_params", "_rebuild_buckets", "_has_rebuilt_buckets"} <= names
    assert {"_shared_state", "_is_overflow"} <= names
    assert set(CHECKED_WITH) == {"torch", "accelerate"}


def test_a_missing_attribute_is_named_with_the_versions_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(DistributedDataParallel, "_update_process_group")
    with pytest.raises(SurfaceChanged) as error:
        require_surfaces()
    message = str(error.value)
    assert "torch.nn.parallel.DistributedDataParallel._update_process_group: missing" in message
    assert f"checked with torch {CHECKED_WITH['torch']}.x, accelerate {CHECKED_WITH['accelerate']}.x" in message


def test_a_changed_signature_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    def _update_process_group(self: object, new_process_group: object, reason: str) -> None: ...

    monkeypatch.setattr(DistributedDataParallel, "_update_process_group", _update_process_group)
    assert any("_update_process_group: parameters" in p for p in problems())


def test_a_reducer_without_the_rebuild_methods_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dist, "Reducer", type("Reducer", (), {}))
    found = problems()
    assert any(p.startswith("torch.distributed.Reducer._rebuild_buckets: missing") for p in found)
    assert any(p.startswith("torch.distributed.Reducer._push_all_rebuilt_params: missing") for p in found)


def test_an_overflow_flag_accelerate_no_longer_reads_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(AcceleratedOptimizer, "step_was_skipped", property(lambda self: False))
    assert any(p.startswith("accelerate.optimizer.AcceleratedOptimizer._is_overflow") for p in problems())


def test_the_nccl_path_s_surfaces_are_listed_and_belong_to_it() -> None:
    nccl = {s.name.rsplit(".", 1)[-1] for s in SURFACES if s.backend == "nccl"}
    assert {"_abort_process_group", "SHRINK_ABORT", "_get_backend", "use_distributed"} <= nccl


def test_a_moved_nccl_surface_stops_the_nccl_path_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(c10d, "_abort_process_group")
    assert any(p.startswith("torch.distributed.distributed_c10d._abort_process_group: missing") for p in problems())
    assert problems("gloo") == []
    require_surfaces("gloo")
    with pytest.raises(SurfaceChanged, match="_abort_process_group"):
        require_surfaces("nccl")


def test_a_changed_shrink_group_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    def shrink_group(ranks_to_exclude: list[int], group: object = None) -> None: ...

    monkeypatch.setattr(dist, "shrink_group", shrink_group)
    assert any(p.startswith("torch.distributed.distributed_c10d.SHRINK_ABORT: parameters") for p in problems("nccl"))


def test_pyproject_pins_torch_and_accelerate_to_the_releases_the_canary_was_checked_with() -> None:
    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]
    pins = {r.name: r.specifier for r in map(Requirement, project["dependencies"])}
    for name, checked in CHECKED_WITH.items():
        major, minor = (int(part) for part in checked.split("."))
        assert pins[name].contains(f"{checked}.0") and pins[name].contains(f"{checked}.9"), (name, pins[name])
        assert not pins[name].contains(f"{major}.{minor + 1}.0"), f"{name} {pins[name]} admits an unchecked release"
        assert not pins[name].contains(f"{major}.{minor - 1}.0"), f"{name} {pins[name]} admits an unchecked release"
