"""Ending a worker without the interpreter's teardown, and without losing what the teardown would have done.

A step that fails in place gives up on its in-flight all-reduces (a failure notice, a deadline, another bucket's
error). Gloo in torch 2.13 cannot cancel them: each stays pending in one of the old group's threads until a peer
closes its connection, and that peer may be a survivor that gave up on the same collective and closes only when its
process ends. The failure then runs the hook's completion callback, a Python function, on gloo's thread. If this
process is tearing its interpreter down at that moment, taking the GIL ends gloo's thread with a forced unwind that
C++ cannot carry through ``Future::setError``, and the process aborts: "terminate called after throwing an instance
of 'gloo::IoException'", exit -6 after a run that finished (a core dump showed ``Future::setError`` ->
``~PythonFunctionGuard`` -> ``gil_scoped_acquire`` -> ``PyThread_exit_thread`` -> ``std::terminate``). Neither the
callback nor the collective can be taken back. The hot path's fallback exits (``hot_path.py``) skip the teardown
for a related reason: dropping the abandoned gloo group waits out its pending collective (minutes).

So such a process ends through :func:`exit_now` (a fallback exit, with its code) or, when the run closes with a
given-up collective pending, through :func:`install` (at interpreter exit). Either way it ends as Python would have
ended it, less the teardown, which is where the danger lies (exit handlers run before it, while the interpreter
still serves any thread):

- every exit handler runs (``atexit``: the checkpoint writer's settling, logging's, ``weakref.finalize``'s, the
  user's);
- every file the process still holds open for writing is flushed and closed, outer layers first, as the teardown's
  finalisers would (text over buffers over raw files: a gzip stream gets its trailer), and the std streams are
  flushed. The files are found in gc's list of live objects, which is read only: nothing is collected (a collection
  would run arbitrary finalisers, an abandoned group's among them);
- the status is Python's: the code of a ``SystemExit`` that ended the script (``sys.exit(n)``, ``raise
  SystemExit(n)``, ``exit(n)``; None is 0, a message is 1), 1 after any other exception that escaped it, else 0.
  Python gives exit handlers none of this, so from :func:`install` on the guard watches the script's outermost
  frame on the main thread (a trace function on that frame only: the exceptions that pass through it, and whether it
  returned or unwound). The thread then runs in the interpreter's tracing mode, new frames untraced: what the
  script runs after ``run.close()`` pays for it in Python-level speed, in this rare case only.

Not done: the ``__del__`` of objects still alive (the teardown's clearing of modules, which Python does not promise
at exit either: one of them could be the group that waits out its collective); and :func:`exit_now`, called from
the training loop, does not wait for non-daemon threads (a fallback must not hang on them).
"""

from __future__ import annotations

import atexit
import contextlib
import dis
import gc
import io
import os
import sys
import threading
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any, NoReturn

# The instructions that end a frame normally; a frame that leaves at any other one is unwinding an exception.
_RETURNS = frozenset({"RETURN_VALUE", "RETURN_CONST"})
_Trace = Callable[[FrameType, str, Any], Any]


def exit_now(code: int) -> NoReturn:
    """End the process with status ``code`` now, without the interpreter's teardown: after every exit handler and
    with every file open for writing flushed and closed (see the module docstring)."""
    atexit._run_exitfuncs()
    _close_files()
    os._exit(code)


def install(log: Callable[..., Any] | None = None, *, pending: int = 0) -> None:
    """Skip the interpreter's teardown at this process's exit (idempotent). ``log``: told once, with ``pending``."""
    if isinstance(getattr(sys.excepthook, "__self__", None), _Guard):
        return
    guard = _Guard(sys.excepthook)
    sys.excepthook = guard.excepthook
    if threading.current_thread() is threading.main_thread():
        guard.watch(_outermost(sys._getframe()))
    atexit.register(guard.exit_now)
    if log is not None:
        log("teardown_skipped_at_exit", pending_collectives=pending, reason="collectives given up on still pending")


class _Guard:
    """What Python would make of this process's exit status, from what it saw since :func:`install`."""

    def __init__(self, excepthook: Callable[[type[BaseException], BaseException, TracebackType | None], Any]) -> None:
        self._excepthook = excepthook
        self._failed = False  # an exception escaped the script (sys.excepthook is never called for SystemExit)
        self._passing: BaseException | None = None  # the last exception that passed through the outermost frame
        self._ended_by: SystemExit | None = None  # the SystemExit the outermost frame unwound with

    def excepthook(self, kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        self._failed = True
        self._excepthook(kind, value, tb)

    def watch(self, frame: FrameType) -> None:
        """Trace ``frame`` alone (a tracer already there, a debugger's, is chained, never replaced)."""
        chained: _Trace | None = frame.f_trace

        def trace(traced: FrameType, event: str, arg: Any) -> _Trace:
            nonlocal chained
            if event == "exception":
                self._passing = arg[1]
            elif event == "return":
                unwound = dis.opname[traced.f_code.co_code[traced.f_lasti]] not in _RETURNS
                self._ended_by = self._passing if unwound and isinstance(self._passing, SystemExit) else None
            if chained is not None:
                chained = chained(traced, event, arg)
            return trace

        if chained is None:
            frame.f_trace_lines = False  # exceptions and the return are all it needs
        frame.f_trace = trace
        if sys.gettrace() is None:  # a frame's own tracer runs only while the thread traces at all
            sys.settrace(_no_new_frames)

    def status(self) -> int:
        if self._ended_by is not None:
            code = self._ended_by.code
            if code is None:
                return 0
            # the OS keeps the low byte of what Python passes on; a message Python printed already means 1
            return code & 0xFF if isinstance(code, int) else 1
        return 1 if self._failed else 0

    def exit_now(self) -> None:
        # Registered at install, so called before the handlers registered earlier: they run in exit_now().
        atexit.unregister(self.exit_now)
        exit_now(self.status())


def _no_new_frames(_frame: FrameType, _event: str, _arg: Any) -> None:
    """The thread's trace function: new frames are not traced (only the outermost one is, by its own tracer)."""
    return None


def _outermost(frame: FrameType) -> FrameType:
    while frame.f_back is not None:
        frame = frame.f_back
    return frame


def _layer(file: io.IOBase) -> int:
    """Closing order: text over Python-written binary wrappers (gzip, bz2) over the C buffers over raw files."""
    if isinstance(file, io.TextIOBase):
        return 0
    if isinstance(file, io.BufferedIOBase):
        return 1 if type(file).__module__ != "_io" else 2
    return 3


def _close_files() -> None:
    std = [sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__, sys.stdin, sys.__stdin__]
    layers = [s for s in std if s is not None]
    keep = {id(s) for s in layers} | {id(getattr(s, "buffer", None)) for s in layers}
    keep |= {id(getattr(getattr(s, "buffer", None), "raw", None)) for s in layers}
    files = sorted((o for o in gc.get_objects() if isinstance(o, io.IOBase) and id(o) not in keep), key=_layer)
    for file in files:
        with contextlib.suppress(Exception):  # closed, detached, a broken pipe: nothing more can reach it
            if not file.closed and file.writable():
                file.close()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            if stream is not None:
                stream.flush()
