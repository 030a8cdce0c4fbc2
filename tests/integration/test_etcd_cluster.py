"""A job on a 3-member etcd (``etcd_cluster.py``, each member on a host of its own) while etcd itself fails: its
leader killed, a member cut off, quorum lost for 20 s. etcd's default timing (1 s election timeout) throughout.

Before: a leader killed during a node loss made the hot path give up on etcd's "leader changed" (a cold restart of
the whole group, ~25 s); after quorum came back, every node's liveness key lapsed at once (the refresh waited behind
other calls' deadlines) and the group re-formed four times; commits made during the outage were reported as fenced
and their checkpoints removed, and the saver behind them held training to a third of its pace.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from elasticd.endpoints import parse_endpoints
from elasticd.etcd.client import EtcdClient
from elasticd.keys import RunKeys
from elasticd.lineage import Lineage
from elasticd.worker.hot import watch
from tests.integration.cluster import Cluster, train_args, wait_until
from tests.integration.etcd_cluster import EtcdCluster
from tests.integration.netns import Network, unavailable
from tests.integration.on_hosts import SLEEP_S, STEPS, assert_one_lineage, assert_same_parameters, stamp, start_on_hosts

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(360),
    pytest.mark.skipif(unavailable() is not None, reason=str(unavailable())),
]

OUTAGE_S = 20.0
# The first test's steps are slower: its lost node must come back, import and join while the run still trains.
SLOW_SLEEP_S = 0.25


@pytest.fixture
def etcd(network: Network, tmp_path: Path) -> Iterator[EtcdCluster]:
    workdir = tmp_path / "etcd"
    workdir.mkdir()
    with EtcdCluster(network, workdir) as cluster:
        yield cluster


def lineage(etcd: EtcdCluster, run_id: str) -> tuple[EtcdClient, Lineage]:
    client = EtcdClient.connect(parse_endpoints(etcd.endpoints), connect_timeout_s=30, election_grace_s=30)
    return client, Lineage(client, RunKeys(run_id))


def test_the_leader_killed_with_a_node_then_a_member_cut_off_training_goes_on_in_place_and_no_commit_is_lost(
    network: Network, etcd: EtcdCluster, tmp_path: Path, reference: dict[str, torch.Tensor]
) -> None:
    """etcd's leader and a node killed at the same moment: the two others re-form in place once etcd has a leader
    again (the pause is printed: an election and one request timeout on the dead member). The member restarted,
    then the new leader cut off while the lost node comes back: it joins in place through the two members left."""
    final = tmp_path / "final.pt"
    hosts = {h.name: h for h in (network.add(f"l{i}") for i in range(3))}
    client, records = lineage(etcd, "leader")
    with Cluster(etcd.endpoints, tmp_path, run_id="leader", min_nodes=2, max_nodes=3,
                 script_args=(*train_args(STEPS, SLOW_SLEEP_S), "--save-final", str(final))) as c:  # fmt: skip
        ranks = start_on_hosts(c, hosts)
        victim = next(n for n, r in ranks.items() if r == 2)
        survivors = [n for n in hosts if n != victim]
        c.wait_step(lambda s: s["step"] >= 22, what="a committed checkpoint (step 20)")
        before = records.records()
        leader = etcd.leader()
        assert leader is not None
        etcd.kill(leader)
        c.nodes[victim].kill()
        for name in survivors:
            event = c.nodes[name].wait_event("reconfigured", timeout_s=60, where=lambda e: "node_id" in e)
            assert event["world_size"] == 2 and event["reason"] == "failure", event
            print(f"{name}: in place {event['seconds']:.2f}s after the node loss with etcd's leader {leader}")
        etcd.restart(leader)

        cut = etcd.leader()
        assert cut is not None
        etcd.cut(cut)
        try:
            c.start(victim, host=hosts[victim])  # back while a member is cut off: joins in place
            for name in survivors:
                event = c.nodes[name].wait_event("reconfigured", timeout_s=120, where=lambda e: e["reason"] == "join")
                assert event["world_size"] == 3, event
                print(f"{name}: joined in place, paused {event['seconds']:.2f}s, etcd member {cut} cut off")
        finally:
            etcd.heal(cut)
        for name in hosts:
            assert c.nodes[name].wait(240) == 0, c.diagnostics()
        for name in survivors:
            assert not c.nodes[name].events("restart"), c.diagnostics()  # in place throughout
        assert c.newest_step()["step"] == STEPS
    after = records.records()
    client.close()
    # what was committed before the leader died is still the lineage's, and it never forked
    assert {(r.step, r.token) for r in before} <= {(r.step, r.token) for r in after}
    assert_one_lineage(after)
    assert max(r.step for r in after) == STEPS
    assert_same_parameters(final, reference)


def test_the_member_under_a_failure_watch_cut_off_the_watch_moves_to_another_and_misses_no_joiner_or_loss(
    etcd: EtcdCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The member a group's failure watch streams from loses its link: no reset, no error, its events just stop.
    The watch finds the stream dead (gRPC's pings), moves to another member and still sees a joiner and a node
    lost. Before, it waited for its renewal (30 s, here never): in the suite a joiner went unseen for 2 minutes."""
    monkeypatch.setattr(watch, "_WATCH_SLICE_S", 600.0)  # no renewal to hide a dead stream behind
    keys = RunKeys("cut-watch")
    client = EtcdClient.connect(parse_endpoints(etcd.endpoints), connect_timeout_s=30, election_grace_s=30)
    follower = watch.FailureWatch(client, keys, "g")
    try:
        client.put(keys.membership_alive("n0"), "up")
        follower.follow(1, ["n0"])
        client.put(keys.membership_joiner(2, "early"), "1")
        wait_until(lambda: follower.joiners() == 1, 30, "the watch following")
        used = client.endpoint_in_use()
        (member,) = [name for name, host in etcd.hosts.items() if used == f"{host.control_addr}:2379"]
        # the writes go through the other members: a call to the member cut off would break the connection the
        # watch shares with it (gRPC shares one per address), and so find the dead stream for it
        others = ",".join(e for e in etcd.endpoints.split(",") if e != used)
        writer = EtcdClient.connect(parse_endpoints(others), connect_timeout_s=30, election_grace_s=30)
        etcd.cut(member)
        try:
            writer.put(keys.membership_joiner(2, "late"), "1")
            wait_until(lambda: follower.joiners() == 2, 60, "the joiner seen after the member was cut off")
            writer.delete(keys.membership_alive("n0"))
            reason = wait_until(follower.reason, 60, "the node's loss seen")
            assert "n0" in reason
            assert client.endpoint_in_use() != used, "still on the member cut off"
        finally:
            etcd.heal(member)
            writer.close()
    finally:
        follower.close()
        client.close()


