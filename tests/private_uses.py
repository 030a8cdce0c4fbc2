"""Every private torch/accelerate name elasticd's source uses, found with ``ast`` (for ``tests/unit/test_privates.py``).

The rule, keyed on names so that code moving between modules changes nothing. Each ``._name`` in ``elasticd/`` (an
attribute read, written, deleted or defined, and ``getattr``/``setattr``/``hasattr``/``delattr`` with a literal name),
each ``from M import _name`` and each ``_``-prefixed part of an imported module path is one of:

- **torch's or accelerate's**, to be listed in a table of ``elasticd/privates/``: anything imported from a
  torch/accelerate module path with a private part or as a private name; an attribute of a name bound to a
  torch/accelerate import (``dist._x``, ``PartialState._x``, whatever the alias); ``self._x``, ``super()._x`` or a
  method/attribute ``_x`` defined in a class whose ancestors include a torch/accelerate class that has ``_x`` (read
  from the ancestors' ``vars`` and ``self._x`` in their source at test time); and any other ``obj._x`` unless one of
  the next rules makes it elasticd's own;
- **elasticd's own**: ``self._x`` in a class with no torch/accelerate ancestor (or one whose ancestors have no
  ``_x``); ``obj._x`` inside the class that defines ``_x`` (a class's code may touch its own privates on another
  instance); an attribute of a name bound to an elasticd import; and ``obj._x`` anywhere for an ``_x`` elasticd
  defines (module level, class body, ``self._x = ...``) that no torch/accelerate module elasticd imports or
  subclasses spells anywhere in its source (so ``handler._settings`` is torch's even though elasticd has a
  ``self._settings`` of its own);
- **the standard library's**, in :data:`STDLIB` (``os._exit``, ``atexit._run_exitfuncs``, namedtuple's ``_fields``).

The gap left: an object of a torch type that comes from a module elasticd neither imports nor subclasses, read for a
private name that elasticd also defines. The scan does not read ``elasticd/privates/`` itself (the tables' checks).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TABLES = Path("elasticd", "privates")  # the tables' own checks, relative to the root
THIRD_PARTY = ("torch", "accelerate")
ACCESSORS = ("getattr", "setattr", "hasattr", "delattr")
# Standard-library privates elasticd may use, each with why: module-qualified, or a bare name for a protocol.
STDLIB = {
    "os._exit": "leave at once, without atexit handlers or flushing, from a process that must not linger",
    "atexit._run_exitfuncs": "run the atexit handlers ourselves before os._exit (exit_guard.py, worker/warm.py)",
    "sys._getframe": "the script's outermost frame, traced for the SystemExit that ends it (exit_guard.py)",
    "_fields": "namedtuple's documented API (its fields, to rebuild one)",
}
_PRIVATE_WORD = re.compile(r"\b_[A-Za-z0-9]\w*\b")


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


@dataclass(frozen=True, slots=True)
class Use:
    """One place that uses a private name of torch or accelerate."""

    name: str  # the private identifier, e.g. "_worker_group"
    path: str  # relative to the repository
    line: int
    what: str  # how it is used, for the failure message

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.name} ({self.what})"


@dataclass(slots=True)
class _Candidate:
    name: str
    line: int
    what: str
    kind: str  # "third_party": theirs for sure; "self": self/super() in ``owner``; "define": defined in ``owner``
    # "other": obj._x (``owner`` the enclosing class), "own": bound to an elasticd import, "stdlib:<module>"
    owner: _Class | None = None


@dataclass(slots=True)
class _Class:
    module: str
    qualname: str
    bases: list[str]  # statically resolved dotted names
    defines: set[str] = field(default_factory=set)


@dataclass(slots=True)
class _Module:
    name: str
    path: str
    imports: dict[str, str] = field(default_factory=dict)  # local name -> dotted target
    third_party_imports: set[str] = field(default_factory=set)  # dotted targets imported from torch/accelerate
    classes: list[_Class] = field(default_factory=list)
    candidates: list[_Candidate] = field(default_factory=list)
    defines: set[str] = field(default_factory=set)  # private names defined at module level or on an instance
    identifiers: set[str] = field(default_factory=set)  # every attribute and name used, for unused table entries


def _is_third_party(dotted: str) -> bool:
    return dotted.split(".", 1)[0] in THIRD_PARTY


def _scan(path: Path, root: Path) -> _Module:
    rel = path.relative_to(root)
    name = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
    module = _Module(name, str(rel))
    _Visitor(module).visit(ast.parse(path.read_text(), str(rel)))
    return module


class _Visitor(ast.NodeVisitor):
    def __init__(self, module: _Module) -> None:
        self.m = module
        self.classes: list[_Class] = []
        self.functions = 0

    def _package(self, level: int) -> str:
        parts = self.m.name.split(".")
        if not self.m.path.endswith("__init__.py"):
            parts = parts[:-1]
        return ".".join(parts[: len(parts) - level + 1])

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._module_path(alias.name, node.lineno)
            root = alias.name.split(".")[0]
            self.m.imports[alias.asname or root] = alias.name if alias.asname else root

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:
            base = f"{self._package(node.level)}.{base}".rstrip(".")
        self._module_path(base, node.lineno)
        for alias in node.names:
            target = f"{base}.{alias.name}"
            self.m.imports[alias.asname or alias.name] = target
            self.m.identifiers.add(alias.name)
            if _is_third_party(base):
                self.m.third_party_imports.add(target)
                if is_private(alias.name):
                    self._add(alias.name, node.lineno, f"imported from {base}", "third_party")

    def _module_path(self, dotted: str, line: int) -> None:
        self.m.identifiers.update(dotted.split("."))
        if _is_third_party(dotted):
            self.m.third_party_imports.add(dotted)
            for part in dotted.split("."):
                if is_private(part):
                    self._add(part, line, f"module {dotted}", "third_party")

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        prefix = f"{self.classes[-1].qualname}." if self.classes else ""
        cls = _Class(self.m.name, prefix + node.name, [d for d in map(self._dotted, node.bases) if d])
        self.m.classes.append(cls)
        self.m.identifiers.add(node.name)
        if is_private(node.name) and not self.classes:
            self.m.defines.add(node.name)
        for statement in node.body:
            for target in _defined_names(statement):
                if is_private(target):
                    cls.defines.add(target)
                    self._add(target, statement.lineno, "defined in the class", "define", cls)
        outer, self.functions = self.functions, 0
        self.classes.append(cls)
        self.generic_visit(node)
        self.classes.pop()
        self.functions = outer

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.m.identifiers.add(node.name)
        if is_private(node.name) and not self.classes and not self.functions:
            self.m.defines.add(node.name)
        self.functions += 1
        self.generic_visit(node)
        self.functions -= 1

    visit_AsyncFunctionDef = visit_FunctionDef  # same walk for both kinds

    def visit_Assign(self, node: ast.Assign) -> None:
        if not self.classes and not self.functions:
            for target in node.targets:
                if isinstance(target, ast.Name) and is_private(target.id):
                    self.m.defines.add(target.id)
        self.generic_visit(node)

    def visit_Name(self, node: ast.Name) -> None:
        self.m.identifiers.add(node.id)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        self.m.identifiers.add(node.attr)
        if is_private(node.attr):
            self._attribute(node.value, node.attr, node.lineno, isinstance(node.ctx, ast.Store))
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Name) and func.id in ACCESSORS and len(node.args) >= 2:
            literal = node.args[1]
            if isinstance(literal, ast.Constant) and isinstance(literal.value, str):
                self.m.identifiers.add(literal.value)
                if is_private(literal.value):
                    self._attribute(node.args[0], literal.value, node.lineno, func.id == "setattr")
        self.generic_visit(node)

    def _attribute(self, value: ast.expr, name: str, line: int, stored: bool) -> None:
        owner = self.classes[-1] if self.classes else None
        shown = f"{_text(value)}.{name}"
        if owner is not None and _is_self(value):
            if stored:
                owner.defines.add(name)
            self._add(name, line, shown, "self", owner)
            return
        dotted = self._dotted(value)
        if dotted is not None and not _is_self(value):
            root = dotted.split(".", 1)[0]
            if _is_third_party(dotted):
                self._add(name, line, f"{shown}, on {dotted}", "third_party")
                return
            if root == self.m.name.split(".", 1)[0]:
                self._add(name, line, shown, "own")
                return
            if root in sys.stdlib_module_names:
                self._add(name, line, shown, f"stdlib:{dotted}")
                return
        self._add(name, line, shown, "other", owner)

    def _dotted(self, node: ast.expr) -> str | None:
        """The dotted name an expression refers to through this module's imports and classes (None: not a name)."""
        if isinstance(node, ast.Name):
            if node.id in self.m.imports:
                return self.m.imports[node.id]
            if any(c.qualname == node.id for c in self.m.classes):
                return f"{self.m.name}.{node.id}"
            return None
        if isinstance(node, ast.Attribute):
            base = self._dotted(node.value)
            return None if base is None else f"{base}.{node.attr}"
        return None

    def _add(self, name: str, line: int, what: str, kind: str, owner: _Class | None = None) -> None:
        self.m.candidates.append(_Candidate(name, line, what, kind, owner))


