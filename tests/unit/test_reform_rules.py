"""The rules that speed up a re-forming round, decided on torch's rendezvous state alone (no etcd, no process):
when a forming round may close without the last call (quorum.py), when the next wait must end (wakeup.py), and when
a member whose liveness lease is gone leaves the state before its heartbeat expires (lapsed.py)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    RendezvousSettings,
    RendezvousTimeout,
    _Action,
    _NodeDesc,
    _RendezvousContext,
    _RendezvousState,
)

from elasticd.rendezvous import lapsed, wakeup
from elasticd.rendezvous.lapsed import LapsedNodes
from elasticd.rendezvous.quorum import CloseWhenEveryoneIsIn, everyone_in

NOW = datetime(2026, 11, 30, 12, 0, 0, tzinfo=UTC)
A, B, C = (_NodeDesc("127.0.0.1", pid, 0) for pid in (101, 102, 103))


def _settings(min_nodes: int = 2, max_nodes: int = 3) -> RendezvousSettings:
    return RendezvousSettings(
        "run", min_nodes, max_nodes, RendezvousTimeout(last_call=timedelta(seconds=2)), timedelta(seconds=1), 3
    )


def _forming(*participants: _NodeDesc, waiting: tuple[_NodeDesc, ...] = ()) -> _RendezvousState:
    """A round that torch's last call is running for: ``participants`` joined, ``waiting`` wait for the next."""
    state = _RendezvousState()
    state.round = 4
    for node in participants:
        state.participants[node] = 0
    state.wait_list = set(waiting)
    state.last_heartbeats = {node: NOW for node in (*participants, *waiting)}
    state.deadline = NOW + timedelta(seconds=2)
    return state


def _ctx(state: _RendezvousState, node: _NodeDesc = A, **settings: Any) -> _RendezvousContext:
    return _RendezvousContext(node, state, _settings(**settings))


def test_a_round_holding_every_node_with_a_heartbeat_may_close() -> None:
    assert everyone_in(_ctx(_forming(A, B)))


@pytest.mark.parametrize(
    ("state", "why"),
    [
        (_forming(A, B, waiting=(C,)), "a node waits to join"),
        (_forming(A), "fewer than min_nodes"),
        (_forming(B, C), "this node is not in the round"),
    ],
)
def test_a_round_does_not_close_early_while(state: _RendezvousState, why: str) -> None:
    assert not everyone_in(_ctx(state)), why


def test_a_live_node_outside_the_round_keeps_it_open() -> None:
    state = _forming(A, B)
    state.last_heartbeats[C] = NOW  # e.g. a member of the previous round that has not left it yet
    assert not everyone_in(_ctx(state))


def test_a_complete_or_closed_round_or_one_without_a_last_call_is_left_to_torch() -> None:
    complete, closed, no_deadline = _forming(A, B), _forming(A, B), _forming(A, B)
    complete.complete, closed.closed, no_deadline.deadline = True, True, None
    for state in (complete, closed, no_deadline):
        assert not everyone_in(_ctx(state))


def test_more_participants_than_max_nodes_never_close() -> None:
    assert not everyone_in(_ctx(_forming(A, B, C), max_nodes=2))


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _join(action: _Action, enabled: bool, closed: list[tuple[int, int]], clock: _Clock) -> CloseWhenEveryoneIsIn:
    return CloseWhenEveryoneIsIn(
        lambda c, d: action, lambda: enabled, lambda r, n: closed.append((r, n)), grace_s=0.5, clock=clock
    )


def test_the_join_closes_once_everyone_has_been_in_for_the_grace() -> None:
    closed: list[tuple[int, int]] = []
    clock = _Clock()
    join = _join(_Action.SYNC, True, closed, clock)
    ctx = _ctx(_forming(A, B))
    assert join(ctx, 0.0) is _Action.SYNC  # everyone in: the grace starts
    assert join.due_in() == pytest.approx(0.5)
    clock.now += 0.25
    assert join(ctx, 0.0) is _Action.SYNC
    assert join.due_in() == pytest.approx(0.25)
    clock.now += 0.25
    assert join(ctx, 0.0) is _Action.MARK_RENDEZVOUS_COMPLETE
    assert closed == [(4, 2)]


