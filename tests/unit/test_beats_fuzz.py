"""The beat receiver survives any datagram (hypothesis): arbitrary bytes, arbitrary JSON, and beat-shaped objects
whose fields hold the wrong things (``"rank": Infinity``, NaN, 400-digit integers, nested junk, wrong types).

A real receiver on a real Unix datagram socket feeds the daemon's real consumers (progress tracker, metrics, worker
reports, straggler detector); after every fuzzed datagram a valid beat must still arrive. Dropped datagrams are
counted, and logged once per interval, not once per datagram.
"""

from __future__ import annotations

import itertools
import json
import socket
import time
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from elasticd.agent.beats import BeatReceiver, InvalidBeatError, parse_beat
from elasticd.agent.progress import ProgressTracker
from elasticd.agent.reports import WorkerReports
from elasticd.agent.stragglers import StragglerDetector
from elasticd.messages import Kind
from elasticd.metrics import Metrics
from elasticd.worker.beats import BeatClient

KINDS = [kind.value for kind in Kind]
FIELDS = [
    "v",
    "rank",
    "local_rank",
    "step",
    "loss",
    "samples",
    "step_time_s",
    "train_s",
    "own_s",
    "ts",
    "blocking_s",
    "total_s",
    "exit_code",
    "reason",
    "message",
    "action",
    "capabilities",
    "requested",
    "pid",
    "phase",
]

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=10**300, max_value=10**400)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)
)
json_values = st.recursive(
    json_scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
)
beat_like = st.fixed_dictionaries(
    {"kind": st.sampled_from(KINDS) | json_values},
    optional={name: json_values for name in FIELDS},
)


def _encode(value: Any) -> bytes:
    return json.dumps(value, allow_nan=True).encode()  # NaN and Infinity, as Python's json writes them


datagrams = (
    st.binary(max_size=2048)
    | json_values.map(_encode)
    | beat_like.map(_encode)
    | st.integers(min_value=0, max_value=5000).map(lambda n: b"[" * n * 20)  # nested beyond the recursion limit
)


class _UnclaimedRegistry:
    """The tracker writes the last step to the registry every 2 s; the registry is not under test here."""

    def update(self, **fields: Any) -> None:
        pass


def _wait_for(predicate: Any, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.001)
    return False


class _Log:
    def __init__(self) -> None:
        self.lines: list[tuple[str, dict[str, Any]]] = []

    def warning(self, event: str, **fields: Any) -> None:
        self.lines.append((event, fields))

    def info(self, event: str, **fields: Any) -> None:
        self.lines.append((event, fields))


def test_receiver_survives_any_datagram_and_still_delivers_valid_beats(tmp_path: Path) -> None:
    log = _Log()
    metrics = Metrics.create(node="fuzz")
    reports = WorkerReports()
    reports.reset({0, 1})
    tracker = ProgressTracker(
        metrics,
        _UnclaimedRegistry(),  # type: ignore[arg-type]  # a registry that writes nothing
        reports,
        lambda: log,
        stragglers=StragglerDetector(factor=1.5, window_s=30.0),
    )
    receiver = BeatReceiver(str(tmp_path / "b.sock"), on_beat=tracker.on_beat, log=log, clock=lambda: 0.0)
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    raw.settimeout(5)  # a receiver that stopped reading fills the socket buffer: fail, never block
    client = BeatClient(receiver.path, rank=1, local_rank=1)
    steps = itertools.count(1)

    @settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(payload=datagrams)
    @example(payload=b'{"kind": "step", "rank": Infinity, "step": 3}')
    @example(payload=b'{"kind": "step", "rank": NaN}')
    @example(payload=b'{"kind": "checkpoint_committed", "step": 1e400, "ts": -Infinity}')
    @example(payload=b'{"kind": "fatal", "exit_code": Infinity}')
    @example(payload=b'{"kind": "hello", "capabilities": 7}')
    @example(payload=b'{"kind": "step", "step": 5, "loss": ' + b"9" * 400 + b"}")
    @example(payload=b'{"kind": "step", "step": 5, "rank": ' + b"9" * 5000 + b"}")
    @example(payload=b"[" * 200_000)
    @example(payload=b"\xff\xfe")
    @example(payload=b"")
    def check(payload: bytes) -> None:
        raw.sendto(payload, receiver.path)
        step = next(steps)
        assert client.send(step=step, loss=0.25, samples=4, step_time_s=0.01, train_s=0.01, own_s=0.01)
        arrived = _wait_for(lambda: receiver.snapshot().step == step or not receiver.alive)
        assert receiver.alive, f"the receiver thread died on {payload[:80]!r}"
        assert arrived, f"beat {step} never arrived after {payload[:80]!r}"

    try:
        check()
        snapshot = receiver.snapshot()
        assert snapshot.malformed > 0
        assert metrics.registry.get_sample_value("elasticd_training_step") == snapshot.step
        # the clock never moved: a whole fuzz run of garbage is one log line
        dropped = [fields for event, fields in log.lines if event == "beats_dropped"]
        assert len(dropped) == 1, dropped
    finally:
        raw.close()
        client.close()
        receiver.close()


def test_dropped_datagrams_are_logged_once_per_interval_with_the_count(tmp_path: Path) -> None:
    log, now = _Log(), [0.0]
    receiver = BeatReceiver(str(tmp_path / "b.sock"), log=log, clock=lambda: now[0])
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        for _ in range(50):
            raw.sendto(b"junk", receiver.path)
        assert _wait_for(lambda: receiver.snapshot().malformed == 50)
        now[0] = 61.0
        raw.sendto(b'{"kind": "step", "rank": Infinity}', receiver.path)
        assert _wait_for(lambda: receiver.snapshot().malformed == 51)
        dropped = [fields for event, fields in log.lines if event == "beats_dropped"]
        assert [d["dropped"] for d in dropped] == [1, 50]
        assert "rank" in dropped[1]["reason"]
    finally:
        raw.close()
        receiver.close()


def test_a_consumer_that_raises_does_not_end_the_channel(tmp_path: Path) -> None:
    seen: list[int] = []

    def consumer(beat: dict[str, Any]) -> None:
        if beat.get("step") == 1:
            raise RuntimeError("a bug in a consumer")
        seen.append(beat["step"])

    receiver = BeatReceiver(str(tmp_path / "b.sock"), on_beat=consumer)
    client = BeatClient(receiver.path)
    try:
        client.send(step=1)
        client.send(step=2)
        assert _wait_for(lambda: seen == [2])
        assert receiver.alive and receiver.snapshot().malformed == 1
    finally:
        client.close()
        receiver.close()


def test_parse_beat_defaults_ranks_and_names_what_is_wrong() -> None:
    assert parse_beat(b'{"kind": "hello"}') == {"kind": "hello", "rank": 0, "local_rank": 0}
    for payload, reason in [
        (b'{"kind": "step", "rank": -1}', "rank"),
        (b'{"kind": "step", "local_rank": true}', "local_rank"),
        (b'{"kind": "step", "step": 1.5}', "step"),
        (b'{"kind": "step", "ts": NaN}', "ts"),
        (b'{"kind": "step", "loss": "low"}', "loss"),
        (b'{"kind": 3}', "kind"),
    ]:
        try:
            parse_beat(payload)
        except InvalidBeatError as exc:
            assert reason in str(exc)
        else:
            raise AssertionError(f"{payload!r} was accepted")
