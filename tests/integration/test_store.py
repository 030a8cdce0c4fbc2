"""EtcdV3Store against a real etcd: every c10d Store method, blocking reads, timeouts, clones, torch's own C++ check
of a Python store, and torch's own users (PrefixStore, torch.distributed.elastic.utils.store, RendezvousStoreInfo)."""

from __future__ import annotations

import gc
import re
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousStoreInfo
from torch.distributed.elastic.utils import store as store_util

from elasticd.endpoints import parse_endpoints
from elasticd.etcd.client import EtcdClient
from elasticd.etcd.server import EmbeddedEtcd
from elasticd.keys import RunKeys
from elasticd.rendezvous.store import EtcdV3Store
from tests.helpers import ETCD_READY_TIMEOUT_S

pytestmark = pytest.mark.integration

PREFIX = RunKeys("s1").store_prefix
# Bound on a blocking call that another thread releases; generous for a loaded 2-core machine.
RELEASE_TIMEOUT = timedelta(seconds=30)


@pytest.fixture
def store(etcd_client: EtcdClient) -> EtcdV3Store:
    return EtcdV3Store(etcd_client, PREFIX, timeout=RELEASE_TIMEOUT)


@pytest.fixture
def clients(etcd: EmbeddedEtcd) -> Iterator[Callable[[], EtcdV3Store]]:
    """Makes stores on separate connections, as separate nodes would have."""
    made: list[EtcdClient] = []

    def make() -> EtcdV3Store:
        client = EtcdClient.connect(parse_endpoints(etcd.endpoint), connect_timeout_s=ETCD_READY_TIMEOUT_S)
        made.append(client)
        return EtcdV3Store(client, PREFIX, timeout=RELEASE_TIMEOUT)

    yield make
    for client in made:
        client.close()


def _later(seconds: float, action: Callable[[], object]) -> threading.Thread:
    def run() -> None:
        time.sleep(seconds)
        action()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_set_then_get_round_trips_bytes_and_str(store: EtcdV3Store, etcd_client: EtcdClient) -> None:
    store.set("k", b"\x00\xffbinary")
    store.set("s", "text")
    assert store.get("k") == b"\x00\xffbinary"
    assert store.get("s") == b"text"
    assert etcd_client.get(PREFIX + "k") is not None  # keys live under the run's store prefix


def test_blocking_get_is_released_by_a_set_from_another_thread(store: EtcdV3Store) -> None:
    setter = _later(0.3, lambda: store.set("late", b"v"))
    started = time.monotonic()
    assert store.get("late") == b"v"
    assert 0.2 < time.monotonic() - started < RELEASE_TIMEOUT.total_seconds()
    setter.join()


def test_get_times_out_with_torchs_store_error_naming_the_key(store: EtcdV3Store) -> None:
    store.set_timeout(timedelta(milliseconds=300))
    started = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="missing-key") as info:
        store.get("missing-key")
    assert time.monotonic() - started >= 0.3
    assert "300ms" in str(info.value)


def test_wait_returns_when_all_keys_are_set_and_names_only_missing_ones_on_timeout(
    store: EtcdV3Store,
) -> None:
    store.set("a", b"1")
    setter = _later(0.2, lambda: store.set("b", b"2"))
    store.wait(["a", "b"])
    setter.join()
    with pytest.raises(dist.DistStoreError) as info:
        store.wait(["a", "c", "d"], timedelta(milliseconds=200))
    message = str(info.value)
    assert "c" in message and "d" in message and "a," not in message


def test_check_reports_presence_without_waiting(store: EtcdV3Store) -> None:
    store.set("x", b"1")
    started = time.monotonic()
    assert store.check(["x"]) is True
    assert store.check(["x", "y"]) is False
    assert time.monotonic() - started < 5


def test_add_counts_from_zero_and_stores_a_decimal_string(store: EtcdV3Store) -> None:
    assert store.add("n", 5) == 5
    assert store.add("n", -2) == 3
    assert store.get("n") == b"3"
    store.set("bad", b"abc")
    with pytest.raises(dist.DistStoreError, match="not an integer"):
        store.add("bad", 1)


