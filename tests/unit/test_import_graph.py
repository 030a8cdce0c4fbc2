"""The package's import graph points down: no import cycle, and no module imports one of a layer above its own.

Read from the source with ``ast``; nothing is imported. What counts as module A importing module B: every ``import B``
or ``from B import name`` statement in A, wherever it stands: at module level, inside a function (a deferred import
still runs, only later) and under ``if TYPE_CHECKING:`` (a type-only import is a dependency all the same: mypy
follows it, and it becomes a runtime one the day the name is needed at run time; a Protocol breaks it instead, as
``worker/hot_path.py``'s ``RunPort`` does). ``from P import name`` imports the module ``P.name`` when there is one,
else ``P``; relative imports are resolved. Not an edge: the parent packages Python initialises on the way
(``import a.b`` runs ``a/__init__.py`` first, which is never *imported by* its submodules), and imports of other
distributions (torch, accelerate, ...).

The layers, top first, are :data:`LAYERS`: a module may import its own layer or any below it. Every module must be
in exactly one layer, so a new module is placed on purpose.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.source_literals import PACKAGE

# (the layer's name, its modules: a package folder ends in "/", paths are relative to elasticd/), top first.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("entry points", ("__main__.py", "cli.py", "demo/")),
    ("the daemon and the commands", ("agent/", "status.py", "control.py")),
    # what the daemon runs and the commands show: the worker library (with its public face, elasticd/__init__.py),
    # the rendezvous, the daemon's configuration, the status command's live view
    (
        "the worker library and the rendezvous",
        (
            "__init__.py",
            "worker/",
            "rendezvous/",
            "config.py",
            "config_file.py",
            "accelerate_env.py",
            "status_watch.py",
        ),
    ),
    # what the daemon, the workers and the commands all read
    ("the shared readers", ("node_records.py", "group_record.py", "liveness_probe.py", "status_snapshot.py")),
    # the client, the embedded server, the run's records in etcd
    ("etcd", ("etcd/", "lineage.py", "membership.py")),
    # the contracts (options, environment, exit codes, keys, layout, messages, board, metrics) and what they need
    (
        "the contracts",
        (
            "options.py",
            "option_values.py",
            "envvars.py",
            "endpoints.py",
            "errors.py",
            "keys.py",
            "layout.py",
            "messages.py",
            "board.py",
            "metrics.py",
            "logging.py",
            "procid.py",
            "parentdeath.py",
            "rundir.py",
            "addresses.py",
            # the private torch/accelerate names elasticd relies on, and their start-up check
            "privates/",
        ),
    ),
)

# Never imports the daemon, whatever the layers say: the worker library runs in the training script's process, the
# rendezvous under plain torchrun too, and the status commands must not pay for (or depend on) the daemon.
NEVER_IMPORT_THE_DAEMON = ("worker/", "rendezvous/", "__init__.py", "status.py", "status_watch.py", "control.py")
DAEMON = "agent/"


@dataclass(frozen=True, slots=True)
class Import:
    importer: str  # a module's path relative to its package root, e.g. "agent/daemon.py"
    line: int
    imported: str

    def __str__(self) -> str:
        return f"elasticd/{self.importer}:{self.line} imports elasticd/{self.imported}"


def modules(root: Path) -> dict[str, str]:
    """Dotted name -> path relative to ``root`` of every module of the package at ``root``."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = [root.name, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = str(path.relative_to(root))
    return found


def imports(root: Path) -> Iterator[Import]:
    """Every import of one module of the package at ``root`` by another (see the module docstring)."""
    names = modules(root)
    for name, rel in names.items():
        package = name if rel.endswith("__init__.py") else name.rpartition(".")[0]
        for node in ast.walk(ast.parse((root / rel).read_text(), filename=rel)):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            for target in _targets(node, package, names):
                if target != name:
                    yield Import(rel, node.lineno, names[target])


def _targets(node: ast.Import | ast.ImportFrom, package: str, names: dict[str, str]) -> Iterator[str]:
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names if alias.name in names)
    else:
        base = node.module or ""
        if node.level:
            up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
            base = ".".join([*up, *([node.module] if node.module else [])])
        for alias in node.names:
            submodule = f"{base}.{alias.name}"
            if submodule in names:
                yield submodule
            elif base in names:
                yield base


def layer_of(module: str) -> int | None:
    """The index in :data:`LAYERS` (0: the top) of ``module`` (a path relative to the package), None if unlisted."""
    found = [i for i, (_, members) in enumerate(LAYERS) for m in members if _in(module, m)]
    return found[0] if len(found) == 1 else None


def _in(module: str, member: str) -> bool:
    return module.startswith(member) if member.endswith("/") else module == member


