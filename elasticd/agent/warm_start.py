"""Warm starts: the daemon's workers are forked from a process that already imported torch and accelerate.

Cold, each worker is a new interpreter (``python -u -m elasticd.worker.launch SCRIPT``) that imports torch,
accelerate and ``torch._dynamo`` before its first line of training: ~5 s of CPU per worker, paid again at every
restart from a checkpoint and by every joining node (``elasticd/worker/warm.py`` says where it goes).
:class:`WarmStarts` starts Python's ``multiprocessing`` forkserver at the daemon's first worker start, preloaded
with those modules (the first start waits for them, as a cold worker would for its own imports); every later
worker is a fork of it running :func:`elasticd.worker.warm.run`.

torch's agent keeps starting, watching and stopping the workers: :meth:`WarmStarts.handlers` swaps the factory its
process context calls for each worker (``get_subprocess_handler``, listed in ``elasticd/privates/torch_surfaces.py``)
for :meth:`WarmStarts.handler`, whose :class:`WarmHandler` has what torch uses of its own (``proc.pid``,
``proc.poll()``, ``proc.wait(timeout)``, ``close(signal)``). The pid torch watches is the worker's, so signals,
hang evidence and ``kill -9`` reach the script itself; the warm server learns the exit code and hands it over.

Cold starts remain: with ``ELASTICD_WARM_START=0``, off Linux, when torch's factory moved, for a command line that is
not the launcher's, when NUMA binding is asked for, and while the server is not ready (its first request did not come
back within :data:`READY_TIMEOUT_S`, or failed: ``warm_start_unavailable``).
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from elasticd import envvars
from elasticd.privates.check import problems
from elasticd.privates.surface import Fallback
from elasticd.privates.torch_surfaces import TORCH
from elasticd.worker import warm
from elasticd.worker.launch import PREFIX

# How long a worker start waits for the warm server's first answer (its imports) before starting cold instead.
READY_TIMEOUT_S = 60.0
# A leftover warm worker's wait after SIGKILL when the daemon exits.
_EXIT_JOIN_S = 1.0
_FACTORY = "get_subprocess_handler"


def enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """Warm starts are on by default on Linux; ``ELASTICD_WARM_START=0`` turns them off."""
    return sys.platform.startswith("linux") and environ.get(envvars.WARM_START, "1") != "0"


def launched_script(entrypoint: str, args: Sequence[Any]) -> list[str] | None:
    """``[SCRIPT, *ARGS]`` of a worker command line made by ``worker.launch.worker_args``; None for any other."""
    words = [str(a) for a in args]
    if entrypoint != sys.executable or tuple(words[: len(PREFIX)]) != PREFIX or len(words) == len(PREFIX):
        return None
    return words[len(PREFIX) :]


class WarmProcess:
    """A warm worker as torch's process context sees a ``subprocess.Popen``: its pid, exit code and wait."""

    def __init__(self, process: multiprocessing.process.BaseProcess, args: list[str]) -> None:
        self._process = process
        self.args = args
        pid = process.pid
        assert pid is not None  # started
        self.pid: int = pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode  # a non-blocking look, as Popen.poll

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        code = self._process.exitcode
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return code


class WarmHandler:
    """torch's ``SubprocessHandler`` for a warm worker."""

    def __init__(self, process: WarmProcess, local_rank_id: int) -> None:
        self.proc = process
        self.local_rank_id = local_rank_id

    def close(self, death_sig: signal.Signals | None = None) -> None:
        signum = death_sig or signal.SIGTERM
        try:
            os.killpg(self.proc.pid, signum)
        except ProcessLookupError:  # not yet in a session of its own (just forked), or gone
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signum)


