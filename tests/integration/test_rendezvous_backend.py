"""EtcdV3RendezvousBackend on a real etcd: torch's compare-and-set contract, fencing tokens, the lease."""

from __future__ import annotations

import pickle
import re
import shutil
from collections.abc import Iterator

import pytest
from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousStateError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import Token

from elasticd.endpoints import parse_endpoints
from elasticd.etcd.client import EtcdClient
from elasticd.etcd.server import EmbeddedEtcd
from elasticd.keys import RunKeys
from elasticd.rendezvous.backend import DEFAULT_TTL_S, EtcdV3RendezvousBackend
from tests.helpers import ETCD_READY_TIMEOUT_S

pytestmark = pytest.mark.integration

RUN = "run1"


def _state(n: int) -> bytes:
    return pickle.dumps({"round": n})  # torch's state holder writes a pickle; any pickle stands in for it


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def backend(etcd_client: EtcdClient) -> EtcdV3RendezvousBackend:
    return EtcdV3RendezvousBackend(etcd_client, RUN)


@pytest.fixture
def other(etcd: EmbeddedEtcd) -> Iterator[EtcdV3RendezvousBackend]:
    """A second node's backend, with its own connection."""
    client = EtcdClient.connect(parse_endpoints(etcd.endpoint), connect_timeout_s=ETCD_READY_TIMEOUT_S)
    yield EtcdV3RendezvousBackend(client, RUN)
    client.close()


def _token(result: tuple[bytes, Token, bool] | None) -> Token:
    assert result is not None, "set_state left no state"
    return result[1]


def test_name_is_etcd_v3_and_state_key_is_the_runs_rdzv_state(backend: EtcdV3RendezvousBackend) -> None:
    assert backend.name == "etcd-v3"
    assert backend.key == RunKeys(RUN).rdzv_state == "/elasticd/run1/rdzv/state"


def test_no_state_reads_as_none(backend: EtcdV3RendezvousBackend) -> None:
    assert backend.get_state() is None


def test_token_none_creates_the_state_and_the_token_is_its_mod_revision(
    backend: EtcdV3RendezvousBackend, etcd_client: EtcdClient
) -> None:
    result = backend.set_state(_state(1))
    assert result is not None
    state, token, has_set = result
    assert (state, has_set) == (_state(1), True)
    assert etcd_client.get(backend.key) == (_state(1), token)
    assert backend.get_state() == (_state(1), token)


def test_token_none_does_not_overwrite_an_existing_state(
    backend: EtcdV3RendezvousBackend, other: EtcdV3RendezvousBackend
) -> None:
    first = backend.set_state(_state(1))
    assert first is not None
    assert other.set_state(_state(2), None) == (_state(1), first[1], False)


def test_matching_token_replaces_the_state_and_issues_a_new_token(backend: EtcdV3RendezvousBackend) -> None:
    first = backend.set_state(_state(1))
    assert first is not None
    second = backend.set_state(_state(2), first[1])
    assert second is not None
    assert second[0] == _state(2) and second[2] is True
    assert second[1] > first[1]
    assert backend.get_state() == (_state(2), second[1])


def test_lost_race_returns_the_winners_state_and_token(
    backend: EtcdV3RendezvousBackend, other: EtcdV3RendezvousBackend
) -> None:
    created = backend.set_state(_state(0))
    assert created is not None
    token = created[1]
    # Both nodes read the same token; the first writer wins, the second learns what won.
    won = backend.set_state(_state(1), token)
    lost = other.set_state(_state(2), token)
    assert won is not None and won[2] is True
    assert lost == (_state(1), won[1], False)
    # With the winner's token the loser succeeds on its next attempt, as torch's state holder retries.
    retried = other.set_state(_state(2), lost[1])
    assert retried is not None and retried[2] is True


def test_stale_token_never_overwrites_a_newer_state(backend: EtcdV3RendezvousBackend) -> None:
    first = backend.set_state(_state(1))
    assert first is not None
    second = backend.set_state(_state(2), first[1])
    assert second is not None
    assert backend.set_state(_state(3), first[1]) == (_state(2), second[1], False)


@pytest.mark.parametrize("bad_token", ["not-a-number", object(), b"\xff"])
def test_invalid_token_returns_the_current_state_without_writing(
    backend: EtcdV3RendezvousBackend, bad_token: object
) -> None:
    first = backend.set_state(_state(1))
    assert first is not None
    assert backend.set_state(_state(2), bad_token) == (_state(1), first[1], False)


def test_invalid_token_with_no_state_returns_none(backend: EtcdV3RendezvousBackend) -> None:
    assert backend.set_state(_state(1), "garbage") is None
    assert backend.get_state() is None


