"""Progress beats from a worker to its node's daemon, over a Unix datagram socket that never blocks a step.

A beat is one JSON datagram, a message of the protocol in :mod:`elasticd.messages` (its kinds, fields and version);
step beats come at most every 250 ms (``samples`` and ``train_s`` add up the steps since the last one).
Sending is fire-and-forget: a full socket buffer, a missing daemon or a closed socket drops the beat and training
goes on. Without ``ELASTICD_SOCKET`` (plain ``python`` or ``accelerate launch``) :meth:`BeatClient.from_env`
returns a client whose ``send`` does nothing.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from elasticd import envvars
from elasticd.messages import Kind, encode


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
            rank=int(os.environ.get(envvars.RANK, "0")),
            local_rank=int(os.environ.get(envvars.LOCAL_RANK, "0")),
        )

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def send(self, kind: Kind = Kind.STEP, **fields: Any) -> bool:
        """Send one beat; returns whether it left the process (False is normal without a daemon)."""
        if self._sock is None or self.path is None:
            return False
        message = encode(kind, fields, rank=self.rank, local_rank=self.local_rank, ts=time.time())
        try:
            self._sock.sendto(message, self.path)
        except OSError:  # daemon gone, buffer full, socket removed: never stall training on telemetry
            return False
        return True

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
