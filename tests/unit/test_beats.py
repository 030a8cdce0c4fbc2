"""The beat channel never blocks a worker and survives garbage."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from elasticd.agent.beats import BeatReceiver
from elasticd.worker.beats import BeatClient


def wait_for(predicate: Callable[[], object], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return False


def test_client_without_daemon_is_a_noop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ELASTICD_SOCKET", raising=False)
    client = BeatClient.from_env()
    assert not client.enabled and client.send(step=1) is False


def test_client_with_vanished_daemon_drops_the_beat(tmp_path: Path) -> None:
    client = BeatClient(str(tmp_path / "gone.sock"))
    assert client.send(step=1) is False


def test_beats_reach_the_receiver_and_garbage_is_counted(tmp_path: Path) -> None:
    seen: list[dict[str, Any]] = []
    receiver = BeatReceiver(str(tmp_path / "b.sock"), on_beat=seen.append)
    try:
        client = BeatClient(receiver.path, rank=3, local_rank=1)
        raw = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        raw.sendto(b"not json", receiver.path)
        assert client.send(step=7, loss=0.5, samples=4)
        assert wait_for(lambda: receiver.snapshot().step == 7)
        snap = receiver.snapshot()
        assert snap.loss == 0.5 and snap.malformed == 1 and 3 in snap.last_beat_monotonic
        assert seen[0]["rank"] == 3 and seen[0]["local_rank"] == 1
    finally:
        receiver.close()
    assert not Path(receiver.path).exists()


def test_send_never_blocks_when_the_receiver_stops_reading(tmp_path: Path) -> None:
    path = str(tmp_path / "slow.sock")
    sink = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sink.bind(path)  # bound but never read: its buffer fills up
    client = BeatClient(path)
    start = time.monotonic()
    results = [client.send(step=i, payload="x" * 512) for i in range(5000)]
    assert time.monotonic() - start < 5.0
    assert not all(results)  # some beats were dropped rather than waited for
    sink.close()