def test_add_is_atomic_across_nodes(clients: Callable[[], EtcdV3Store]) -> None:
    stores = [clients() for _ in range(3)]

    def bump(node: EtcdV3Store) -> list[int]:
        return [node.add("counter", 1) for _ in range(20)]

    with ThreadPoolExecutor(3) as pool:
        results = [value for values in pool.map(bump, stores) for value in values]
    assert sorted(results) == list(range(1, 61))  # every increment seen exactly once
    assert stores[0].get("counter") == b"60"


def test_compare_set_behaves_exactly_like_c10ds_hash_store(store: EtcdV3Store) -> None:
    reference = dist.HashStore()
    steps = [
        ("k", "x", "y"),
        ("k", "", "y"),
        ("k", "z", "w"),
        ("k", "y", "w"),
        ("k", "", "v"),
        ("k", "w", ""),
    ]
    for key, expected, desired in steps:
        assert store.compare_set(key, expected, desired) == reference.compare_set(key, expected, desired)
        assert store.check([key]) == reference.check([key])


def test_multi_set_and_multi_get_keep_order_and_multi_get_waits(store: EtcdV3Store) -> None:
    store.multi_set(["m1", "m2"], [b"1", "2"])
    assert store.multi_get(["m2", "m1"]) == [b"2", b"1"]
    setter = _later(0.2, lambda: store.set("m3", b"3"))
    assert store.multi_get(["m1", "m3"]) == [b"1", b"3"]
    setter.join()
    with pytest.raises(ValueError, match="2 keys but 1 values"):
        store.multi_set(["a", "b"], [b"1"])


def test_delete_key_and_num_keys(store: EtcdV3Store) -> None:
    assert store.num_keys() == 0
    store.set("d1", b"1")
    store.set("d2", b"2")
    assert store.num_keys() == 2
    assert store.delete_key("d1") is True
    assert store.delete_key("d1") is False
    assert store.num_keys() == 1


def test_set_timeout_is_honoured_and_readable(store: EtcdV3Store) -> None:
    store.set_timeout(timedelta(seconds=7))
    assert store.timeout == timedelta(seconds=7)  # type: ignore[attr-defined]  # not in torch's stubs
    with store_util.store_timeout(store, 0.2):
        assert store.timeout == timedelta(seconds=0.2)  # type: ignore[attr-defined]  # not in torch's stubs
        with pytest.raises(dist.DistStoreError):
            store.wait(["never"])
    assert store.timeout == timedelta(seconds=7)  # type: ignore[attr-defined]  # not in torch's stubs


def test_works_wrapped_in_torchs_prefix_store(store: EtcdV3Store, etcd_client: EtcdClient) -> None:
    wrapped = dist.PrefixStore("torch.rendezvous.s1.0", store)
    wrapped.set("key", "value")
    assert wrapped.get("key") == b"value"
    assert wrapped.add("cnt", 2) == 2
    assert wrapped.compare_set("cas", "", "new") == b"new"
    assert wrapped.check(["key"]) and not wrapped.check(["nope"])
    wrapped.multi_set(["a", "b"], ["1", "2"])  # type: ignore[attr-defined]  # not in torch's stubs
    assert wrapped.multi_get(["a", "b"]) == [b"1", b"2"]
    setter = _later(0.2, lambda: wrapped.set("late", "x"))
    wrapped.wait(["late"])
    setter.join()
    wrapped.set_timeout(timedelta(milliseconds=200))
    with pytest.raises(dist.DistStoreError, match=re.escape("torch.rendezvous.s1.0/nope")):
        wrapped.get("nope")
    assert etcd_client.get(PREFIX + "torch.rendezvous.s1.0/key") is not None


def test_torchs_cpp_check_of_a_python_store_passes(store: EtcdV3Store) -> None:
    # add, set and get through torch's pybind trampoline, then clone(): the clone must read what the original wrote
    dist._test_python_store(store)
    assert store.get("key3") == b"15"  # what the check left, read back in Python


