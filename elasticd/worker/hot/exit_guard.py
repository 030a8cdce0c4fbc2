"""Ending a worker while a collective it gave up on is still pending in gloo: no interpreter teardown.

A step that fails in place gives up on its in-flight all-reduces (a failure notice, a deadline, another bucket's
error). Gloo in torch 2.13 cannot cancel them: each stays pending in one of the old group's threads until a peer
closes its connection, and that peer may be a survivor that gave up on the same collective and closes only when its
process ends. The failure then runs the hook's completion callback, a Python function, on gloo's thread. If this
process is tearing its interpreter down at that moment, taking the GIL ends gloo's thread with a forced unwind that
C++ cannot carry through ``Future::setError``, and the process aborts: "terminate called after throwing an instance
of 'gloo::IoException'", exit -6 after a run that finished (a core dump showed ``Future::setError`` ->
``~PythonFunctionGuard`` -> ``gil_scoped_acquire`` -> ``PyThread_exit_thread`` -> ``std::terminate``). Neither the
callback nor the collective can be taken back.

So when the run closes with such a collective pending, :func:`install` arranges the exit: at interpreter exit it runs
every other exit handler first (the background checkpoint writer's, logging's, the user's), flushes, and ends the
process with ``os._exit`` before the teardown. The status is the one Python would give for an exception that
escaped the script (1) or else 0; Python does not tell exit handlers the code of a ``sys.exit(n)``, so a script that
calls ``sys.exit(n)`` after ``run.close()`` exits 0 in this one case.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
from collections.abc import Callable
from types import TracebackType
from typing import Any

_state: dict[str, Any] = {"installed": False, "failed": False}


def install(log: Callable[..., Any] | None = None, *, pending: int = 0) -> None:
    """Skip the interpreter's teardown at this process's exit (idempotent). ``log``: told once, with ``pending``."""
    if _state["installed"]:
        return
    _state["installed"] = True
    previous = sys.excepthook

    def excepthook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        _state["failed"] = True  # an exception escaped the script: Python would exit 1
        previous(kind, value, tb)

    sys.excepthook = excepthook
    atexit.register(_exit_now)
    if log is not None:
        log("teardown_skipped_at_exit", pending_collectives=pending, reason="collectives given up on still pending")


def _exit_now() -> None:
    # Registered last, so called first: the other handlers run here, then nothing else of the teardown does.
    atexit.unregister(_exit_now)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed or broken stream: nothing more to write to it
            stream.flush()
    os._exit(1 if _state["failed"] else 0)
