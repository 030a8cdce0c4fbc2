"""The unit tier starts no process and opens no network socket (docs/testing.md): a test that tries fails at once,
naming what it tried and where such a test belongs. Unix-domain sockets stay allowed (the beat channel is local
IPC); TCP and UDP over IP are refused, and so is every way to start a program (``subprocess``, ``os.fork``,
``os.posix_spawn``, ``os.system``, the ``os.exec*`` family), which also covers external binaries."""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Callable, Iterator
from typing import Any

import pytest

_ELSEWHERE = "tests/integration (etcd, daemons, workers) or tests/deploy (kubectl, promtool, hadolint, Prometheus)"
_PROCESS_CALLS = ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system", "execv", "execve", "execvp", "execvpe")


def _refuse(what: str) -> Callable[..., Any]:
    def refused(*_args: Any, **_kwargs: Any) -> Any:
        raise AssertionError(f"a unit test may not {what}: it belongs in {_ELSEWHERE}")

    return refused


@pytest.fixture(autouse=True)
def _no_process_no_network(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(subprocess.Popen, "__init__", _refuse("start a process (subprocess)"))
    for name in _PROCESS_CALLS:
        if hasattr(os, name):
            monkeypatch.setattr(os, name, _refuse(f"start a process (os.{name})"))
    real_init = socket.socket.__init__

    def only_local_sockets(self: socket.socket, family: int = -1, *args: Any, **kwargs: Any) -> None:
        if family in (-1, socket.AF_INET, socket.AF_INET6) and kwargs.get("fileno") is None:
            _refuse("open a network socket (use a Unix-domain one for local IPC)")()
        real_init(self, family, *args, **kwargs)

    monkeypatch.setattr(socket.socket, "__init__", only_local_sockets)
    yield
