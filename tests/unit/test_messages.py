"""The beat protocol is written in one place (elasticd/messages.py) and both ends speak it: every kind a worker sends
is one the daemon's parser and consumers know, a message survives the trip from BeatClient to parse_beat, a message
of a newer protocol version is dropped and counted, and no other module spells a kind.
"""

from __future__ import annotations

import ast
import json
import math
import socket
import time
from pathlib import Path
from typing import Any

import pytest

from elasticd import rundir
from elasticd.agent.beats import BeatReceiver, InvalidBeatError, parse_beat
from elasticd.messages import (
    COUNT_FIELDS,
    FIELDS,
    KIND,
    LIST_FIELDS,
    NUMBER_FIELDS,
    PROTOCOL_VERSION,
    SECONDS_FIELDS,
    VERSION,
    Capability,
    FatalReason,
    Kind,
    encode,
    kind_of,
)
from elasticd.worker import commit_queue, saver
from elasticd.worker.batching import BatchConstraint
from elasticd.worker.beats import BeatClient
from tests.source_literals import PACKAGE, Role, literals, package_literals

# Literals equal to a kind that mean something else there, and what (each still occurs: see the stale check below).
OTHER_MEANINGS = {
    ("agent/policy.py", "fatal"): "a restart decision's reason",
    ("metrics.py", "batch_plan"): "a hot fallback reason (a metric label)",
    ("worker/hot/session.py", "batch_plan"): "a hot fallback reason",
    ("demo/journal.py", "step"): "the training script's step lines (examples/train.py), and their field",
    ("demo/story.py", "step"): "a field of the demo's moments",
    ("demo/story.py", "reconfigured"): "the log event the demo reads",
    ("demo/story.py", "checkpoint_committed"): "a moment the demo reports",
    ("demo/story.py", "in_place"): "a field of the demo's summary",
    ("demo/view.py", "in_place"): "a field of the demo's summary",
}
FIELD_NAMES = frozenset().union(*FIELDS.values())


def _sample(name: str) -> Any:
    """A value of the type the daemon checks for ``name``."""
    if name in COUNT_FIELDS:
        return 7
    if name in SECONDS_FIELDS:
        return 0.5
    if name in NUMBER_FIELDS:
        return 0.25
    if name in LIST_FIELDS:
        return [Capability.CHECKPOINT_REQUEST]
    return "x"