def test_a_clone_works_on_its_own_connection_after_the_original_is_closed(etcd: EmbeddedEtcd) -> None:
    client = EtcdClient.connect(parse_endpoints(etcd.endpoint), connect_timeout_s=ETCD_READY_TIMEOUT_S)
    original = EtcdV3Store(client, PREFIX, timeout=timedelta(seconds=7))
    twin = original.clone()
    # a clone C++ asks for: C++ holds only its C++ half, the original keeps the Python half alive
    from_cpp = dist.PrefixStore("round1", original).clone()  # type: ignore[attr-defined]  # not in torch's stubs
    gc.collect()
    original.set("before", b"1")
    client.close()
    with pytest.raises(ValueError, match="closed channel"):
        original.get("before")
    try:
        assert twin.get("before") == b"1" and twin.prefix == original.prefix
        assert twin.timeout == timedelta(seconds=7)  # type: ignore[attr-defined]  # not in torch's stubs
        twin.set("after", b"2")
        assert twin.add("n", 3) == 3 and twin.compare_set("after", "2", "3") == b"3"
        from_cpp.set("key", "value")
        assert from_cpp.get("key") == b"value" and twin.get("round1/key") == b"value"
    finally:
        twin.close()
    with pytest.raises(ValueError, match="closed channel"):
        twin.get("after")


def test_closing_a_store_leaves_the_client_it_was_given_to_its_owner(
    store: EtcdV3Store, etcd_client: EtcdClient
) -> None:
    store.close()
    store.set("still", b"open")
    assert etcd_client.get(PREFIX + "still") is not None


def test_store_util_barrier_releases_three_nodes_together(clients: Callable[[], EtcdV3Store]) -> None:
    # Keep the Python stores referenced: a PrefixStore holds only the C++ half of a Python store, and once the
    # Python object is collected every call ends in "Tried to call pure virtual function" (pybind trampoline).
    nodes = [clients() for _ in range(3)]
    stores = [dist.PrefixStore("round1", node) for node in nodes]
    released: list[float] = []

    def arrive(rank: int) -> None:
        time.sleep(0.1 * rank)  # staggered arrivals: nobody may leave before the last one arrives
        store_util.barrier(stores[rank], 3, key_prefix="barrier", barrier_timeout=30, rank=rank)
        released.append(time.monotonic())

    started = time.monotonic()
    with ThreadPoolExecutor(3) as pool:
        list(pool.map(arrive, range(3)))
    assert len(released) == 3
    assert min(released) - started >= 0.2


def test_store_util_synchronize_exchanges_data_between_three_nodes(
    clients: Callable[[], EtcdV3Store],
) -> None:
    stores = [clients() for _ in range(3)]

    def sync(rank: int) -> list[bytes]:
        return store_util.synchronize(stores[rank], f"node{rank}".encode(), rank, 3, "sync/", timeout=30)

    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(sync, range(3)))
    assert results == [[b"node0", b"node1", b"node2"]] * 3


def test_rendezvous_store_info_build_shares_rank0s_address(clients: Callable[[], EtcdV3Store]) -> None:
    nodes = [clients() for _ in range(2)]
    stores = [dist.PrefixStore("torch.rendezvous.s1.1", node) for node in nodes]
    with ThreadPoolExecutor(2) as pool:
        follower = pool.submit(RendezvousStoreInfo.build, 1, stores[1], "10.0.0.2")
        leader = pool.submit(RendezvousStoreInfo.build, 0, stores[0], "10.0.0.1", 29555)
        infos = [leader.result(), follower.result()]
    assert [(i.master_addr, i.master_port) for i in infos] == [("10.0.0.1", 29555)] * 2


def test_blocking_get_survives_an_etcd_restart(etcd: EmbeddedEtcd, store: EtcdV3Store) -> None:
    def restart_then_set() -> None:
        etcd.restart(ready_timeout_s=ETCD_READY_TIMEOUT_S)
        store.set("after-restart", b"ok")

    worker = _later(0.3, restart_then_set)
    assert store.get("after-restart") == b"ok"
    worker.join()


def test_etcd_failure_raises_torchs_network_error(etcd: EmbeddedEtcd) -> None:
    client = EtcdClient.connect(
        parse_endpoints(etcd.endpoint), connect_timeout_s=ETCD_READY_TIMEOUT_S, request_timeout_s=0.5
    )
    store = EtcdV3Store(client, PREFIX)
    etcd.stop()
    with pytest.raises(dist.DistNetworkError, match=re.escape(etcd.endpoint)):
        store.set("k", b"v")
    client.close()