def test_a_change_of_the_participants_restarts_the_grace() -> None:
    closed: list[tuple[int, int]] = []
    clock = _Clock()
    join = _join(_Action.SYNC, True, closed, clock)
    assert join(_ctx(_forming(A, B)), 0.0) is _Action.SYNC
    clock.now += 0.375
    assert join(_ctx(_forming(A, B, C)), 0.0) is _Action.SYNC  # C came in: a new set, a new grace
    clock.now += 0.375
    assert join(_ctx(_forming(A, B, C)), 0.0) is _Action.SYNC
    clock.now += 0.125
    assert join(_ctx(_forming(A, B, C)), 0.0) is _Action.MARK_RENDEZVOUS_COMPLETE
    assert closed == [(4, 3)]


def test_a_node_seen_waiting_during_the_grace_keeps_the_round_open() -> None:
    closed: list[tuple[int, int]] = []
    clock = _Clock()
    join = _join(_Action.SYNC, True, closed, clock)
    assert join(_ctx(_forming(A, B)), 0.0) is _Action.SYNC
    clock.now += 0.2
    assert join(_ctx(_forming(A, B, waiting=(C,))), 0.0) is _Action.SYNC  # C between two rounds shows up
    assert join.due_in() is None
    clock.now += 1.0
    assert join(_ctx(_forming(A, B, waiting=(C,))), 0.0) is _Action.SYNC
    assert closed == []


def test_the_join_leaves_torchs_own_actions_and_first_rounds_alone() -> None:
    closed: list[tuple[int, int]] = []
    clock = _Clock()
    first_round = _join(_Action.SYNC, False, closed, clock)
    acting = _join(_Action.KEEP_ALIVE, True, closed, clock)
    for _ in range(2):
        assert first_round(_ctx(_forming(A, B)), 0.0) is _Action.SYNC
        assert acting(_ctx(_forming(A, B)), 0.0) is _Action.KEEP_ALIVE
        clock.now += 1.0
    assert closed == []


class _Holder:
    def __init__(self, state: _RendezvousState) -> None:
        self.state = state
        self._last_sync_time = 5.0


def _wakeup(state: _RendezvousState, now: datetime = NOW, **kwargs: Any) -> wakeup.StateWakeup:
    """A wakeup that knows no revision (so it sleeps, through ``sleep=`` if given) and reads no etcd."""
    return wakeup.StateWakeup(
        None,  # type: ignore[arg-type]  # no etcd client: this wakeup never reads
        "/key",
        lambda: None,
        _Holder(state),  # type: ignore[arg-type]  # a fake of torch's state holder
        A,
        _settings(),
        now=lambda: now,
        **kwargs,
    )


def test_the_next_wait_ends_at_the_earliest_due_time_of_the_state() -> None:
    state = _forming(A, B)
    state.deadline = NOW + timedelta(seconds=1.5)
    state.last_heartbeats = {A: NOW - timedelta(seconds=0.2), B: NOW - timedelta(seconds=2.6)}
    # ours is due in 0.8 s, B expires in 0.4 s (3 x 1 s after its beat), the last call ends in 1.5 s
    assert _wakeup(state).due_in(state) == pytest.approx(0.4 + wakeup.DUE_MARGIN_S)


def test_times_already_past_do_not_shorten_the_wait() -> None:
    state = _forming(A, B)
    state.deadline = NOW - timedelta(seconds=1)
    state.last_heartbeats = {A: NOW - timedelta(seconds=5), B: NOW - timedelta(seconds=9)}
    assert _wakeup(state).due_in(state) is None


def test_the_last_call_of_a_complete_round_is_not_a_due_time() -> None:
    state = _forming(A)
    state.complete, state.last_heartbeats = True, {}
    assert _wakeup(state).due_in(state) is None


def test_a_wait_without_a_known_revision_sleeps_and_the_next_read_skips_torchs_cache() -> None:
    state = _forming(A, B)
    state.last_heartbeats = {}
    slept: list[float] = []
    waker = _wakeup(state, sleep=slept.append)
    state.deadline = NOW + timedelta(seconds=0.3)
    waker.wait(1.0)
    assert slept == [pytest.approx(0.3 + wakeup.DUE_MARGIN_S)]
    assert waker.woken == {"change": 0, "due": 1, "poll": 0}
    assert waker._holder._last_sync_time == -1


