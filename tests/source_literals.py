"""The string literals of the elasticd package's source, read with ``ast``, for the tests that prove a contract is
written in one place (import as ``tests.source_literals``).

Docstrings are prose and are not read; the constant parts of f-strings are. Each literal says where it stands, so a
test can tell a name that is spelled out from the same word used for something else: the event name of a log call
(``log.info("resumed", ...)``: the log's own vocabulary), or a field name (a dict key, a subscript, the key of
``.get``/``.pop``/``.setdefault``, the left side of ``in``).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "elasticd"

_LOG_METHODS = frozenset({"debug", "info", "warning", "error", "exception", "critical"})
_KEY_METHODS = frozenset({"get", "pop", "setdefault"})


class Role(Enum):
    VALUE = "value"  # anything else: an argument, an assignment, a comparison, a return value...
    LOG_EVENT = "log event"  # the first argument of a log call
    FIELD = "field"  # a key of a mapping


@dataclass(frozen=True, slots=True)
class Literal:
    path: str  # relative to the package, e.g. "agent/daemon.py"
    line: int
    text: str
    role: Role

    def __str__(self) -> str:
        return f"elasticd/{self.path}:{self.line}: {self.text!r} ({self.role.value})"


def literals(path: Path, name: str | None = None) -> Iterator[Literal]:
    """Every string literal of ``path`` but its docstrings, with its role."""
    tree = ast.parse(path.read_text(), filename=str(path))
    skip = _docstrings(tree)
    roles = _roles(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            yield Literal(name or path.name, node.lineno, node.value, roles.get(id(node), Role.VALUE))


def package_literals(*, outside: str) -> Iterator[Literal]:
    """The literals of every module of the package but ``outside`` (a path relative to the package)."""
    for path in sorted(PACKAGE.rglob("*.py")):
        name = str(path.relative_to(PACKAGE))
        if name != outside:
            yield from literals(path, name)


def _docstrings(tree: ast.AST) -> set[int]:
    ids: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


def _roles(tree: ast.AST) -> dict[int, Role]:
    roles: dict[int, Role] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            if node.func.attr in _LOG_METHODS:
                roles[id(node.args[0])] = Role.LOG_EVENT
            elif node.func.attr in _KEY_METHODS:
                roles[id(node.args[0])] = Role.FIELD
        elif isinstance(node, ast.Dict):
            roles.update((id(key), Role.FIELD) for key in node.keys if key is not None)
        elif isinstance(node, ast.Subscript):
            roles[id(node.slice)] = Role.FIELD
        elif isinstance(node, ast.Compare) and isinstance(node.ops[0], ast.In | ast.NotIn):
            roles[id(node.left)] = Role.FIELD
    return roles
