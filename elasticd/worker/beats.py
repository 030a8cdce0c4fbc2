"""Progress beats from a worker to its node's daemon, over a Unix datagram socket that never blocks a step.

A beat is one JSON datagram: ``{"kind": "step", "rank", "step", "loss", "samples", "step_time_s", "train_s", "phase",
"ts"}``; step beats come at most every 250 ms (``samples`` and ``train_s`` add up the steps since the last one).
Sending is fire-and-forget: a full socket buffer, a missing daemon or a closed socket drops the beat and training
goes on. Without ``ELASTICD_SOCKET`` (plain ``python`` or ``accelerate launch``) :meth:`BeatClient.from_env`
returns a client whose ``send`` does nothing.
"""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Any

from elasticd import envvars


class BeatClient:
    """Sends beats to ``path``; ``None`` makes every send a no-op."""

    def __init__(self, path: str | None, rank: int = 0, local_rank: int = 0) -> None:
        self.path = path
        self.rank = rank
        self.local_rank = local_rank
        self._sock: socket.socket | None = None
        if path:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._sock.setblocking(False)

    @classmethod
    def from_env(cls) -> BeatClient:
        return cls(
            os.environ.get(envvars.SOCKET) or None,
            rank=int(os.environ.get("RANK", "0")),
            local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        )

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def send(self, kind: str = "step", **fields: Any) -> bool:
        """Send one beat; returns whether it left the process (False is normal without a daemon)."""
        if self._sock is None or self.path is None:
            return False
        message = {
            "kind": kind,
            "rank": self.rank,
            "local_rank": self.local_rank,
            "ts": time.time(),
            **fields,
        }
        try:
            self._sock.sendto(json.dumps(message, separators=(",", ":")).encode(), self.path)
        except OSError:  # daemon gone, buffer full, socket removed: never stall training on telemetry
            return False
        return True

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
