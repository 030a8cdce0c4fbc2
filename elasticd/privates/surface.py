"""What a table entry is, its fallbacks, and the small checks entries are built from.

A check returns None when the name is as elasticd relies on it, else a few words saying what is wrong. Owners are
named as ``"module:Attr.attr"`` strings and resolved when the check runs, so that reading a table imports nothing and
a test that removes an attribute sees the check fail.
"""

from __future__ import annotations

import dis
import importlib
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import StrEnum
from types import CodeType
from typing import Any

Check = Callable[[], str | None]

# The releases the tables were read from and tested with (major.minor).
CHECKED_WITH = {"torch": "2.13", "accelerate": "1.15"}


class Fallback(StrEnum):
    """What elasticd does when an entry's check fails (each is applied where :mod:`.check` says)."""

    # ``elasticd start`` exits 2 with one line naming what moved and the releases checked with; a worker's
    # ``attach`` raises the same error. For what the agent, the rendezvous handler or the non-finite guard cannot
    # do without, and for every name a daemon module imports at module level (a missing one is an ImportError).
    REFUSE_TO_START = "refuse_to_start"
    # Hot recovery is not armed (the worker logs ``hot_recovery_unsupported``): every change restarts from the
    # newest committed checkpoint, as with ``--recovery cold``.
    COLD_RECOVERY = "cold_recovery"
    # The rendezvous keeps torch's own timing: 1 s polls and the full last call (``rendezvous_polling``).
    TORCH_TIMING = "torch_timing"
    # Checkpoints are written by accelerate's ``save_state`` while training waits, as ``ELASTICD_ASYNC_CHECKPOINTS=0``.
    BLOCKING_SAVES = "blocking_saves"
    # Hang evidence has stacks and ``/proc`` state but no flight-recorder dump.
    NO_FLIGHT_RECORDER = "no_flight_recorder"
    # Workers start as new interpreters (``python -u -m elasticd.worker.launch SCRIPT``), as ``ELASTICD_WARM_START=0``.
    COLD_STARTS = "cold_starts"
    # torch names its rendezvous events itself, walking the whole stack for each (CPU, no change in behaviour).
    TORCH_EVENT_NAMES = "torch_event_names"


class Process(StrEnum):
    """The process that uses a name; the daemon checks both (its workers run in its environment)."""

    DAEMON = "daemon"
    WORKER = "worker"


@dataclass(frozen=True, slots=True)
class Surface:
    """One private name: ``name`` dotted as a reader would look it up, ``used_by`` the modules that use it (for
    readers; the source scan keys on names, not on modules), ``use`` what elasticd does with it."""

    name: str
    used_by: tuple[str, ...]
    use: str
    check: Check
    fallback: Fallback
    process: Process
    backend: str | None = None  # the one process-group backend whose path uses it; None: every backend's

    @property
    def private_parts(self) -> tuple[str, ...]:
        """The ``_``-prefixed parts of the name: what the source scan matches a use against."""
        return tuple(p for p in self.name.split(".") if p.startswith("_"))


def resolve(owner: str) -> Any:
    """``"module:Attr.attr"`` -> the object; None when the module or an attribute is gone."""
    module_name, _, path = owner.partition(":")
    try:
        found: Any = importlib.import_module(module_name)
    except ImportError:
        return None
    for part in filter(None, path.split(".")):
        found = getattr(found, part, None)
    return found


def callable_with(owner: str, *expected: str) -> Check:
    """``owner`` is callable and takes exactly the parameters ``expected``, in that order."""

    def check() -> str | None:
        function = resolve(owner)
        if function is None or not callable(function):
            return "missing"
        try:
            found = tuple(inspect.signature(function).parameters)
        except (TypeError, ValueError):
            return "its signature cannot be read"
        return None if found == expected else f"parameters {found}, expected {expected}"

    return check


def _source(owner: str) -> tuple[str, None] | tuple[None, str]:
    """(the source of ``owner``, None), or (None, what is wrong)."""
    found = resolve(owner)
    if found is None:
        return None, "missing"
    try:
        return inspect.getsource(found), None
    except (OSError, TypeError):
        return None, "its source cannot be read"


def mentions(owner: str, *needles: str) -> Check:
    """The source of ``owner`` (a function, method or class) still contains each of ``needles``."""

    def check() -> str | None:
        source, problem = _source(owner)
        if source is None:
            return problem
        absent = [n for n in needles if n not in source]
        return None if not absent else f"no longer contains {', '.join(repr(n) for n in absent)}"

    return check


def reads(owner: str, *names: str) -> Check:
    """The compiled code of the function ``owner`` still names each of ``names`` (an attribute it reads or sets, a
    global it calls), nested functions included. Read from its bytecode: no source, no tokenizing, so it is cheap
    enough for every worker's start."""

    def check() -> str | None:
        code = _code(owner)
        if code is None:
            return "missing"
        found = set(_code_names(code))
        absent = [n for n in names if n not in found]
        return None if not absent else f"no longer uses {', '.join(absent)}"

    return check


def _code(owner: str) -> CodeType | None:
    """The code object of the function ``owner``, under any ``functools.wraps`` decorator (torch's ``@prof``)."""
    function = resolve(owner)
    if not callable(function):
        return None
    code = getattr(inspect.unwrap(function), "__code__", None)
    return code if isinstance(code, CodeType) else None


def _code_names(code: CodeType) -> Iterator[str]:
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, CodeType):
            yield from _code_names(const)


def assigned(owner: str, attribute: str) -> Check:
    """The method ``owner`` (a constructor, say) still sets ``self.<attribute>`` (a store of it in its bytecode)."""

    def check() -> str | None:
        code = _code(owner)
        if code is None:
            return "missing"
        if any(i.opname == "STORE_ATTR" and i.argval == attribute for i in _instructions(code)):
            return None
        return f"no longer sets self.{attribute}"

    return check


def _instructions(code: CodeType) -> Iterator[dis.Instruction]:
    yield from dis.get_instructions(code)
    for const in code.co_consts:
        if isinstance(const, CodeType):
            yield from _instructions(const)


def has(owner: str, *attributes: str) -> Check:
    """``owner`` exists and has each of ``attributes`` (enum members, class attributes, dataclass fields)."""

    def check() -> str | None:
        found = resolve(owner)
        if found is None:
            return "missing"
        fields = getattr(found, "__dataclass_fields__", {})
        absent = [a for a in attributes if not hasattr(found, a) and a not in fields]
        return None if not absent else f"no longer has {', '.join(absent)}"

    return check


def every(*checks: Check) -> Check:
    """The first problem of ``checks``, in order (None: all hold)."""

    def check() -> str | None:
        for one in checks:
            problem = one()
            if problem is not None:
                return problem
        return None

    return check