def test_a_due_time_of_the_handler_ends_the_wait_too() -> None:
    state = _forming(A, B)
    state.last_heartbeats, state.deadline = {}, None
    slept: list[float] = []
    waker = _wakeup(state, also_due=lambda: 0.12, sleep=slept.append)
    waker.wait(1.0)
    assert slept == [pytest.approx(0.12)]
    assert waker.woken == {"change": 0, "due": 1, "poll": 0}
    assert waker._holder._last_sync_time == -1


def test_torchs_private_rendezvous_parts_are_where_the_wakeup_expects_them() -> None:
    """When this fails after a torch upgrade, the message names the entries of elasticd/privates/torch_surfaces.py
    that moved: re-read dynamic_rendezvous.py and adapt their users."""
    assert wakeup.surface_problems() == []
    assert wakeup.install()


class _SanitizingHolder:
    """The two things LapsedNodes uses of torch's holder: its state and its sanitizer (torch's: heartbeat expiry)."""

    def __init__(self, state: _RendezvousState) -> None:
        self.state = state
        self.torch_sanitized = 0

    def _sanitize(self) -> None:
        self.torch_sanitized += 1


def _lapsed(state: _RendezvousState, leases: set[str] | None) -> tuple[_SanitizingHolder, LapsedNodes, list[str]]:
    holder = _SanitizingHolder(state)
    told: list[str] = []
    nodes = LapsedNodes(
        holder,  # type: ignore[arg-type]  # a fake of torch's state holder
        _settings(),
        A,
        lambda: None if leases is None else frozenset(leases),
        on_removed=told.append,
        now=lambda: NOW,
    )
    return holder, nodes, told


def _complete_round(*participants: _NodeDesc, waiting: tuple[_NodeDesc, ...] = ()) -> _RendezvousState:
    state = _forming(*participants, waiting=waiting)
    state.complete, state.deadline = True, None
    return state


def test_a_killed_member_whose_lease_is_gone_leaves_the_state_and_the_next_round_begins() -> None:
    # round 4 was B alone left (A and C restarted and wait for round 5); B was killed 1.3 s ago, its lease is gone
    state = _complete_round(B, waiting=(A, C))
    state.last_heartbeats[B] = NOW - timedelta(seconds=1.3)
    holder, nodes, told = _lapsed(state, {repr(A), repr(C)})
    holder._sanitize()
    assert holder.torch_sanitized == 1  # torch's own rule still runs first
    assert B not in state.participants and B not in state.last_heartbeats
    assert (state.round, state.complete) == (5, False)  # torch's epilogue: no participant left, the next round
    assert told == [repr(B)] and nodes.due_in() is None
    holder._sanitize()  # the next read of a state that still holds B (nobody wrote yet) removes it again, quietly
    assert told == [repr(B)]


@pytest.mark.parametrize(
    ("late_s", "leases", "why"),
    [
        (0.5, set(), "its heartbeat is not late: it beats every second"),
        (1.3, {repr(B)}, "its lease holds: a live node that is only slow"),
        (1.3, None, "the leases could not be read: torch's heartbeat rule decides"),
    ],
)
def test_a_member_stays_in_the_state_when(late_s: float, leases: set[str] | None, why: str) -> None:
    state = _complete_round(B, waiting=(A, C))
    state.last_heartbeats[B] = NOW - timedelta(seconds=late_s)
    holder, _, told = _lapsed(state, leases)
    holder._sanitize()
    assert B in state.participants and B in state.last_heartbeats and state.round == 4 and not told, why


def test_while_a_heartbeat_is_late_the_loop_looks_again_soon() -> None:
    state = _forming(A, B)
    state.last_heartbeats[B] = NOW - timedelta(seconds=1.3)
    _, nodes, _ = _lapsed(state, {repr(A), repr(B)})
    assert nodes.due_in() == lapsed.POLL_S
    state.last_heartbeats[B] = NOW
    assert nodes.due_in() is None


def test_a_lapsed_node_waiting_for_the_next_round_leaves_the_wait_list() -> None:
    state = _complete_round(A, waiting=(B,))
    state.last_heartbeats[B] = NOW - timedelta(seconds=2)
    holder, _, told = _lapsed(state, {repr(A)})
    holder._sanitize()
    assert B not in state.wait_list and state.round == 4 and told == [repr(B)]  # A still trains in round 4
