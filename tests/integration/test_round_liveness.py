"""A forming round's waits end within seconds when a member dies: our handler and store on a real etcd.

Handlers of one process stand in for nodes (the rendezvous tells them apart by a local id, and ranks them in order of
creation). A node "dies" by stopping its keep-alive heartbeats and never writing again, which is all its peers can
see of a SIGKILL; tests/integration/test_rendezvous_churn.py kills real daemons.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import pytest
from torch.distributed.elastic.agent.server.api import SimpleElasticAgent
from torch.distributed.elastic.rendezvous import RendezvousInfo, RendezvousParameters

from elasticd import envvars
from elasticd.etcd.server import EmbeddedEtcd
from elasticd.rendezvous import handler as rdzv
from elasticd.rendezvous.liveness import RoundAbandonedError

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

# A dead member leaves the state 3 s after its last heartbeat (3 x 1 s) and is seen within a 1 s look; generous
# for a loaded machine, and far below the 300 s store timeout the waits had before.
NOTICED_WITHIN_S = 15.0


class _Died(Exception):
    """The doomed node's thread ends here: from now on it neither heartbeats nor writes."""


def _params(endpoint: str, run_id: str) -> RendezvousParameters:
    return RendezvousParameters("etcd-v3", endpoint, run_id, 2, 3, local_addr="127.0.0.1")


@pytest.fixture
def handlers(etcd: EmbeddedEtcd, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> Iterator[Any]:
    monkeypatch.setenv(envvars.TORCH_DISABLE_SHARED_STORE, "1")  # next_rendezvous sets it; restored after
    made = [rdzv.create_handler(_params(etcd.endpoint, request.node.name[:40].replace("[", "-"))) for _ in range(3)]
    yield made
    for handler in made:
        handler._stop_heartbeats()


def _die(handler: rdzv.ElasticdRendezvousHandler) -> None:
    handler._stop_heartbeats()
    raise _Died


def _all(fns: list[Callable[[], Any]]) -> list[Any]:
    """Run each function on a thread of its own; returns each result or the exception it raised."""

    def call(fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception as exc:  # the test inspects it
            return exc

    with ThreadPoolExecutor(len(fns)) as pool:
        return list(pool.map(call, fns))


def _reform(survivors: list[rdzv.ElasticdRendezvousHandler]) -> list[RendezvousInfo]:
    infos = _all([h.next_rendezvous for h in survivors])
    assert all(isinstance(i, RendezvousInfo) for i in infos), infos
    assert sorted(i.rank for i in infos) == [0, 1] and {i.world_size for i in infos} == {2}
    addresses = {(i.bootstrap_store_info.master_addr, i.bootstrap_store_info.master_port) for i in infos}
    assert len(addresses) == 1
    return infos


def test_rank0_dying_before_it_publishes_the_store_address_ends_the_wait_in_seconds(handlers: list[Any]) -> None:
    doomed, survivors = handlers[0], handlers[1:]  # created first: rank 0 (same address and pid, lowest local id)
    doomed._get_store = lambda: _die(doomed)
    started = time.monotonic()
    results = _all([h.next_rendezvous for h in handlers])
    elapsed_s = time.monotonic() - started
    assert isinstance(results[0], _Died)
    for error in results[1:]:
        assert isinstance(error, RoundAbandonedError), error
        assert error.round == 0 and error.phase == "store_address"
        assert doomed.member in error.lost and error.reason == "member_lost"
        assert error.waited_s < NOTICED_WITHIN_S
    assert elapsed_s < NOTICED_WITHIN_S + 5
    _reform(survivors)
    assert [h.round for h in survivors] == [1, 1]
    print(json.dumps({"before_publish_abandoned_s": [round(e.waited_s, 2) for e in results[1:]]}))


def _assign_worker_ranks(info: RendezvousInfo) -> Any:
    """torch's own rank assignment, as the agent runs it right after the rendezvous."""
    spec = SimpleNamespace(role="default", local_world_size=1)
    return SimpleElasticAgent._assign_worker_ranks(None, info.store, info.rank, info.world_size, spec)


def test_rank0_dying_after_it_published_ends_the_rank_assignment_wait(handlers: list[Any]) -> None:
    doomed, survivors = handlers[0], handlers[1:]
    infos = _all([h.next_rendezvous for h in handlers])
    assert [i.rank for i in infos] == [0, 1, 2]
    doomed._stop_heartbeats()  # dies right after publishing, before assigning worker ranks

    errors = _all([functools.partial(_assign_worker_ranks, info) for info in infos[1:]])
    for error in errors:
        assert isinstance(error, RoundAbandonedError), error
        assert error.phase == "rank_assignment" and error.lost == (doomed.member,)
        assert error.waited_s < NOTICED_WITHIN_S
    _reform(survivors)


def test_any_member_dying_before_it_wrote_its_part_ends_everyone_elses_wait(handlers: list[Any]) -> None:
    doomed = handlers[2]  # not rank 0: rank 0 publishes the store address, then waits for the dead one's role
    doomed._get_store = lambda: _die(doomed)  # decided into the round as rank 2, then dead
    infos = _all([h.next_rendezvous for h in handlers])
    assert [i.rank for i in infos[:2]] == [0, 1] and isinstance(infos[2], _Died)
    errors = _all([functools.partial(_assign_worker_ranks, info) for info in infos[:2]])
    for error in errors:
        assert isinstance(error, RoundAbandonedError), error
        assert error.phase == "rank_assignment" and error.waited_s < NOTICED_WITHIN_S
    # rank 0 names the dead member; rank 1 either does too or sees rank 0 give the round up first
    assert errors[0].lost == (doomed.member,)
    assert doomed.member in errors[1].lost or handlers[0].member in errors[1].left + errors[1].lost


def test_a_member_lost_after_the_round_formed_counts_as_waiting_until_the_workers_formed(
    handlers: list[Any],
) -> None:
    infos = _all([h.next_rendezvous for h in handlers])
    assert [i.rank for i in infos] == [0, 1, 2]
    for handler in handlers:
        handler.end_round_watch()
    heard: list[tuple[dict[str, int], dict[str, int]]] = []
    workers_formed = {"b": False, "c": True}
    handlers[1].watch_members(lambda: workers_formed["b"], lambda lost, left: heard.append((lost, left)))
    handlers[2].watch_members(lambda: workers_formed["c"])
    assert handlers[1].num_nodes_waiting() == 0
    handlers[0]._stop_heartbeats()  # rank 0 dies after everyone started workers
    deadline = time.monotonic() + NOTICED_WITHIN_S
    while handlers[1].num_nodes_waiting() == 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert handlers[1].num_nodes_waiting() == 1
    assert heard == [({handlers[0].member: 0}, {})]  # told once
    # c's workers had formed their process group: a lost member is theirs to fail on, not a join.
    assert handlers[2].num_nodes_waiting() == 0
    workers_formed["b"] = True
    assert handlers[1].num_nodes_waiting() == 0