def test_token_for_a_deleted_state_returns_none(backend: EtcdV3RendezvousBackend, etcd_client: EtcdClient) -> None:
    first = backend.set_state(_state(1))
    assert first is not None
    etcd_client.delete(backend.key)
    assert backend.set_state(_state(2), first[1]) is None


def test_state_rides_on_a_lease_of_two_hours_owned_by_the_backend(
    backend: EtcdV3RendezvousBackend, etcd_client: EtcdClient
) -> None:
    backend.set_state(_state(1))
    lease = backend.lease_id
    assert lease is not None
    assert etcd_client.lease_of(backend.key) == lease
    assert DEFAULT_TTL_S - 60 < etcd_client.lease_ttl(lease) <= DEFAULT_TTL_S


def test_lease_is_granted_once_and_reused_between_refreshes(etcd_client: EtcdClient) -> None:
    clock = FakeClock()
    backend = EtcdV3RendezvousBackend(etcd_client, RUN, ttl_s=60, clock=clock)
    token = _token(backend.set_state(_state(1)))
    lease = backend.lease_id
    clock.now += 10  # < ttl/4: no refresh, same lease
    token = _token(backend.set_state(_state(2), token))
    assert backend.lease_id == lease
    clock.now += 20  # > ttl/4 since the grant: refreshed, still the same lease
    backend.set_state(_state(3), token)
    assert backend.lease_id == lease
    assert etcd_client.lease_of(backend.key) == lease


def test_an_expired_lease_is_regranted_at_refresh_time(etcd_client: EtcdClient) -> None:
    clock = FakeClock()
    backend = EtcdV3RendezvousBackend(etcd_client, RUN, ttl_s=60, clock=clock)
    backend.set_state(_state(1))
    old_lease = backend.lease_id
    assert old_lease is not None
    etcd_client.revoke_lease(old_lease)  # what expiry does: the lease and its key are gone
    clock.now += 60
    result = backend.set_state(_state(2), None)
    assert result is not None and result[2] is True
    assert backend.lease_id not in (None, old_lease)
    assert etcd_client.lease_of(backend.key) == backend.lease_id


def test_lease_is_regranted_after_etcd_restarts_without_its_data(
    etcd: EmbeddedEtcd, backend: EtcdV3RendezvousBackend, etcd_client: EtcdClient
) -> None:
    backend.set_state(_state(1))
    old_lease = backend.lease_id
    etcd.stop()
    shutil.rmtree(etcd.data_dir / "data")  # an etcd pod without a volume comes back empty, leases and all
    etcd.start(ready_timeout_s=ETCD_READY_TIMEOUT_S)
    assert backend.get_state() is None
    # The backend still believes in its lease; the write fails on it, a new lease is taken, the write retried.
    result = backend.set_state(_state(2), None)
    assert result is not None and result[0] == _state(2) and result[2] is True
    assert backend.lease_id not in (None, old_lease)
    assert etcd_client.lease_of(backend.key) == backend.lease_id


def test_state_survives_an_etcd_restart_with_its_data(etcd: EmbeddedEtcd, backend: EtcdV3RendezvousBackend) -> None:
    created = backend.set_state(_state(1))
    assert created is not None
    etcd.restart(ready_timeout_s=ETCD_READY_TIMEOUT_S)
    assert backend.get_state() == (_state(1), created[1])
    updated = backend.set_state(_state(2), created[1])
    assert updated is not None and updated[2] is True


def test_undecodable_state_raises_rendezvous_state_error(
    backend: EtcdV3RendezvousBackend, etcd_client: EtcdClient
) -> None:
    etcd_client.put(backend.key, b"not a pickle")
    with pytest.raises(RendezvousStateError, match="corrupt"):
        backend.get_state()
    with pytest.raises(RendezvousStateError):
        backend.set_state(_state(1), None)  # loses (the key exists) and returns what is there: corrupt


def test_unreachable_etcd_raises_rendezvous_connection_error_and_is_counted(etcd: EmbeddedEtcd) -> None:
    errors: list[Exception] = []
    client = EtcdClient.connect(
        parse_endpoints(etcd.endpoint),
        connect_timeout_s=ETCD_READY_TIMEOUT_S,
        request_timeout_s=0.5,
        on_error=errors.append,
    )
    backend = EtcdV3RendezvousBackend(client, RUN)
    etcd.stop()
    with pytest.raises(RendezvousConnectionError, match=re.escape(etcd.endpoint)):
        backend.get_state()
    with pytest.raises(RendezvousConnectionError):
        backend.set_state(_state(1))
    assert len(errors) == 2
    client.close()
