"""Small helpers shared by the tests (import as ``tests.helpers``)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
from collections.abc import Callable
from typing import Any, TypeVar

import psutil

from elasticd.etcd.client import EtcdClient

# Generous: the test machine has 2 cores shared with other test runs; etcd alone starts in ~0.2 s.
ETCD_READY_TIMEOUT_S = 30.0

T = TypeVar("T")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago; callers must tolerate losing it to another process."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def kill_tree(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL a process started with ``start_new_session`` and everything below it.

    Killing its process group is not enough: torchrun starts each worker in a session of its own.
    """
    if process.poll() is not None:
        return
    tree = psutil.Process(process.pid).children(recursive=True)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    for child in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
    process.wait(timeout=30)


def records(seen: list[Any], what: object = None, *, result: T) -> Callable[..., T]:
    """A stand-in for a function: it appends ``what`` (default: its first argument) to ``seen`` and returns
    ``result`` (an exit code, for the CLI's commands)."""

    def stand_in(*args: Any, **_kwargs: Any) -> T:
        seen.append(args[0] if what is None else what)
        return result

    return stand_in


def etcd_value(client: EtcdClient, key: str) -> bytes:
    """The value at ``key``; fails the test when the key is absent."""
    got = client.get(key)
    assert got is not None, f"{key} is absent"
    return bytes(got[0])
