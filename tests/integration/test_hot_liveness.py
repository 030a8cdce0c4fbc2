"""Hot recovery's liveness verdicts on real parts: a real socket and process for the probe, a real etcd for the node
lease and the failure watch."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from elasticd.agent.node_lease import NodeLease
from elasticd.etcd.client import EtcdClient
from elasticd.keys import RunKeys
from elasticd.liveness_probe import Probe, ProbeListener, greet, probe
from elasticd.membership import Bid, Membership
from elasticd.worker.hot.silence import SilenceWatch
from elasticd.worker.hot.verdicts import Verdicts
from elasticd.worker.hot.watch import FailureWatch
from tests.integration.cluster import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

KEYS = RunKeys("liveness")
SETTLE_S = 5.0  # generous "eventually" on a loaded box

_LISTENER = """
import sys, time
from elasticd.liveness_probe import ProbeListener
listener = ProbeListener("127.0.0.1")
print(listener.port, flush=True)
time.sleep(120)
"""


def test_a_listening_process_is_accepted_a_killed_one_refused_a_stopped_one_still_accepted() -> None:
    proc = subprocess.Popen([sys.executable, "-c", _LISTENER], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        address = f"127.0.0.1:{int(proc.stdout.readline())}"
        assert probe(address) is Probe.ACCEPTED
        os.kill(proc.pid, signal.SIGSTOP)  # a stopped process: the kernel still accepts; the lease must decide
        assert probe(address) is Probe.ACCEPTED
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        started = time.monotonic()
        assert probe(address) is Probe.REFUSED
        assert time.monotonic() - started < 0.1  # the kernel answers at once: no timeout involved
    finally:
        proc.kill()
        proc.wait(timeout=10)


def stop(pid: int) -> None:
    """SIGSTOP ``pid`` and wait until the kernel has stopped it: kill() returns before a process running on another
    core is stopped, which it then answers a greeting in time (seen once in the suite)."""
    os.kill(pid, signal.SIGSTOP)
    wait_until(lambda: _state(pid) == "T", SETTLE_S, f"process {pid} stopped")


def _state(pid: int) -> str:
    stat = Path(f"/proc/{pid}/stat").read_text()  # "pid (comm) state ..."
    return stat.rsplit(")", 1)[1].split()[0]


def test_a_running_listener_greets_a_stopped_one_is_silent_and_a_killed_one_refused() -> None:
    """The greeting tells a stopped process from a running one, where a plain probe cannot (above)."""
    proc = subprocess.Popen([sys.executable, "-c", _LISTENER], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        address = f"127.0.0.1:{int(proc.stdout.readline())}"
        assert greet(address) is Probe.ACCEPTED
        stop(proc.pid)
        started = time.monotonic()
        assert greet(address, 0.3) is Probe.SILENT
        assert time.monotonic() - started < 0.3 + SETTLE_S
        os.kill(proc.pid, signal.SIGCONT)
        assert greet(address) is Probe.ACCEPTED
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        assert greet(address) is Probe.REFUSED
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_the_silence_watch_reports_a_stopped_daemon_once_and_never_a_running_or_unreachable_one() -> None:
    proc = subprocess.Popen([sys.executable, "-c", _LISTENER], stdout=subprocess.PIPE, text=True)
    reports: list[str] = []
    # c: a port whose connections time out (a partition, not this watch's verdict)
    blackhole, filler = _unanswering_listener()
    addresses = {"b": "", "c": f"127.0.0.1:{blackhole.getsockname()[1]}"}
    watch = SilenceWatch(addresses.get, lambda _node, text: reports.append(text), interval_s=0.1, silent_after_s=0.3)
    try:
        assert proc.stdout is not None
        addresses["b"] = f"127.0.0.1:{int(proc.stdout.readline())}"
        watch.follow("a", {"a", "b", "c"})  # a watches b, the node after it
        time.sleep(1.0)
        assert reports == [], "a running daemon was reported"
        os.kill(proc.pid, signal.SIGSTOP)
        wait_until(lambda: reports, SETTLE_S, "the stopped daemon reported")
        time.sleep(0.5)
        assert len(reports) == 1 and "node b's daemon is silent" in reports[0], reports
        watch.follow("b", {"a", "b", "c"})  # b watches c: unreachable, never reported
        time.sleep(1.5)
        assert len(reports) == 1, reports
    finally:
        watch.close()
        proc.kill()
        proc.wait(timeout=10)
        filler.close()
        blackhole.close()


def _unanswering_listener() -> tuple[socket.socket, socket.socket]:
    """A listener whose accept queue one connection fills: the kernel drops every later SYN, so a connection to it
    times out as one across a partition does (an unrouted address is refused by this sandbox's network)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    filler = socket.create_connection(listener.getsockname(), timeout=5)
    assert probe(f"127.0.0.1:{listener.getsockname()[1]}", timeout_s=0.2) is Probe.UNREACHABLE
    return listener, filler


def test_the_silence_watch_reports_a_killed_daemon_at_its_first_refused_greeting() -> None:
    proc = subprocess.Popen([sys.executable, "-c", _LISTENER], stdout=subprocess.PIPE, text=True)
    reports: list[tuple[str, str, float]] = []
    addresses = {"b": ""}
    # silent_after_s far above the test's wait: only the refusal can be what reports the node
    watch = SilenceWatch(
        addresses.get,
        lambda node, text: reports.append((node, text, time.monotonic())),
        interval_s=0.1,
        silent_after_s=30.0,
    )
    try:
        assert proc.stdout is not None
        addresses["b"] = f"127.0.0.1:{int(proc.stdout.readline())}"
        watch.follow("a", {"a", "b"})
        time.sleep(0.5)
        assert reports == [], "a running daemon was reported"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        killed = time.monotonic()
        wait_until(lambda: reports, SETTLE_S, "the killed daemon reported")
        time.sleep(0.5)
        assert len(reports) == 1, reports
        node, text, at = reports[0]
        assert node == "b" and "node b's daemon refused the greeting: gone" in text, reports
        print(f"killed daemon reported {at - killed:.2f}s after it was reaped")
    finally:
        watch.close()
        proc.kill()
        proc.wait(timeout=10)


def test_the_ring_gives_every_node_one_watcher() -> None:
    nodes = {"n2", "n0", "n1"}
    assert [SilenceWatch.successor(n, nodes) for n in ("n0", "n1", "n2")] == ["n1", "n2", "n0"]
    assert SilenceWatch.successor("n0", {"n0"}) is None


def test_an_unroutable_address_is_unreachable_within_the_probe_timeout() -> None:
    started = time.monotonic()
    # TEST-NET-1 (RFC 5737): never routed, so the connection neither succeeds nor is refused
    assert probe("192.0.2.1:9", timeout_s=0.2) in (Probe.UNREACHABLE, Probe.REFUSED)
    assert time.monotonic() - started < 2.0


def test_a_closed_listener_is_refused() -> None:
    listener = ProbeListener("127.0.0.1")
    address = f"127.0.0.1:{listener.port}"
    assert probe(address) is Probe.ACCEPTED
    listener.close()
    assert probe(address) is Probe.REFUSED


def test_the_node_lease_key_goes_away_about_a_second_after_its_daemon_stops_refreshing(
    etcd_client: EtcdClient,
) -> None:
    lease = NodeLease(etcd_client.reconnect(), KEYS, "n1")
    lease.start()
    key = KEYS.membership_alive("n1")
    time.sleep(2.5)  # several TTLs: the refreshes keep it
    assert etcd_client.get(key) is not None
    lease._stop.set()  # the daemon freezes: no refresh, no revoke (what SIGSTOP or power loss does)
    assert lease._thread is not None
    lease._thread.join(timeout=5)
    stopped = time.monotonic()
    wait_until(lambda: etcd_client.get(key) is None, 10, "the lease to expire", poll_s=0.05)
    took = time.monotonic() - stopped
    print(f"node lease key gone {took:.2f}s after the last refresh")
    assert took < 5.0


def test_a_closed_lease_is_revoked_at_once(etcd_client: EtcdClient) -> None:
    lease = NodeLease(etcd_client.reconnect(), KEYS, "n2")
    lease.start()
    lease.close()
    assert etcd_client.get(KEYS.membership_alive("n2")) is None


def test_the_watch_reports_a_notice_of_its_group_and_epoch_and_a_member_node_that_lost_its_lease(
    etcd_client: EtcdClient,
) -> None:
    mine, theirs = NodeLease(etcd_client.reconnect(), KEYS, "w-a"), NodeLease(etcd_client.reconnect(), KEYS, "w-b")
    mine.start()
    theirs.start()
    watch = FailureWatch(etcd_client, KEYS, "grp")
    try:
        watch.follow(3, {"w-a", "w-b"})
        time.sleep(0.3)
        assert watch.reason() is None
        etcd_client.put(KEYS.membership_notice("other-group", 3), "not ours")
        etcd_client.put(KEYS.membership_notice("grp", 2), "an older epoch")
        time.sleep(0.3)
        assert watch.reason() is None
        etcd_client.put(KEYS.membership_notice("grp", 3), "grp.1: all-reduce failed")
        wait_until(watch.reason, 5, "the notice", poll_s=0.02)
        assert watch.reason() == "grp.1: all-reduce failed"
        watch.follow(4, {"w-a", "w-b"})  # a new epoch forgets the old verdict
        assert watch.reason() is None
        theirs.close()  # w-b's key goes (revoked: the same delete event an expiry makes)
        wait_until(watch.reason, 5, "the lost lease", poll_s=0.02)
        assert watch.reason() == "node liveness lease gone: w-b"
    finally:
        watch.close()
        mine.close()
        theirs.close()


class CountingReads:
    """An etcd client that counts the range reads made through it."""

    def __init__(self, client: EtcdClient) -> None:
        self._client = client
        self.reads = 0

    def __getattr__(self, name: str) -> Any:
        if name in ("get_prefix", "read_prefix", "keys_under", "count_prefix", "get", "get_many"):
            self.reads += 1
        return getattr(self._client, name)


def test_the_watch_follows_bids_joiners_and_leases_from_events_without_reading_again(etcd_client: EtcdClient) -> None:
    # A change must cost each member one event, not a re-read of O(N) keys, and a member's bid must not even wake it
    # (bench/control_plane.py: a node loss at 64 nodes took 6.7 s while every bid made every member read everything).
    keys = RunKeys("watch-events")
    etcd_client.put(keys.membership_alive("e-a"), "e-a")
    etcd_client.put(keys.membership_alive("e-b"), "e-b")
    counted = CountingReads(etcd_client)
    watch = FailureWatch(counted, keys, "grp")  # type: ignore[arg-type]
    try:
        watch.follow(1, {"e-a", "e-b"})
        wait_until(lambda: counted.reads >= 4, SETTLE_S, "the first read")
        time.sleep(0.3)
        first = counted.reads
        membership = Membership(etcd_client, keys)
        for rank in range(20):  # the old members bid: none counts as a joiner
            membership.bid(2, Bid(f"grp.{rank}", rank, 5))
        membership.bid(2, Bid("joiner.0", None, 0))
        wait_until(lambda: watch.joiners() == 1, SETTLE_S, "the joiner counted")
        etcd_client.put(keys.membership_leaving("e-b"), "e-b")
        wait_until(lambda: watch.leaving() == {"e-b"}, SETTLE_S, "the leaver seen")
        assert watch.reason() is None
        etcd_client.delete(keys.membership_alive("e-b"))
        wait_until(watch.reason, SETTLE_S, "the lost lease")
        assert watch.reason() == "node liveness lease gone: e-b"
        assert counted.reads == first  # all of it from the watches' events
        watch.follow(2, {"e-a"})  # the joiners of epoch 2 are now members: none waits for epoch 3
        wait_until(lambda: watch.joiners() == 0, SETTLE_S, "the joiners of the epoch in force forgotten")
        assert counted.reads == first
    finally:
        watch.close()
        etcd_client.delete_prefix(keys.prefix)


def test_a_new_groups_member_records_are_read_in_one_request_and_only_those_not_kept(etcd_client: EtcdClient) -> None:
    keys = RunKeys("records-once")
    members = [f"grp.{rank}" for rank in range(20)]
    for rank, member in enumerate(members):
        etcd_client.put(keys.membership_member(member), json.dumps({"node": f"n-{rank}", "addr": "127.0.0.1:1"}))
    counted = CountingReads(etcd_client)
    verdicts = Verdicts(counted, keys, "grp")  # type: ignore[arg-type]
    try:
        assert verdicts.nodes_of(members[:12]) == {f"n-{r}" for r in range(12)}
        assert counted.reads == 1  # twelve missing: one request
        assert verdicts.nodes_of(members) == {f"n-{r}" for r in range(20)}
        assert counted.reads == 1 + 8  # eight missing: one by one, and only those
    finally:
        etcd_client.delete_prefix(keys.prefix)


def test_a_member_whose_port_still_accepts_is_dead_once_its_nodes_daemon_refuses(etcd_client: EtcdClient) -> None:
    # A killed node's big worker still accepts on its port while the kernel tears its memory down; its small daemon's
    # port is closed already. The deciders must take the daemon's answer (verdicts.py).
    worker = ProbeListener("127.0.0.1")  # the worker's port: still accepting
    daemon = ProbeListener("127.0.0.1")
    daemon_address = f"127.0.0.1:{daemon.port}"
    etcd_client.put(KEYS.membership_member("grp.1"), json.dumps({"node": "n1", "addr": f"127.0.0.1:{worker.port}"}))
    etcd_client.put(KEYS.membership_alive("n1"), "n1")  # its lease not expired yet
    etcd_client.put(KEYS.node("n1"), json.dumps({"node_id": "n1", "probe": daemon_address}))
    try:
        assert not Verdicts(etcd_client, KEYS, "grp").is_dead("grp.1", 1)  # everything answers: alive
        daemon.close()
        assert greet(daemon_address) is Probe.REFUSED and probe(f"127.0.0.1:{worker.port}") is Probe.ACCEPTED
        assert Verdicts(etcd_client, KEYS, "grp").is_dead("grp.1", 1)
    finally:
        worker.close()
        daemon.close()


def test_a_node_whose_daemon_came_back_on_another_port_is_neither_dead_nor_reported(etcd_client: EtcdClient) -> None:
    # A node killed and started again keeps its node id; its new daemon listens on another port. An address read
    # before (kept by the verdicts and the watch) refuses, and must not make the node's new members dead.
    worker, old, new = ProbeListener("127.0.0.1"), ProbeListener("127.0.0.1"), ProbeListener("127.0.0.1")
    record = {"node_id": "n3", "probe": f"127.0.0.1:{old.port}"}
    etcd_client.put(KEYS.membership_member("grp.3"), json.dumps({"node": "n3", "addr": f"127.0.0.1:{worker.port}"}))
    etcd_client.put(KEYS.membership_alive("n3"), "n3")
    etcd_client.put(KEYS.node("n3"), json.dumps(record))
    verdicts, watched = (
        Verdicts(etcd_client, KEYS, "grp"),
        Verdicts(etcd_client, KEYS, "grp"),
    )  # the decider's, the watch's
    reports: list[str] = []
    watch = SilenceWatch(
        watched.daemon_address,
        lambda _node, text: reports.append(text),
        current_address=watched.current_daemon_address,
        interval_s=0.1,
        silent_after_s=30.0,
    )
    try:
        for each in (verdicts, watched):
            assert each.daemon_address("n3") == record["probe"]  # read, and kept
        old.close()
        etcd_client.put(KEYS.node("n3"), json.dumps({**record, "probe": f"127.0.0.1:{new.port}"}))
        assert not verdicts.is_dead("grp.3", 1)
        watch.follow("n2", {"n2", "n3"})
        time.sleep(1.0)
        assert reports == [], reports
        new.close()  # now the node's current daemon is gone
        wait_until(lambda: reports, SETTLE_S, "the node's current daemon reported")
        assert "node n3's daemon refused the greeting: gone" in reports[0], reports
        assert Verdicts(etcd_client, KEYS, "grp").is_dead("grp.3", 1)
    finally:
        watch.close()
        for listener in (worker, old, new):
            listener.close()


@pytest.mark.parametrize("daemon_state", ["greets", "gone", "stopped"])
def test_a_lapsed_lease_of_a_node_whose_daemon_greets_is_no_failure_until_the_grace_is_over(
    etcd_client: EtcdClient, daemon_state: str
) -> None:
    # etcd that answers reads but is slow to write (its disk busy with a big checkpoint) lets a running node's lease
    # expire; its daemon puts a new key back moments later. The watch greets that node's daemon before it believes the
    # lease: a daemon that greets gets the grace; a gone one (refused) or a stopped one (silent) is believed at once.
    node = f"lapse-{daemon_state}"
    daemon = ProbeListener("127.0.0.1")
    address = f"127.0.0.1:{daemon.port}"
    stopped: subprocess.Popen[bytes] | None = None
    if daemon_state == "gone":
        daemon.close()
    elif daemon_state == "stopped":  # a process of its own, SIGSTOPped: the kernel accepts, nobody greets
        daemon.close()
        stopped = subprocess.Popen([sys.executable, "-c", _LISTENER], stdout=subprocess.PIPE)
        assert stopped.stdout is not None
        address = f"127.0.0.1:{int(stopped.stdout.readline())}"
        os.kill(stopped.pid, signal.SIGSTOP)
        wait_until(lambda: Path(f"/proc/{stopped.pid}/stat").read_text().split()[2] == "T", SETTLE_S, "stopped")
    etcd_client.put(KEYS.node(node), json.dumps({"node_id": node, "probe": address}))
    mine, theirs = NodeLease(etcd_client.reconnect(), KEYS, "lapse-me"), NodeLease(etcd_client.reconnect(), KEYS, node)
    mine.start()
    theirs.start()
    grace_s = 2.0
    watch = FailureWatch(
        etcd_client,
        KEYS,
        "grp",
        daemon_answers=Verdicts(etcd_client, KEYS, "grp").daemon_answers,
        lapse_grace_s=grace_s,
    )
    try:
        watch.follow(1, {"lapse-me", node})
        time.sleep(0.3)
        assert watch.reason() is None
        theirs.close()  # its key goes, as an expiry takes it
        gone_at = time.monotonic()
        wait_until(watch.reason, grace_s + SETTLE_S, "the lease believed", poll_s=0.02)
        waited_s = time.monotonic() - gone_at
        assert watch.reason() == f"node liveness lease gone: {node}"
        if daemon_state == "greets":
            assert waited_s >= grace_s, waited_s  # not before the grace
        else:
            assert waited_s < grace_s, waited_s  # at once: the greeting alone decides
    finally:
        watch.close()
        mine.close()
        theirs.close()
        daemon.close()
        if stopped is not None:
            stopped.kill()
            stopped.wait(10)


def test_a_lapsed_lease_put_back_within_the_grace_fails_nothing(etcd_client: EtcdClient) -> None:
    daemon = ProbeListener("127.0.0.1")
    etcd_client.put(KEYS.node("lapse-back"), json.dumps({"node_id": "lapse-back", "probe": f"127.0.0.1:{daemon.port}"}))
    etcd_client.put(KEYS.membership_alive("lapse-me2"), "lapse-me2")
    etcd_client.put(KEYS.membership_alive("lapse-back"), "lapse-back")
    watch = FailureWatch(
        etcd_client, KEYS, "grp", daemon_answers=Verdicts(etcd_client, KEYS, "grp").daemon_answers, lapse_grace_s=2.0
    )
    try:
        watch.follow(1, {"lapse-me2", "lapse-back"})
        time.sleep(0.3)
        etcd_client.delete(KEYS.membership_alive("lapse-back"))  # lapsed
        time.sleep(1.0)
        etcd_client.put(KEYS.membership_alive("lapse-back"), "lapse-back")  # its daemon's new lease
        time.sleep(2.5)  # past the grace counted from the lapse
        assert watch.reason() is None
    finally:
        watch.close()
        daemon.close()
        for key in ("lapse-me2", "lapse-back"):
            etcd_client.delete(KEYS.membership_alive(key))


def test_a_greeting_names_its_listener_and_another_name_on_the_port_is_refused() -> None:
    """A member's port freed and taken again by another listener: greeted under another name, it is gone."""
    listener = ProbeListener("127.0.0.1", "3.0123456789abcdef.0")
    try:
        address = f"127.0.0.1:{listener.port}"
        assert greet(address, name="3.0123456789abcdef.0") is Probe.ACCEPTED
        assert greet(address, name="3.0123456789abcdef.1") is Probe.REFUSED
        assert greet(address) is Probe.ACCEPTED  # a greeter that asks for nobody in particular (the silence watch)
    finally:
        listener.close()