def test_etcd_without_quorum_for_20_s_training_goes_on_and_the_commits_held_back_land_in_step_order_after(
    network: Network, etcd: EtcdCluster, tmp_path: Path, reference: dict[str, torch.Tensor]
) -> None:
    """Two of the three members cut off for 20 s (the leader among them): no member can take a write. The group
    trains on at its size and pace, each commit says why it waits (``checkpoint_commit_deferred``), and once quorum is
    back they land, oldest first; no node is taken for dead afterwards."""
    final = tmp_path / "final.pt"
    hosts = {h.name: h for h in (network.add(f"q{i}") for i in range(3))}
    client, records = lineage(etcd, "quorum")
    with Cluster(etcd.endpoints, tmp_path, run_id="quorum", min_nodes=2, max_nodes=3,
                 script_args=(*train_args(STEPS, SLEEP_S), "--save-final", str(final))) as c:  # fmt: skip
        ranks = start_on_hosts(c, hosts)
        committer = next(n for n, r in ranks.items() if r == 0)
        leader = etcd.leader()
        assert leader is not None
        lost = [leader, next(n for n in etcd.hosts if n != leader)]
        for name in lost:
            etcd.cut(name)
        cut_at = time.time()
        try:
            time.sleep(OUTAGE_S)
        finally:
            for name in lost:
                etcd.heal(name)
        healed_at = time.time()
        for name in hosts:
            assert c.nodes[name].wait(240) == 0, c.diagnostics()

        during = [s for s in c.all_steps() if cut_at + 2 < s["t"] < healed_at]
        print(f"{len(during)} steps in the {OUTAGE_S - 2:g} s of the outage after its first 2 s")
        assert len(during) >= 30 and {s["world_size"] for s in during} == {3}, during[-3:]
        held = [e for e in c.nodes[committer].events("checkpoint_commit_deferred") if "rank" in e]
        # said during the outage, and while the ones held back drained after it
        assert held and all(cut_at < stamp(e) < healed_at + 15 for e in held), [
            (e["step"], round(stamp(e) - cut_at, 1)) for e in held
        ]
        assert held[0]["error"], held[0]
        for node in c.nodes.values():
            # nothing restarts and no node is lost; a node's liveness key may still lapse once as quorum returns under
            # a loaded host (seen in the suite: one re-formation in place at the same size, a 4 s pause)
            assert not node.events("restart"), node.tail(60)
            assert all(e["world_size"] == 3 for e in node.events("reconfigured")), node.tail(60)
        assert not [e for e in c.nodes[committer].events("checkpoint_fenced") if cut_at < stamp(e) < healed_at]
        assert c.newest_step()["step"] == STEPS
    landed = records.records()
    client.close()
    assert_one_lineage(landed)  # in step order, one lineage
    late = sorted(r.step for r in landed if r.committed_at > healed_at)
    assert late and late[0] <= held[-1]["step"], (late, [e["step"] for e in held])  # one held back landed after
    assert max(r.step for r in landed) == STEPS
    assert_same_parameters(final, reference)
