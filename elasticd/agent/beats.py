"""The daemon's end of the beat channel: a Unix datagram socket read on a background thread.

Each beat updates a :class:`Progress` snapshot (last step, loss, time of the last beat per rank) that the supervisor,
the node registry and the metrics read. The thread survives any datagram: one that is not a well-formed beat
(:func:`parse_beat`) is counted and dropped, and an error of a consumer is counted and dropped too; either is logged
at most once per :data:`DROP_LOG_INTERVAL_S`, so a flood of garbage costs no more than one line a minute.
"""

from __future__ import annotations

import json
import math
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from elasticd.messages import (
    COUNT_FIELDS,
    KIND,
    LIST_FIELDS,
    NUMBER_FIELDS,
    PROTOCOL_VERSION,
    RANK_FIELDS,
    SECONDS_FIELDS,
    UNVERSIONED,
    VERSION,
    Kind,
    kind_of,
)

Beat = dict[str, Any]

# Seconds between two log lines about dropped datagrams (the count in between is in the line and in Progress).
DROP_LOG_INTERVAL_S = 60.0
# Largest datagram read; a longer one is truncated, so it fails to parse and is dropped.
MAX_DATAGRAM_BYTES = 65536
# Ranks index per-rank state: bounded so that a sender cannot grow it without limit (no job has 16 M ranks).
MAX_RANK = 1 << 24
_MAX_INT = 1 << 63


class InvalidBeatError(ValueError):
    """A datagram that is not a beat; the message says why (for the rate-limited log line)."""


def parse_beat(data: bytes) -> Beat:
    """The beat in ``data``, with ``rank``/``local_rank`` defaulted to 0; :class:`InvalidBeatError` otherwise.

    Only the fields the daemon computes with are checked (a worker sends more, and unknown fields pass), with the
    types :mod:`elasticd.messages` gives them: a JSON object of a protocol version this daemon speaks (``v`` absent
    or at most :data:`~elasticd.messages.PROTOCOL_VERSION`) with a string ``kind`` (one this daemon does not know
    passes: its consumers ignore it), ranks in [0, 2^24), counts that are integers >= 0, times that are finite
    numbers >= 0, ``loss`` a number (nan and inf are what the guard reports), ``capabilities`` a list.
    """
    try:
        beat = json.loads(data)
    except (ValueError, RecursionError) as exc:  # not UTF-8, not JSON, too deeply nested, an int of 5000 digits
        raise InvalidBeatError(f"not JSON: {type(exc).__name__}") from None
    if not isinstance(beat, dict):
        raise InvalidBeatError(f"not a JSON object with a string {KIND!r}")
    # first: a newer worker's message may mean something else by any field, the kind included
    version = beat.get(VERSION, UNVERSIONED)
    if not _is_int(version) or version < 1:
        raise InvalidBeatError(f"{VERSION} (the protocol version) is not an integer >= 1")
    if version > PROTOCOL_VERSION:
        raise InvalidBeatError(f"protocol version {version} is newer than this daemon's ({PROTOCOL_VERSION})")
    if not isinstance(beat.get(KIND), str):
        raise InvalidBeatError(f"not a JSON object with a string {KIND!r}")
    for name in RANK_FIELDS:
        value = beat.setdefault(name, 0)
        if not _is_int(value) or not 0 <= value < MAX_RANK:
            raise InvalidBeatError(f"{name} is not an integer in [0, {MAX_RANK})")
    for name in COUNT_FIELDS:
        if name in beat and not (_is_int(beat[name]) and 0 <= beat[name] < _MAX_INT):
            raise InvalidBeatError(f"{name} is not an integer >= 0")
    for name in SECONDS_FIELDS:
        if name in beat:
            seconds = _as_float(beat[name])
            if seconds is None or not math.isfinite(seconds) or seconds < 0:
                raise InvalidBeatError(f"{name} is not a finite number >= 0")
            beat[name] = seconds
    for name in NUMBER_FIELDS:
        if name in beat:
            number = _as_float(beat[name])
            if number is None:
                raise InvalidBeatError(f"{name} is not a number")
            beat[name] = number
    for name in LIST_FIELDS:
        if name in beat and not isinstance(beat[name], list):
            raise InvalidBeatError(f"{name} is not a list")
    return beat


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _as_float(value: object) -> float | None:
    """``value`` as a float if it is a JSON number that fits one (an integer of 400 digits does not)."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return None
    try:
        return float(value)
    except OverflowError:
        return None


@dataclass
class Progress:
    """What the workers of this node last reported."""

    step: int | None = None
    loss: float | None = None
    last_beat_monotonic: dict[int, float] = field(default_factory=dict)
    beats: int = 0
    malformed: int = 0  # datagrams dropped: not a beat (or one of a newer protocol), or a consumer failed on it


class BeatReceiver:
    """Binds ``path`` and calls ``on_beat`` for every well-formed beat, on its own thread.

    ``log`` (a structlog logger) gets one ``beats_dropped`` warning per :data:`DROP_LOG_INTERVAL_S` at most."""

    def __init__(
        self,
        path: str,
        on_beat: Callable[[Beat], None] | None = None,
        *,
        log: Any = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = path
        self.progress = Progress()
        self._on_beat = on_beat
        self._log = log
        self._clock = clock
        self._lock = threading.Lock()
        self._dropped_unlogged = 0
        self._logged_at: float | None = None
        if os.path.exists(path):
            os.unlink(path)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(path)
        self._sock.settimeout(0.2)  # so close() is noticed within 200 ms
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="elasticd-beats", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        """Whether the receiving thread runs (it ends only at :meth:`close`)."""
        return self._thread.is_alive()

    def _loop(self) -> None:
        while not self._stopped.is_set():
            try:
                data = self._sock.recv(MAX_DATAGRAM_BYTES)
            except TimeoutError:
                continue
            except OSError:
                return
            self._handle(data)

    def _handle(self, data: bytes) -> None:
        try:
            beat = parse_beat(data)
        except InvalidBeatError as exc:
            self._dropped(str(exc))
            return
        rank = beat["rank"]
        with self._lock:
            p = self.progress
            p.beats += 1
            p.last_beat_monotonic[rank] = time.monotonic()
            if kind_of(beat) is Kind.STEP and "step" in beat:
                # The latest beat wins: after a restart the step legitimately goes back to the checkpoint's.
                p.step = beat["step"]
                if "loss" in beat:
                    p.loss = float(beat["loss"])
        if self._on_beat is None:
            return
        try:
            self._on_beat(beat)
        except Exception as exc:  # a consumer's bug must not end the channel: every later beat would be lost
            self._dropped(f"{beat[KIND]} beat failed in the daemon: {type(exc).__name__}: {exc}")

    def _dropped(self, reason: str) -> None:
        now = self._clock()
        with self._lock:
            self.progress.malformed += 1
            self._dropped_unlogged += 1
            if self._logged_at is not None and now - self._logged_at < DROP_LOG_INTERVAL_S:
                return
            self._logged_at, dropped, self._dropped_unlogged = now, self._dropped_unlogged, 0
        if self._log is not None:
            self._log.warning("beats_dropped", dropped=dropped, reason=reason[:200], socket=self.path)

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