def _sends() -> list[tuple[str, int, ast.Call]]:
    """Every ``<...>.beats.send(...)`` call of the package: (module, line, call)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "send"
                and ast.unparse(node.func.value).endswith("beats")
            ):
                found.append((str(path.relative_to(PACKAGE)), node.lineno, node))
    return found


def _kind_sent(call: ast.Call) -> Kind | None:
    """``Kind.X`` as the first argument (no argument: the default, a step); None for ``Kind(<name>)``."""
    if not call.args:
        return Kind.STEP
    first = call.args[0]
    if isinstance(first, ast.Attribute) and ast.unparse(first.value) == "Kind":
        return Kind[first.attr]
    assert isinstance(first, ast.Call) and ast.unparse(first.func) == "Kind", ast.unparse(first)
    return None


def test_every_kind_the_worker_sends_is_a_known_kind_with_known_fields() -> None:
    sends = _sends()
    assert len(sends) >= 10  # the scan sees the worker's sends at all
    sent = set()
    for module, line, call in sends:
        kind = _kind_sent(call)
        if kind is None:
            continue
        sent.add(kind)
        names = {k.arg for k in call.keywords if k.arg is not None}
        assert names <= FIELDS[kind], f"elasticd/{module}:{line}: {kind} sends {names - FIELDS[kind]}"
    # the one dynamic send forwards the saver's events: those are kinds too, with the fields the saver gives them
    forwarded = {saver.COMMITTED, saver.FAILED, saver.FENCED, commit_queue.DEFERRED}
    assert all(isinstance(event, Kind) for event in forwarded)
    assert sent | forwarded == set(Kind), f"kinds no worker sends: {set(Kind) - sent - forwarded}"
    assert set(rundir.describe(OSError(28, "No space left on device", "/x"))) <= FIELDS[Kind.CHECKPOINT_FAILED]
    assert set(BatchConstraint(64, 4, 2).to_json()) == FIELDS[Kind.BATCH_PLAN]


@pytest.mark.parametrize("kind", list(Kind))
def test_each_kind_with_all_its_fields_round_trips_through_the_encoding_and_the_parser(kind: Kind) -> None:
    fields = {name: _sample(name) for name in sorted(FIELDS[kind])}
    beat = parse_beat(encode(kind, fields, rank=5, local_rank=1, ts=1.0))
    assert kind_of(beat) is kind and beat[VERSION] == PROTOCOL_VERSION
    assert beat == {KIND: kind, VERSION: PROTOCOL_VERSION, "rank": 5, "local_rank": 1, "ts": 1.0, **fields}


def test_a_beat_client_s_datagram_parses_to_what_it_sent(tmp_path: Path) -> None:
    path = str(tmp_path / "b.sock")
    sink = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sink.bind(path)
    sink.settimeout(5)
    client = BeatClient(path, rank=3, local_rank=1)
    try:
        before = time.time()
        assert client.send(Kind.HELLO, capabilities=list(Capability), pid=42)
        beat = parse_beat(sink.recv(65536))
    finally:
        client.close()
        sink.close()
    assert kind_of(beat) is Kind.HELLO and beat[VERSION] == PROTOCOL_VERSION
    assert (beat["rank"], beat["local_rank"], beat["pid"]) == (3, 1, 42)
    assert beat["capabilities"] == ["checkpoint_request", "stacks", "in_place"]
    assert before <= beat["ts"] <= time.time()


def test_the_wire_carries_the_kind_s_string_and_the_version() -> None:
    raw = encode(Kind.FATAL, {"reason": FatalReason.NAN}, rank=0, local_rank=0, ts=2.0)
    assert raw == b'{"kind":"fatal","v":1,"rank":0,"local_rank":0,"ts":2.0,"reason":"nan"}'


def test_a_message_without_a_version_is_an_older_worker_s_and_is_taken() -> None:
    assert parse_beat(b'{"kind": "step", "step": 3}') == {"kind": "step", "step": 3, "rank": 0, "local_rank": 0}


@pytest.mark.parametrize(
    ("version", "why"),
    [(PROTOCOL_VERSION + 1, "newer"), (0, "protocol version"), (True, "protocol version"), ("1", "protocol version")],
)
def test_a_message_of_a_newer_or_a_malformed_version_is_refused(version: object, why: str) -> None:
    with pytest.raises(InvalidBeatError, match=why):
        parse_beat(json.dumps({KIND: "step", VERSION: version, "step": 3}).encode())


def test_a_newer_worker_s_message_is_dropped_and_counted_and_the_channel_goes_on(tmp_path: Path) -> None:
    seen: list[dict[str, Any]] = []
    receiver = BeatReceiver(str(tmp_path / "b.sock"), on_beat=seen.append)
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    client = BeatClient(receiver.path)
    try:
        raw.sendto(json.dumps({KIND: "step", VERSION: PROTOCOL_VERSION + 1, "step": 9}).encode(), receiver.path)
        assert client.send(Kind.STEP, step=2)
        deadline = time.monotonic() + 10
        while not seen and time.monotonic() < deadline:
            time.sleep(0.01)
        snapshot = receiver.snapshot()
    finally:
        raw.close()
        client.close()
        receiver.close()
    assert [beat["step"] for beat in seen] == [2]
    assert snapshot.step == 2 and snapshot.malformed == 1


def test_a_kind_this_side_does_not_know_is_parsed_and_ignored() -> None:
    beat = parse_beat(b'{"kind": "from_a_newer_minor", "v": 1}')
    assert kind_of(beat) is None
    assert kind_of({}) is None and kind_of({KIND: 3}) is None


def test_the_daemon_checks_each_typed_field_it_computes_with() -> None:
    for name in (*COUNT_FIELDS, *SECONDS_FIELDS, *NUMBER_FIELDS, *LIST_FIELDS):
        with pytest.raises(InvalidBeatError, match=name):
            parse_beat(json.dumps({KIND: "step", name: "not the type"}).encode())
    assert math.isnan(parse_beat(b'{"kind": "step", "loss": NaN}')["loss"])  # the guard reports nan: taken


def test_no_module_but_messages_spells_a_kind() -> None:
    kinds = {kind.value for kind in Kind} | {capability.value for capability in Capability}
    offenders = [
        str(literal)
        for literal in package_literals(outside="messages.py")
        if literal.text in kinds
        and literal.role is not Role.LOG_EVENT  # the log's event names are its own vocabulary
        and not (literal.role is Role.FIELD and literal.text in FIELD_NAMES)  # "step": a kind and a field
        and (literal.path, literal.text) not in OTHER_MEANINGS
    ]
    assert offenders == []


def test_each_other_meaning_allowed_above_still_occurs() -> None:
    present = {(literal.path, literal.text) for literal in package_literals(outside="messages.py")}
    assert set(OTHER_MEANINGS) <= present


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ('send("hello")\n', [("hello", Role.VALUE)]),
        ('"""Says hello."""\nx = 1\n', []),
        ('log.info("hello", step=1)\n', [("hello", Role.LOG_EVENT)]),
        ('beat.get("step") or beat["step"] or {"step": 1} or "step" in beat\n', [("step", Role.FIELD)] * 4),
        ('x = f"step-{n}"\n', [("step-", Role.VALUE)]),
    ],
)
def test_the_source_reader_tells_values_from_log_events_and_fields(
    source: str, expected: list[tuple[str, Role]], tmp_path: Path
) -> None:
    path = tmp_path / "m.py"
    path.write_text(source)
    assert sorted((lit.text, lit.role.value) for lit in literals(path)) == sorted((t, r.value) for t, r in expected)
