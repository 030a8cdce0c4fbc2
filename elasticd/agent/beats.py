"""The daemon's end of the beat channel: a Unix datagram socket read on a background thread.

Each beat updates a :class:`Progress` snapshot (last step, loss, time of the last beat per rank) that the supervisor,
the node registry and the metrics read. Malformed datagrams are counted and dropped, never raised.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

Beat = dict[str, Any]


@dataclass
class Progress:
    """What the workers of this node last reported."""

    step: int | None = None
    loss: float | None = None
    last_beat_monotonic: dict[int, float] = field(default_factory=dict)
    beats: int = 0
    malformed: int = 0


class BeatReceiver:
    """Binds ``path`` and calls ``on_beat`` for every well-formed beat, on its own thread."""

    def __init__(self, path: str, on_beat: Callable[[Beat], None] | None = None) -> None:
        self.path = path
        self.progress = Progress()
        self._on_beat = on_beat
        self._lock = threading.Lock()
        if os.path.exists(path):
            os.unlink(path)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(path)
        self._sock.settimeout(0.2)  # so close() is noticed within 200 ms
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="elasticd-beats", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stopped.is_set():
            try:
                data = self._sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            self._handle(data)

    def _handle(self, data: bytes) -> None:
        try:
            beat = json.loads(data)
            if not isinstance(beat, dict) or "kind" not in beat:
                raise ValueError("not a beat")
            rank = int(beat.get("rank", 0))
        except (ValueError, TypeError):
            with self._lock:
                self.progress.malformed += 1
            return
        with self._lock:
            p = self.progress
            p.beats += 1
            p.last_beat_monotonic[rank] = time.monotonic()
            if beat["kind"] == "step" and isinstance(beat.get("step"), int):
                # The latest beat wins: after a restart the step legitimately goes back to the checkpoint's.
                p.step = beat["step"]
                if isinstance(beat.get("loss"), int | float):
                    p.loss = float(beat["loss"])
        if self._on_beat is not None:
            self._on_beat(beat)

    def snapshot(self) -> Progress:
        with self._lock:
            p = self.progress
            return Progress(p.step, p.loss, dict(p.last_beat_monotonic), p.beats, p.malformed)

    def close(self) -> None:
        self._stopped.set()
        self._sock.close()
        self._thread.join(timeout=2)
        if os.path.exists(self.path):
            os.unlink(self.path)