def cycles(edges: list[Import]) -> list[list[Import]]:
    """One cycle through each strongly connected part of the graph: each set of modules that all import each other,
    directly or not, is reported once, by its shortest cycle through its first module."""
    graph: dict[str, dict[str, Import]] = {}
    for edge in edges:
        graph.setdefault(edge.importer, {}).setdefault(edge.imported, edge)
    found: list[list[Import]] = []
    seen: set[str] = set()
    for start in sorted(graph):
        path = None if start in seen else _path_back(graph, start)
        if path:
            found.append(path)
            seen.update(m for m in _reachable(graph, start) if start in _reachable(graph, m))
    return found


def _reachable(graph: dict[str, dict[str, Import]], start: str) -> set[str]:
    found, frontier = {start}, [start]
    while frontier:
        frontier = [t for m in frontier for t in graph.get(m, {}) if t not in found]
        found.update(frontier)
    return found


def _path_back(graph: dict[str, dict[str, Import]], start: str) -> list[Import] | None:
    """The shortest chain of imports from ``start`` back to itself, if any (breadth first)."""
    came_by: dict[str, Import] = {}
    frontier = [start]
    while frontier:
        following = []
        for module in frontier:
            for target, edge in sorted(graph.get(module, {}).items()):
                if target == start:
                    chain = [edge]
                    while chain[0].importer != start:
                        chain.insert(0, came_by[chain[0].importer])
                    return chain
                if target not in came_by:
                    came_by[target] = edge
                    following.append(target)
        frontier = following
    return None


def _explain(cycle: list[Import]) -> str:
    return "import cycle: " + ", then ".join(str(edge) for edge in cycle)


def _layer_name(module: str) -> str:
    index = layer_of(module)
    return "unlisted" if index is None else LAYERS[index][0]


@pytest.fixture(scope="module")
def package_imports() -> list[Import]:
    return list(imports(PACKAGE))


def test_every_module_is_in_exactly_one_layer() -> None:
    unplaced = [f"elasticd/{m}" for m in modules(PACKAGE).values() if layer_of(m) is None]
    assert not unplaced, "place each in exactly one layer of LAYERS (tests/unit/test_import_graph.py): " + ", ".join(
        unplaced
    )


def test_the_import_graph_has_no_cycle(package_imports: list[Import]) -> None:
    found = [_explain(cycle) for cycle in cycles(package_imports)]
    assert not found, "\n".join(found)


def test_no_module_imports_one_of_a_layer_above_its_own(package_imports: list[Import]) -> None:
    upward = [
        f"{edge}: a module of {_layer_name(edge.importer)!r} imports one of {_layer_name(edge.imported)!r}, above it"
        for edge in package_imports
        if (low := layer_of(edge.importer)) is not None and (high := layer_of(edge.imported)) is not None and high < low
    ]
    assert not upward, "\n".join(upward)


def test_the_worker_library_the_rendezvous_and_the_status_commands_never_import_the_daemon(
    package_imports: list[Import],
) -> None:
    wrong = [
        str(edge)
        for edge in package_imports
        if any(_in(edge.importer, m) for m in NEVER_IMPORT_THE_DAEMON) and _in(edge.imported, DAEMON)
    ]
    assert not wrong, "\n".join(wrong)


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "pkg"
    for rel, text in {"__init__.py": "", **files}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_the_reader_counts_deferred_type_only_relative_and_from_package_imports(tmp_path: Path) -> None:
    root = _package(
        tmp_path,
        {
            "a.py": "def f():\n    from pkg import b\n",
            "b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.sub.c import X\n",
            "sub/__init__.py": "",
            "sub/c.py": "from .. import d\nimport torch\n",
            "d.py": "from pkg import VERSION\nimport pkg.sub\n",
        },
    )
    found = {(edge.importer, edge.line, edge.imported) for edge in imports(root)}
    assert found == {
        ("a.py", 2, "b.py"),
        ("b.py", 3, "sub/c.py"),
        ("sub/c.py", 1, "d.py"),
        ("d.py", 1, "__init__.py"),
        ("d.py", 2, "sub/__init__.py"),
    }


def test_a_cycle_is_named_import_by_import(tmp_path: Path) -> None:
    files = {"a.py": "import pkg.b\n", "b.py": "x = 1\nfrom pkg import c\n", "c.py": "import pkg.a\n"}
    root = _package(tmp_path, files)
    assert [_explain(cycle) for cycle in cycles(list(imports(root)))] == [
        "import cycle: elasticd/a.py:1 imports elasticd/b.py, then elasticd/b.py:2 imports elasticd/c.py, "
        "then elasticd/c.py:1 imports elasticd/a.py"
    ]