class WarmStarts:
    """The warm server of one daemon, and the handlers of its workers."""

    def __init__(self, script: Path, log: Any, *, ready_timeout_s: float = READY_TIMEOUT_S) -> None:
        self._context = multiprocessing.get_context("forkserver")
        self._preload = warm.preload_for(script)
        self._log = log
        self._ready_timeout_s = ready_timeout_s
        self._ready = threading.Event()
        self._usable = False
        self._started: list[WarmProcess] = []
        self._lock = threading.Lock()
        self._begun = False
        self._factory_moved: bool | None = None

    def start(self) -> None:
        """Start the server and its imports in the background (idempotent). The daemon calls it with its first
        worker start, not before: on a host that several nodes share (the suite's, 2 cores), preloads competing
        with the daemons' own start stretched a rendezvous to 34 s and split the first round (measured). Except a
        node that comes while others train: it starts the server and waits for it before it enters the rendezvous
        (``agent/daemon.py``'s ``_warm_before_joining``), so the running group does not stand still for its imports."""
        with self._lock:
            if self._begun:
                return
            self._begun = True
        self._context.set_forkserver_preload(self._preload)
        threading.Thread(target=self._first_request, name="elasticd-warm-start", daemon=True).start()
        atexit.register(self._kill_leftovers)  # before multiprocessing's own exit hook, which would wait on them

    def _first_request(self) -> None:
        begun = time.monotonic()
        try:
            probe = self._context.Process(target=warm.ready, name="elasticd-warm-ready")
            probe.start()  # returns once the server has imported the preloads and forked
            probe.join(self._ready_timeout_s)
            self._usable = probe.exitcode == 0
            reason = f"its first process exited {probe.exitcode}"
        except Exception as e:  # any failure means cold starts, said once
            reason = f"{type(e).__name__}: {e}"
        if self._usable:
            self._log.info("warm_start_ready", preload=self._preload, duration_s=round(time.monotonic() - begun, 3))
        else:
            self._log.warning("warm_start_unavailable", reason=reason, message="workers start as new interpreters")
        self._ready.set()

    @contextlib.contextmanager
    def handlers(self) -> Iterator[None]:
        """While torch's agent starts the workers: each one through :meth:`handler`."""
        from torch.distributed.elastic.multiprocessing import api

        cold = getattr(api, _FACTORY, None)
        if self._factory_moved is None:  # checked once: torch does not change under a running daemon
            self._factory_moved = bool(problems(TORCH, fallback=Fallback.COLD_STARTS))
        if cold is None or self._factory_moved:
            yield
            return
        self.start()
        setattr(api, _FACTORY, self._factory(cold))
        try:
            yield
        finally:
            setattr(api, _FACTORY, cold)

    def _factory(self, cold: Callable[..., Any]) -> Callable[..., Any]:
        def factory(
            entrypoint: str,
            args: tuple[Any, ...],
            env: dict[str, str],
            stdout: str | None,
            stderr: str | None,
            local_rank_id: int,
            numa_options: Any = None,
        ) -> Any:
            argv = launched_script(entrypoint, args)
            if argv is None or numa_options is not None or not self.wait_ready():
                return cold(entrypoint, args, env, stdout, stderr, local_rank_id, numa_options)
            return self.handler(argv, {**os.environ, **env}, stdout, stderr, local_rank_id)

        return factory

    def wait_ready(self) -> bool:
        """Whether warm starts work, waiting for the server's first answer for at most the ready timeout."""
        self._ready.wait(self._ready_timeout_s)
        return self._usable

    def handler(
        self, argv: list[str], env: dict[str, str], stdout: str | None, stderr: str | None, local_rank_id: int
    ) -> WarmHandler:
        """Fork one worker running ``argv`` with ``env`` (the whole environment)."""
        for path in (stdout, stderr):
            if path:  # created before the start, as torch's SubprocessHandler does (the fork opens them again)
                Path(path).write_bytes(b"")
        process = self._context.Process(
            target=warm.run, args=(argv, env, stdout, stderr), name=f"elasticd-worker-{local_rank_id}"
        )
        process.start()
        started = WarmProcess(process, [sys.executable, "-u", *argv])
        with self._lock:
            self._started = [p for p in self._started if p.poll() is None] + [started]
        return WarmHandler(started, local_rank_id)

    def _kill_leftovers(self) -> None:
        with self._lock:
            left = [p for p in self._started if p.poll() is None]
        for p in left:
            WarmHandler(p, 0).close(signal.SIGKILL)
        for p in left:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(_EXIT_JOIN_S)
