"""The tables of private torch/accelerate names (``elasticd/privates/``): every check holds on the installed releases,
and a name that moved is named with the releases checked and meets its fallback.

When the first test fails after an upgrade, the message names each name that moved and what elasticd uses it for:
re-read that part of torch/accelerate, adapt the user (the table's ``used_by``), and update CHECKED_WITH.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import pytest
import structlog
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from accelerate.optimizer import AcceleratedOptimizer
from packaging.requirements import Requirement
from torch.distributed.elastic.agent.server.api import SimpleElasticAgent
from torch.distributed.elastic.rendezvous import dynamic_rendezvous
from torch.nn.parallel import DistributedDataParallel

from elasticd.errors import EXIT_USAGE
from elasticd.privates.accelerate_surfaces import ACCELERATE
from elasticd.privates.check import (
    SURFACES,
    SurfacesMoved,
    check_daemon,
    check_worker,
    daemon_surfaces,
    problems,
    require,
    versions_line,
)
from elasticd.privates.surface import (
    CHECKED_WITH,
    Fallback,
    Process,
    assigned,
    callable_with,
    has,
    mentions,
    reads,
    resolve,
)
from elasticd.privates.torch_surfaces import TORCH
from elasticd.rendezvous import wakeup
from elasticd.worker.hot.errors import SurfaceChanged


def _names(moved: list[Any]) -> list[str]:
    return [m.surface.name for m in moved]


def test_every_private_name_in_the_tables_is_present_and_unchanged_in_the_installed_releases() -> None:
    found = problems()
    assert not found, f"private names moved ({versions_line()}):\n" + "\n".join(map(str, found))


def test_each_table_holds_its_own_package_s_names_once() -> None:
    assert all(s.name.startswith("torch.") for s in TORCH)
    assert all(s.name.startswith("accelerate.") for s in ACCELERATE)
    names = [s.name for s in SURFACES]
    assert len(names) == len(set(names))
    assert set(CHECKED_WITH) == {"torch", "accelerate"}


def test_a_missing_attribute_is_named_with_the_releases_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(DistributedDataParallel, "_update_process_group")
    with pytest.raises(SurfaceChanged) as error:
        require("gloo", SurfaceChanged)
    message = str(error.value)
    assert "torch.nn.parallel.DistributedDataParallel._update_process_group: missing" in message
    assert f"checked with torch {CHECKED_WITH['torch']}.x, accelerate {CHECKED_WITH['accelerate']}.x" in message


def test_a_changed_signature_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    def _update_process_group(self: object, new_process_group: object, reason: str) -> None: ...

    monkeypatch.setattr(DistributedDataParallel, "_update_process_group", _update_process_group)
    assert any("_update_process_group: parameters" in str(p) for p in problems())


def test_a_reducer_without_the_rebuild_methods_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dist, "Reducer", type("Reducer", (), {}))
    found = [str(m) for m in problems()]
    assert any(p.startswith("torch.distributed.Reducer._rebuild_buckets: missing") for p in found)
    assert any(p.startswith("torch.distributed.Reducer._push_all_rebuilt_params: missing") for p in found)


def test_an_overflow_flag_accelerate_no_longer_reads_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(AcceleratedOptimizer, "step_was_skipped", property(lambda self: False))
    assert _names(problems()) == ["accelerate.optimizer.AcceleratedOptimizer._is_overflow"]


def test_the_nccl_path_s_names_are_listed_and_belong_to_it() -> None:
    nccl = {s.name.rsplit(".", 1)[-1] for s in SURFACES if s.backend == "nccl"}
    assert {"_abort_process_group", "SHRINK_ABORT", "_get_backend", "use_distributed", "ErrorType"} <= nccl


def test_a_moved_nccl_name_stops_the_nccl_hot_path_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(c10d, "_abort_process_group")
    assert _names(problems()) == ["torch.distributed.distributed_c10d._abort_process_group"]
    require("gloo", SurfaceChanged)
    with pytest.raises(SurfaceChanged, match="_abort_process_group"):
        require("nccl", SurfaceChanged)


def test_a_changed_shrink_group_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    def shrink_group(ranks_to_exclude: list[int], group: object = None) -> None: ...

    monkeypatch.setattr(dist, "shrink_group", shrink_group)
    assert any(str(p).startswith("torch.distributed.distributed_c10d.SHRINK_ABORT: parameters") for p in problems())


def test_the_daemon_refuses_to_start_on_a_moved_agent_private_with_one_line_and_exit_2(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delattr(SimpleElasticAgent, "_exit_barrier")
    with structlog.testing.capture_logs() as logs, pytest.raises(SurfacesMoved) as error:
        check_daemon(structlog.get_logger())
    message = str(error.value)
    assert error.value.exit_code == EXIT_USAGE
    assert "\n" not in message
    assert "SimpleElasticAgent._exit_barrier: missing" in message
    assert f"checked with torch {CHECKED_WITH['torch']}.x" in message
    event = next(e for e in logs if e["event"] == "private_surfaces_moved")
    assert event["process"] == "daemon" and event["fallbacks"] == ["refuse_to_start"]


def test_a_moved_hot_path_private_is_left_to_the_workers_arm_which_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(DistributedDataParallel, "_update_process_group")
    with structlog.testing.capture_logs() as logs:
        assert check_daemon(structlog.get_logger()) == []  # the daemon starts: its workers recover cold
    assert [e["event"] for e in logs] == ["private_surfaces_checked"]
    with pytest.raises(SurfaceChanged, match="_update_process_group"):
        require("gloo", SurfaceChanged)


def test_the_daemon_logs_one_event_when_nothing_moved() -> None:
    with structlog.testing.capture_logs() as logs:
        assert check_daemon(structlog.get_logger()) == []
    assert [(e["event"], e["checked"]) for e in logs] == [("private_surfaces_checked", len(daemon_surfaces()))]


def test_the_daemon_checks_its_own_entries_and_every_refusing_one_and_the_workers_check_the_rest() -> None:
    left = set(SURFACES) - set(daemon_surfaces())
    assert left and all(s.process is Process.WORKER and s.fallback is not Fallback.REFUSE_TO_START for s in left)
    arm = {s for s in SURFACES if s.fallback is Fallback.COLD_RECOVERY}  # require()'s
    attach = {s for s in SURFACES if s.process is Process.WORKER and s.fallback is not Fallback.COLD_RECOVERY}
    assert left <= arm | attach


def test_a_worker_blocks_its_saves_when_what_asynchronous_saves_copy_moved(monkeypatch: pytest.MonkeyPatch) -> None:
    from accelerate import Accelerator

    monkeypatch.setattr(Accelerator, "save_state", lambda self, output_dir=None: None)
    with structlog.testing.capture_logs() as logs:
        assert check_worker(structlog.get_logger()) == {Fallback.BLOCKING_SAVES}
    assert any(e["event"] == "private_surfaces_moved" and e["process"] == "worker" for e in logs)


def test_a_worker_refuses_to_attach_when_the_guard_s_overflow_flag_moved(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(AcceleratedOptimizer, "step_was_skipped", property(lambda self: False))
    with pytest.raises(SurfacesMoved, match=r"AcceleratedOptimizer\._is_overflow"):
        check_worker(structlog.get_logger())


def test_a_worker_checks_nothing_of_the_daemon_s_and_leaves_the_hot_path_s_to_its_arm(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delattr(SimpleElasticAgent, "_exit_barrier")
    monkeypatch.delattr(DistributedDataParallel, "_update_process_group")
    assert check_worker(structlog.get_logger()) == frozenset()


def test_the_rendezvous_keeps_torch_s_timing_when_its_delay_moved(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dynamic_rendezvous, "_delay", lambda secs: None)
    assert any("_delay: parameters" in p for p in wakeup.surface_problems())
    assert wakeup.install() is False
    assert dynamic_rendezvous._delay is not wakeup._delay


def test_every_entry_says_who_uses_it_and_what_for() -> None:
    for surface in SURFACES:
        assert surface.used_by and all(m.startswith("elasticd.") for m in surface.used_by), surface.name
        assert surface.use and isinstance(surface.process, Process), surface.name


def test_pyproject_pins_torch_and_accelerate_to_the_releases_the_tables_were_checked_with() -> None:
    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]
    pins = {r.name: r.specifier for r in map(Requirement, project["dependencies"])}
    for name, checked in CHECKED_WITH.items():
        major, minor = (int(part) for part in checked.split("."))
        assert pins[name].contains(f"{checked}.0") and pins[name].contains(f"{checked}.9"), (name, pins[name])
        assert not pins[name].contains(f"{major}.{minor + 1}.0"), f"{name} {pins[name]} admits an unchecked release"
        assert not pins[name].contains(f"{major}.{minor - 1}.0"), f"{name} {pins[name]} admits an unchecked release"


def test_attach_under_moved_saver_privates_gives_a_run_whose_saves_block(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from accelerate import Accelerator

    from elasticd.worker.run import attach
    from elasticd.worker.settings import WorkerSettings

    settings = WorkerSettings(checkpoint_dir=tmp_path)
    accelerator = Accelerator(cpu=True)
    assert attach(accelerator, settings).settings.asynchronous
    monkeypatch.setattr(Accelerator, "save_state", lambda self, output_dir=None: None)
    assert not attach(accelerator, settings).settings.asynchronous


class _Sample:
    def method(self, a: int, b: int = 0) -> object:
        self._set = a
        return self._read  # type: ignore[attr-defined]  # never called: only its bytecode is read


_OWNER = f"{_Sample.__module__}:_Sample.method"


@pytest.mark.parametrize(
    ("check", "expected"),
    [
        (callable_with(_OWNER, "self", "a", "b"), None),
        (callable_with(_OWNER, "self", "a"), "parameters ('self', 'a', 'b'), expected ('self', 'a')"),
        (callable_with(f"{_Sample.__module__}:_Sample.gone", "self"), "missing"),
        (reads(_OWNER, "_read", "_set"), None),
        (reads(_OWNER, "_other"), "no longer uses _other"),
        (assigned(_OWNER, "_set"), None),
        (assigned(_OWNER, "_read"), "no longer sets self._read"),
        (mentions(_OWNER, "return self._read"), None),
        (mentions(_OWNER, "self._gone"), "no longer contains 'self._gone'"),
        (has(f"{_Sample.__module__}:_Sample", "method", "gone"), "no longer has gone"),
    ],
)
def test_each_kind_of_check_holds_on_what_is_there_and_names_what_is_not(check: Any, expected: str | None) -> None:
    assert check() == expected


def test_an_owner_whose_module_is_gone_resolves_to_nothing() -> None:
    assert resolve("elasticd_no_such_module:x") is None
