"""How a node id's holder on another machine is judged alive: its lease's remaining TTL (whole seconds, as etcd
reports it) falling less than the time that passed proves a refresh; nothing else does."""

from __future__ import annotations

import pytest

from elasticd.agent.registry import Holder, HolderState


def _judge(*readings: tuple[int, int, float]) -> list[HolderState]:
    holder = Holder(client=None, key="/k")  # type: ignore[arg-type]  # _judge_ttl never calls etcd
    return [holder._judge_ttl(lease, ttl, now) for lease, ttl, now in readings]


@pytest.mark.parametrize(
    ("readings", "last"),
    [
        (((1, 9, 0.0), (1, 9, 1.3)), HolderState.ALIVE),  # 1.3 s passed, the TTL did not fall: refreshed
        (((1, 9, 0.0), (1, 9, 1.0)), HolderState.UNKNOWN),  # 1 s of rounding and latency could hide the fall
        (((1, 9, 0.0), (1, 8, 1.3)), HolderState.UNKNOWN),  # fell as time passed: no proof of life
        (((1, 8, 0.0), (1, 9, 0.3)), HolderState.ALIVE),  # went up: refreshed
        (((1, 9, 0.0), (1, 6, 3.0)), HolderState.UNKNOWN),  # a dead holder's lease running out
        (((1, 9, 0.0), (2, 9, 5.0)), HolderState.UNKNOWN),  # another lease: start over
        (((1, 9, 0.0), (1, -1, 5.0)), HolderState.FREE),  # expired
    ],
)
def test_remaining_ttl_proves_a_refresh_only_when_it_fell_less_than_the_time_passed(
    readings: tuple[tuple[int, int, float], ...], last: HolderState
) -> None:
    states = _judge(*readings)
    assert states[0] in (HolderState.UNKNOWN, HolderState.FREE)
    assert states[-1] == last
