"""The lease rendezvous's pure parts: when its decider forms a round (``CloseRule``), the round record's encoding, and
the keep-alive stream's matching of answers to refreshes (``etcd/keepalive.py``, over a stand-in gRPC call)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from elasticd.etcd.keepalive import KeepAliveStream, StreamBroken
from elasticd.rendezvous.lease_round import FIRST_ROUND, CloseRule, RoundRecord


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _names(inside: set[str], to_come: set[str]) -> Any:
    return lambda: (inside, to_come)


def test_a_round_forms_at_max_nodes_at_once_and_below_min_never() -> None:
    rule = CloseRule(2, 3, last_call_s=30, reforming=False, clock=Clock())
    assert not rule.due(1, _names({"a"}, set()))
    assert rule.due(3, _names({"a", "b", "c"}, set())) and rule.reason == "max_nodes"


def test_a_job_s_first_round_waits_the_last_call_from_when_min_nodes_were_in() -> None:
    clock = Clock()
    rule = CloseRule(2, 4, last_call_s=2.0, reforming=False, clock=clock)
    assert not rule.due(2, _names({"a", "b"}, set()))
    clock.now += 1.0
    assert not rule.due(2, _names({"a", "b"}, set())) and rule.due_in() == pytest.approx(1.0)
    clock.now += 1.0
    assert rule.due(2, _names({"a", "b"}, set())) and rule.reason == "last_call"


def test_falling_below_min_nodes_restarts_the_last_call() -> None:
    clock = Clock()
    rule = CloseRule(2, 4, last_call_s=2.0, reforming=False, clock=clock)
    rule.due(2, _names({"a", "b"}, set()))
    clock.now += 1.5
    assert not rule.due(1, _names({"a"}, set()))  # one left (its lease lapsed): below the minimum
    clock.now += 1.0
    assert not rule.due(2, _names({"a", "b"}, set()))  # back at two: a fresh last call


def test_a_re_forming_round_forms_once_everyone_to_come_is_in_for_the_grace() -> None:
    clock = Clock()
    rule = CloseRule(2, 8, last_call_s=30, reforming=True, grace_s=0.25, clock=clock)
    assert not rule.due(2, _names({"a", "b"}, {"a", "b", "c"}))  # c, alive in the round before, is not in yet
    assert not rule.due(3, _names({"a", "b", "c"}, {"a", "b", "c"}))  # everyone in: the grace starts
    clock.now += 0.25
    assert rule.due(3, _names({"a", "b", "c"}, {"a", "b", "c"})) and rule.reason == "everyone_in"


def test_a_new_node_in_the_grace_starts_it_again() -> None:
    clock = Clock()
    rule = CloseRule(2, 8, last_call_s=30, reforming=True, grace_s=0.25, clock=clock)
    rule.due(2, _names({"a", "b"}, {"a"}))
    clock.now += 0.125
    assert not rule.due(3, _names({"a", "b", "c"}, {"a"}))
    clock.now += 0.125
    assert not rule.due(3, _names({"a", "b", "c"}, {"a"}))
    clock.now += 0.125
    assert rule.due(3, _names({"a", "b", "c"}, {"a"}))


def test_a_first_round_never_skips_the_last_call_even_with_everyone_in() -> None:
    clock = Clock()
    rule = CloseRule(2, 8, last_call_s=30, reforming=False, clock=clock)
    rule.due(3, _names({"a", "b", "c"}, set()))
    clock.now += 5
    assert not rule.due(3, _names({"a", "b", "c"}, set()))


def test_the_round_record_round_trips_and_moves_on() -> None:
    assert RoundRecord.decode(FIRST_ROUND.encode().encode()) == FIRST_ROUND == RoundRecord(0, open=True)
    formed = FIRST_ROUND.formed()
    assert (formed.round, formed.open) == (0, False)
    assert formed.next() == RoundRecord(1, open=True)
    assert formed.closing().closed and RoundRecord.decode(formed.closing().encode().encode()).closed


@dataclass
class _Answer:
    ID: int
    TTL: int


class _Call:
    """A stand-in LeaseKeepAlive call: answers each request with the TTL the test set for its lease."""

    def __init__(self, requests: Iterator[Any], ttls: dict[int, int], mute: set[int]) -> None:
        self.answers: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.asked = threading.Event()  # a request came
        self.cancelled = False
        threading.Thread(target=self._serve, args=(requests, ttls, mute), daemon=True).start()

    def _serve(self, requests: Iterator[Any], ttls: dict[int, int], mute: set[int]) -> None:
        for lease_id in requests:
            self.asked.set()
            if lease_id not in mute:
                self.answers.put(_Answer(lease_id, ttls.get(lease_id, 0)))

    def __iter__(self) -> Iterator[Any]:
        while (item := self.answers.get()) is not None:
            if isinstance(item, Exception):
                raise item
            yield item

    def cancel(self) -> None:
        self.cancelled = True
        self.answers.put(None)


def _stream(ttls: dict[int, int], mute: set[int] | None = None) -> tuple[KeepAliveStream, list[_Call]]:
    calls: list[_Call] = []

    def open_call(requests: Iterator[Any]) -> _Call:
        calls.append(_Call(requests, ttls, mute or set()))
        return calls[-1]

    return KeepAliveStream(open_call, lambda lease: lease), calls


def test_refreshes_of_several_leases_share_one_stream_and_get_their_own_ttl() -> None:
    stream, calls = _stream({1: 5, 2: 9})
    assert [stream.refresh(1, 2.0), stream.refresh(2, 2.0), stream.refresh(1, 2.0)] == [5, 9, 5]
    assert len(calls) == 1
    assert stream.refresh(3, 2.0) == 0  # a lease etcd no longer knows


def test_a_refresh_without_an_answer_times_out_and_the_next_opens_a_new_stream() -> None:
    stream, calls = _stream({1: 5, 2: 7}, mute={2})
    with pytest.raises(TimeoutError):
        stream.refresh(2, 0.2)
    assert calls[0].cancelled
    assert stream.refresh(1, 2.0) == 5 and len(calls) == 2


def test_a_stream_that_fails_fails_its_waiting_refresh_and_a_closed_one_refreshes_no_more() -> None:
    stream, calls = _stream({1: 5}, mute={1})
    result: list[BaseException] = []

    def refresh() -> None:
        try:
            stream.refresh(1, 5.0)
        except StreamBroken as exc:
            result.append(exc)

    waiting = threading.Thread(target=refresh)
    waiting.start()
    while not calls:
        threading.Event().wait(0.01)
    assert calls[0].asked.wait(5)
    calls[0].answers.put(RuntimeError("etcd went away"))
    waiting.join(5)
    assert result and "etcd went away" in str(result[0])
    stream.close()
    with pytest.raises(StreamBroken):
        stream.refresh(1, 1.0)
