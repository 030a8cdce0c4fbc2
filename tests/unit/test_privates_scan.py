"""Every private torch/accelerate name elasticd's source uses is an entry of a table in ``elasticd/privates/``, and
every entry is still used. The rule the scan follows is in ``tests/private_uses.py``; it keys on names, so code that
moves between modules passes unchanged (an entry's ``used_by`` is for readers).

When the first test fails, add an entry for each name it lists (what for, a check, a fallback) to the package's
table; when the second fails, delete the entries nothing uses any more.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from elasticd.privates.check import SURFACES
from tests.private_uses import Scan, scan


@pytest.fixture(scope="module")
def found() -> Scan:
    return scan()


def test_every_private_torch_or_accelerate_name_in_use_is_listed_in_a_table(found: Scan) -> None:
    listed = {part for surface in SURFACES for part in surface.private_parts}
    unlisted = [str(use) for use in found.uses if use.name not in listed]
    assert not unlisted, "private torch/accelerate names no table in elasticd/privates/ lists:\n" + "\n".join(unlisted)


def test_every_table_entry_is_still_used(found: Scan) -> None:
    """An entry with a private part: its last private part is a use the scan found, and a public name after it
    (``torch._C._distributed_c10d.ErrorType``) is still spelled in elasticd. An entry without one is behaviour of a
    public name the hot path relies on (``Accelerator.step``), which no scan can see used."""
    used = {use.name for use in found.uses}
    stale = [
        s.name
        for s in SURFACES
        if s.private_parts and (s.private_parts[-1] not in used or s.name.rsplit(".", 1)[-1] not in found.identifiers)
    ]
    assert not stale, f"table entries nothing in elasticd/ uses any more: {stale}"


def test_standard_library_privates_are_the_allowed_ones(found: Scan) -> None:
    assert not found.stdlib_unlisted, "add to STDLIB in tests/private_uses.py, with why:\n" + "\n".join(
        map(str, found.stdlib_unlisted)
    )


def _uses(tmp_path: Path, source: str, **more: str) -> list[tuple[str, int]]:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "m.py").write_text(source)
    for name, text in more.items():
        (package / f"{name}.py").write_text(text)
    return sorted((use.name, use.line) for use in scan(tmp_path, "pkg").uses)


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import torch.distributed as d\nd._x()\n", [("_x", 2)]),
        ("from torch.distributed import _x\n", [("_x", 1)]),
        ("import torch._C._distributed_c10d as c\n", [("_C", 1), ("_distributed_c10d", 1)]),
        ("from torch._C._distributed_c10d import ErrorType\n", [("_C", 1), ("_distributed_c10d", 1)]),
        ("from accelerate.state import PartialState as P\nP._shared_state['n'] = 1\n", [("_shared_state", 2)]),
        ("import torch.nn as nn\nsetattr(nn.Module, '_y', 1)\n", [("_y", 2)]),
        ("def f(handler):\n    return handler._state_holder\n", [("_state_holder", 2)]),
    ],
)
def test_the_scan_sees_through_aliases_and_unknown_objects(
    source: str, expected: list[tuple[str, int]], tmp_path: Path
) -> None:
    assert _uses(tmp_path, source) == expected


def test_a_subclass_s_private_is_torch_s_when_its_torch_ancestor_has_it(tmp_path: Path) -> None:
    source = (
        "from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent\n"
        "class Agent(LocalElasticAgent):\n"
        "    def _start_workers(self, worker_group):\n"  # an override of torch's private step
        "        self._mine = 1\n"  # the subclass's own
        "        return self._pcontext\n"
    )
    assert _uses(tmp_path, source) == [("_pcontext", 5), ("_start_workers", 3)]


def test_elasticd_s_own_privates_are_not_torch_s_unless_torch_spells_the_name_too(tmp_path: Path) -> None:
    own = (
        "class Holder:\n"
        "    def __init__(self):\n"
        "        self._count = 0\n"
        "        self._settings = None\n"
        "    def same(self, other):\n"
        "        return other._settings\n"  # a class's code on another instance of it
    )
    source = (
        "import torch.distributed.elastic.rendezvous.dynamic_rendezvous as r\n"
        "def f(holder, handler):\n"
        "    return holder._count, handler._settings\n"  # torch's handler has _settings too
    )
    assert _uses(tmp_path, source, own=own) == [("_settings", 3)]


def test_the_standard_library_s_privates_are_allowed_by_name_or_reported(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "m.py").write_text("import os, sys\nos._exit(0)\nsys._current_frames()\n")
    found = scan(tmp_path, "pkg")
    assert found.uses == []
    assert [(u.name, u.line) for u in found.stdlib_unlisted] == [("_current_frames", 3)]