def _is_self(node: ast.expr) -> bool:
    if isinstance(node, ast.Name):
        return node.id in ("self", "cls")
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"


def _text(node: ast.expr) -> str:
    text = ast.unparse(node)
    return text if len(text) <= 40 else text[:37] + "..."


def _defined_names(statement: ast.stmt) -> Iterator[str]:
    if isinstance(statement, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        yield statement.name
    elif isinstance(statement, ast.Assign):
        yield from (t.id for t in statement.targets if isinstance(t, ast.Name))
    elif isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
        yield statement.target.id


def _resolve(dotted: str) -> Any:
    """The object a dotted name names (a module, or an attribute chain inside one); None when it cannot be found."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            found = getattr(found, part, None)
        return found
    return None


def _third_party_ancestors(cls: _Class) -> list[type]:
    found: list[type] = []
    for base in cls.bases:
        obj = _resolve(base)
        if isinstance(obj, type):
            found += [c for c in obj.__mro__ if c.__module__.split(".", 1)[0] in THIRD_PARTY]
    return found


def _names_of(classes: Iterable[type]) -> set[str]:
    names: set[str] = set()
    for cls in classes:
        names.update(n for n in vars(cls) if is_private(n))
        try:
            source = inspect.getsource(cls)
        except (OSError, TypeError):
            continue
        names.update(re.findall(r"\bself\.(_[A-Za-z0-9]\w*)", source))
    return names


def _source_words(objects: Iterable[Any]) -> set[str]:
    """Every private identifier spelled in the source files of these objects' modules."""
    files: set[str] = set()
    for obj in objects:
        module = obj if inspect.ismodule(obj) else inspect.getmodule(obj)
        path = getattr(module, "__file__", None)
        if path and path.endswith(".py"):
            files.add(path)
    words: set[str] = set()
    for path in files:
        words.update(_PRIVATE_WORD.findall(Path(path).read_text(errors="replace")))
    return words


@dataclass(frozen=True, slots=True)
class Scan:
    """What the scan found: the uses of torch/accelerate privates, the standard-library privates not allowed, and
    every identifier the package uses (to find table entries nothing uses any more)."""

    uses: list[Use]
    stdlib_unlisted: list[Use]
    identifiers: set[str]


def scan(root: Path = ROOT, package: str = "elasticd") -> Scan:
    """Scan every module of ``package`` under ``root``, but the tables' own (``elasticd/privates/``)."""
    paths = [p for p in sorted((root / package).rglob("*.py")) if root / TABLES not in p.parents]
    modules = {m.name: m for m in (_scan(p, root) for p in paths)}
    ancestors = {id(c): _third_party_ancestors(c) for m in modules.values() for c in m.classes}
    theirs_by_class = {key: _names_of(found) for key, found in ancestors.items()}
    imported = [_resolve(t) for m in modules.values() for t in m.third_party_imports]
    universe = _source_words([o for o in imported if o is not None] + [c for a in ancestors.values() for c in a])
    universe |= set().union(*theirs_by_class.values()) if theirs_by_class else set()
    own = set().union(*(m.defines for m in modules.values()))
    own |= {n for m in modules.values() for c in m.classes for n in c.defines if n not in theirs_by_class[id(c)]}
    uses: list[Use] = []
    stdlib: list[Use] = []
    for module in modules.values():
        for cand in module.candidates:
            use = Use(cand.name, module.path, cand.line, cand.what)
            if cand.kind == "third_party":
                uses.append(use)
            elif cand.kind in ("self", "define"):
                assert cand.owner is not None
                if cand.name in theirs_by_class[id(cand.owner)]:
                    uses.append(use)
            elif cand.kind.startswith("stdlib:"):
                if f"{cand.kind.removeprefix('stdlib:')}.{cand.name}" not in STDLIB:
                    stdlib.append(use)
            elif cand.kind == "other":
                owner = cand.owner
                if owner is not None and cand.name in owner.defines and cand.name not in theirs_by_class[id(owner)]:
                    continue
                if cand.name in STDLIB:
                    continue
                if cand.name not in own or cand.name in universe:
                    uses.append(use)
    identifiers = set().union(*(m.identifiers for m in modules.values()))
    return Scan(uses, stdlib, identifiers)
