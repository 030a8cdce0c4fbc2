"""A warm start: a process forked from the daemon's warm server becomes ``python -u SCRIPT ARGS``.

A new interpreter spends ~2.6 s of CPU importing torch and accelerate, and the script's first optimizer pulls in
``torch._dynamo`` (~2 s more: ``torch.optim`` wraps its methods in ``torch._disable_dynamo``, which imports it on
the first call). Every cold restart and every joining node pays it again, on every worker. The daemon keeps one
process that imported them (Python's ``multiprocessing`` forkserver, preloaded with :func:`preload_for`); each
worker is forked from it and runs :func:`run`, which gives the script what ``python -u SCRIPT ARGS`` gives: its
``sys.argv``, ``__main__``, ``sys.path[0]``, the environment torch built for the rank (``os.environ``, and so
``getenv`` in native code), unbuffered output, a session of its own (torch signals the process group), the
variables the interpreter reads only at start-up (``PYTHONFAULTHANDLER``, ``OMP_NUM_THREADS``), the exit code of
an uncaught exception or ``sys.exit``, and ``atexit`` handlers. Like the launcher (``launch.py``) it dies with its
parent, the warm server, which exits when the daemon does. The idea of a preloaded fork server for fast worker
starts is Python's own (``multiprocessing.forkserver``, used by PyTorch's ``DataLoader`` users for the same cost).
"""

from __future__ import annotations

import ast
import atexit
import faulthandler
import io
import multiprocessing
import os
import runpy
import signal
import sys
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TextIO

from elasticd import envvars
from elasticd.errors import EXIT_ORPHANED
from elasticd.parentdeath import set_parent_death_signal

# Imported by the warm server for every script (``torch._dynamo``: see above).
PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "accelerate")
# Imported too when the script imports them by name: heavy, and free of per-rank state at import.
PRELOAD_IF_IMPORTED = ("transformers", "datasets", "safetensors", "numpy", "torchvision")


def preload_for(script: Path) -> list[str]:
    """The modules the warm server imports for ``script``: :data:`PRELOAD`, and those of
    :data:`PRELOAD_IF_IMPORTED` that the script imports at its top level (read with ``ast``, never run)."""
    try:
        tree = ast.parse(script.read_bytes(), filename=str(script))
    except (OSError, SyntaxError, ValueError):
        return list(PRELOAD)
    imported: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            imported.add(node.module.split(".")[0])
    return [*PRELOAD, *(name for name in PRELOAD_IF_IMPORTED if name in imported)]


def ready() -> None:
    """The daemon's first request: it returns once the preloads are imported (they run before any fork)."""


def run(argv: Sequence[str], env: Mapping[str, str], stdout: str | None, stderr: str | None) -> None:
    """Become ``python -u argv[0] argv[1:]`` with ``env``; ``stdout``/``stderr`` are files to write to (None: the
    daemon's own, as torch's ``Std.NONE``). Called in the forked process; raises SystemExit with the exit code."""
    os.setsid()  # torch signals the worker's process group (SubprocessHandler.close)
    _redirect(1, stdout)
    _redirect(2, stderr)
    sys.stdout = _unbuffered(1, sys.stdout)
    sys.stderr = _unbuffered(2, sys.stderr)
    daemon_pid = int(env.get(envvars.DAEMON_PID) or 0)
    if set_parent_death_signal(signal.SIGKILL) and daemon_pid and _parent_of(os.getppid()) != daemon_pid:
        # the warm server (our parent) or the daemon died before the request: nobody would send the signal
        sys.stderr.write(f"elasticd: daemon (pid {daemon_pid}) is gone; not starting {argv[0]}\n")
        raise SystemExit(EXIT_ORPHANED)
    os.environ.clear()
    os.environ.update(env)
    _startup_variables(env)
    script = os.path.abspath(argv[0])
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(script)
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit:
        raise
    except BaseException:
        traceback.print_exc()  # what the interpreter prints for an uncaught exception, and its exit code
        raise SystemExit(1) from None
    finally:
        atexit._run_exitfuncs()  # multiprocessing ends the process with os._exit, which runs none


def _parent_of(pid: int) -> int:
    """``pid``'s parent (0 when it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    return int(stat.rsplit(")", 1)[1].split()[1])  # the command may hold spaces and parentheses


def _redirect(fd: int, path: str | None) -> None:
    if not path:  # None or "": the daemon's own (torch's SubprocessHandler opens a file only for a non-empty path)
        return
    target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(target, fd)
    os.close(target)


def _unbuffered(fd: int, old: TextIO) -> io.TextIOWrapper:
    """A text stream on ``fd`` that writes through at once, as ``python -u`` gives."""
    raw = io.FileIO(fd, "w", closefd=False)
    encoding = getattr(old, "encoding", None) or "utf-8"
    errors = getattr(old, "errors", None) or "backslashreplace"
    return io.TextIOWrapper(raw, encoding=encoding, errors=errors, write_through=True)


def _startup_variables(env: Mapping[str, str]) -> None:
    """What an interpreter does with the variables it reads only when it starts (the warm server started with the
    daemon's environment and flags, not the rank's), and the process name a new interpreter has: libraries tell a
    main process from a multiprocessing child by it (transformers' data collators seed differently)."""
    multiprocessing.current_process().name = "MainProcess"
    sys.dont_write_bytecode = bool(env.get(envvars.PYTHONDONTWRITEBYTECODE))
    if env.get(envvars.PYTHONFAULTHANDLER):
        faulthandler.enable(all_threads=True)  # on the new stderr
    elif faulthandler.is_enabled():
        faulthandler.disable()
    threads = env.get(envvars.OMP_NUM_THREADS, "")
    torch = sys.modules.get("torch")
    if threads.isdigit() and int(threads) > 0 and torch is not None:
        torch.set_num_threads(int(threads))  # torch's pool would have read it at its first use
