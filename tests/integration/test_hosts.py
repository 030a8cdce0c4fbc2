"""Nodes on hosts of their own (``netns.py``): each in its own network namespace, with its own addresses on a data
and a control network, etcd on another host, and this machine's host name resolving to 127.0.0.1 everywhere.

Before elasticd named the collectives' interface from ``--local-addr`` (``elasticd/addresses.py``), gloo bound the
host name's loopback address and such nodes never formed a group ("Gloo connectFullMesh failed ... Connection
refused, remote=[127.0.0.1]:PORT", worker restarts until the budget ran out).
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from elasticd.endpoints import parse_endpoints
from elasticd.etcd.client import EtcdClient
from elasticd.etcd.server import EmbeddedEtcd
from elasticd.keys import RunKeys
from elasticd.lineage import Lineage
from tests.integration.cluster import EXAMPLE, Cluster, train_args
from tests.integration.netns import Network, unavailable
from tests.integration.on_hosts import (
    SLEEP_S,
    STEPS,
    assert_one_lineage,
    assert_same_parameters,
    stamp,
    start_on_hosts,
)

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(300),
    pytest.mark.skipif(unavailable() is not None, reason=str(unavailable())),
]


def assert_back_after_the_heal(c: Cluster, victim: str, survivors: list[str], healed_at: float) -> None:
    """The survivors went on in place (no restart) while the victim was cut; after the heal it came back: joined
    in place (healed from a peer), or, when its workers could not join in time, through a new round of all three
    (the survivors' one restart, for it, after the heal)."""
    for name in survivors:
        early = [e for e in c.nodes[name].events("restart") if stamp(e) < healed_at]
        assert not early, (name, early, c.diagnostics())
    joined = [e for e in c.nodes[victim].events("reconfigured") if "node_id" in e and e["reason"] == "join"]
    rounds = [e for e in c.nodes[victim].events("rendezvous_done") if stamp(e) > healed_at and e["nodes"] == 3]
    assert (joined and joined[-1]["world_size"] == 3) or rounds, c.nodes[victim].tail(80)
    print(f"{victim} came back {'in place' if joined else 'through a new round'}")


@pytest.fixture
def remote_etcd(network: Network, tmp_path: Path) -> Iterator[EmbeddedEtcd]:
    """etcd on the control network's gateway: another host for every node."""
    server = EmbeddedEtcd(data_dir=tmp_path / "etcd", host=network.gateway, unsafe_no_fsync=True)
    server.start(ready_timeout_s=30)
    try:
        yield server
    finally:
        server.stop()


def test_nodes_on_their_own_hosts_train_together_with_local_addr_alone(
    network: Network, remote_etcd: EmbeddedEtcd, tmp_path: Path
) -> None:
    hosts = [network.add(f"h{i}") for i in range(3)]
    with Cluster(remote_etcd.endpoint, tmp_path, run_id="hosts", min_nodes=3, max_nodes=3,
                 script_args=train_args(30)) as c:  # fmt: skip
        for host in hosts:
            c.start(host.name, host=host)
        for node in c.nodes.values():
            assert node.wait(240) == 0, c.diagnostics()
        chosen = {n.name: n.events("collective_interface") for n in c.nodes.values()}
        for host in hosts:
            (event,) = chosen[host.name]
            assert event["interface"] == "data" and event["GLOO_SOCKET_IFNAME"] == "data", event
            assert event["local_addr"] == host.data_addr
            assert not c.nodes[host.name].events("restart"), c.diagnostics()  # formed the first time
        assert c.newest_step()["step"] == 30 and c.newest_step()["world_size"] == 3
    client = EtcdClient.connect(parse_endpoints(remote_etcd.endpoint), connect_timeout_s=10)
    try:
        assert max(r.step for r in Lineage(client, RunKeys("hosts")).records()) == 30
    finally:
        client.close()


def test_without_local_addr_a_host_name_that_stands_for_loopback_is_one_line_and_exit_2(
    network: Network, remote_etcd: EmbeddedEtcd, tmp_path: Path
) -> None:
    host = network.add("alone")
    command = [sys.executable, "-m", "elasticd", "start", "--etcd", remote_etcd.endpoint, "--max-nodes", "2",
               "--checkpoint-dir", str(tmp_path / "checkpoints"), str(EXAMPLE)]  # fmt: skip
    done = subprocess.run(host.command(command), capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("elasticd: error: --local-addr") and "loopback" in line, line


def test_a_node_cut_off_from_everything_is_left_behind_in_place_never_trains_alone_and_rejoins_after_the_heal(
    network: Network, remote_etcd: EmbeddedEtcd, tmp_path: Path, reference: dict[str, torch.Tensor]
) -> None:
    """Full isolation of rank 0's node (the one that commits): both its links down at the switch, so frames to and
    from it vanish without a reset. The two others go on in place; the isolated node, below --min-nodes alone and
    without etcd, neither trains nor commits; after the heal it comes back as a joiner."""
    final = tmp_path / "final.pt"
    hosts = {h.name: h for h in (network.add(f"p{i}") for i in range(3))}
    keys = RunKeys("isolated")
    client = EtcdClient.connect(parse_endpoints(remote_etcd.endpoint), connect_timeout_s=10)
    with Cluster(remote_etcd.endpoint, tmp_path, run_id="isolated", min_nodes=2, max_nodes=3,
                 script_args=(*train_args(STEPS, SLEEP_S), "--save-final", str(final))) as c:  # fmt: skip
        ranks = start_on_hosts(c, hosts)
        victim_name = next(n for n, r in ranks.items() if r == 0)
        victim = c.nodes[victim_name]
        survivors = [n for n in hosts if n != victim_name]
        round_token = Lineage(client, keys).token()
        network.cut(victim_name)
        cut_at = time.time()
        try:
            after = c.wait_step(lambda s: s["world_size"] == 2 and s["t"] > cut_at, timeout_s=60, what="world 2")
            print(f"isolated node: first step at world 2 {after['t'] - cut_at:.2f}s after the cut")
            for name in survivors:
                event = c.nodes[name].wait_event("reconfigured", timeout_s=30)
                assert event["world_size"] == 2 and not c.nodes[name].events("restart"), c.diagnostics()
            c.wait_step(lambda s: s["world_size"] == 2 and s["step"] >= after["step"] + 20, timeout_s=60)
        finally:
            network.heal(victim_name)
        healed_at = time.time()
        for name in hosts:
            assert c.nodes[name].wait(240) == 0, c.diagnostics()

        # never alone: no step of the isolated node's between the cut and the heal (its last one may land just after
        # the cut: a step in flight)
        alone = [s for s in victim.steps() if cut_at + 1.0 < s["t"] < healed_at]
        assert not alone, alone[:3]
        # never committed: every record since the cut carries the survivors' newer token
        late = [r for r in Lineage(client, keys).records() if r.committed_at > cut_at]
        assert late and all(r.token != round_token for r in late), [(r.step, r.token) for r in late]
        assert_back_after_the_heal(c, victim_name, survivors, healed_at)
        assert c.newest_step()["step"] == STEPS and c.newest_step()["world_size"] == 3
    client.close()
    assert_same_parameters(final, reference)


@pytest.mark.parametrize("link", ["data", "control"])
def test_a_node_cut_from_its_peers_or_from_etcd_alone_leaves_one_group_training(
    network: Network, remote_etcd: EmbeddedEtcd, tmp_path: Path, link: str, reference: dict[str, torch.Tensor]
) -> None:
    """One link of rank 2's node down: ``data`` (it reaches etcd, not its peers) or ``control`` (its peers, not
    etcd). Exactly one group trains: the two nodes that reach each other and etcd; the cut node's workers leave
    the group within the vanished-node bound, commit nothing, and it comes back after the heal."""
    final = tmp_path / "final.pt"
    hosts = {h.name: h for h in (network.add(f"{link[0]}{i}") for i in range(3))}
    run_id = f"cut-{link}"
    keys = RunKeys(run_id)
    client = EtcdClient.connect(parse_endpoints(remote_etcd.endpoint), connect_timeout_s=10)
    with Cluster(remote_etcd.endpoint, tmp_path, run_id=run_id, min_nodes=2, max_nodes=3,
                 script_args=(*train_args(STEPS, SLEEP_S), "--save-final", str(final))) as c:  # fmt: skip
        ranks = start_on_hosts(c, hosts)
        victim_name = next(n for n, r in ranks.items() if r == 2)
        victim = c.nodes[victim_name]
        survivors = [n for n in hosts if n != victim_name]
        round_token = Lineage(client, keys).token()
        network.cut(victim_name, link)  # type: ignore[arg-type]
        cut_at = time.time()
        try:
            after = c.wait_step(lambda s: s["world_size"] == 2 and s["t"] > cut_at, timeout_s=60, what="world 2")
            print(f"{link} cut: first step at world 2 {after['t'] - cut_at:.2f}s after the cut")
            c.wait_step(lambda s: s["world_size"] == 2 and s["step"] >= after["step"] + 20, timeout_s=60)
        finally:
            network.heal(victim_name, link)  # type: ignore[arg-type]
        healed_at = time.time()
        for name in hosts:
            assert c.nodes[name].wait(240) == 0, c.diagnostics()
        alone = [s for s in victim.steps() if cut_at + 1.0 < s["t"] < healed_at]
        assert not alone, alone[:3]
        assert_back_after_the_heal(c, victim_name, survivors, healed_at)
        # the old group's rank 0 (a survivor) may commit under the old token until the new epoch: never after it
        late = [r for r in Lineage(client, keys).records() if r.committed_at > after["t"]]
        assert late and all(r.token != round_token for r in late), [(r.step, r.token) for r in late]
        assert c.newest_step()["step"] == STEPS
    client.close()
    assert_same_parameters(final, reference)


def test_a_flapping_link_ends_the_run_with_one_lineage_and_the_undisturbed_parameters(
    network: Network, remote_etcd: EmbeddedEtcd, tmp_path: Path, reference: dict[str, torch.Tensor]
) -> None:
    """Rank 2's data link down 2 s, up 2 s, five times, while the job trains: a cut that outlasts the hang timeout
    convicts it (the reachability check names it, not everyone), each heal lets it come back; the run finishes,
    nothing deadlocks, the lineage never forks, and the two healthy nodes never restart: a flapping link costs only
    its own node's workers."""
    final = tmp_path / "final.pt"
    hosts = {h.name: h for h in (network.add(f"f{i}") for i in range(3))}
    client = EtcdClient.connect(parse_endpoints(remote_etcd.endpoint), connect_timeout_s=10)
    with Cluster(remote_etcd.endpoint, tmp_path, run_id="flap", min_nodes=2, max_nodes=3,
                 script_args=(*train_args(STEPS, SLEEP_S), "--save-final", str(final))) as c:  # fmt: skip
        ranks = start_on_hosts(c, hosts)
        victim = next(n for n, r in ranks.items() if r == 2)
        flapping_since = time.time()  # a node slow to start may have cost one restart into the first round of 3
        try:
            for _ in range(5):
                network.cut(victim, "data")
                time.sleep(2.0)
                network.heal(victim, "data")
                time.sleep(2.0)
        finally:
            network.heal(victim, "data")
        for name in hosts:
            assert c.nodes[name].wait(240) == 0, c.diagnostics()
        assert c.newest_step()["step"] == STEPS
        # without the partition diagnosis every node is a culprit of each cut and the whole job restarts cold
        for name in hosts:
            if name != victim:
                restarts = [e for e in c.nodes[name].events("restart") if stamp(e) >= flapping_since]
                assert not restarts, f"{name} restarted\n{c.diagnostics()}"
    assert_one_lineage(Lineage(client, RunKeys("flap")).records())
    client.close()
    assert_same_parameters(final, reference)


def test_a_node_that_comes_back_after_the_run_finished_without_it_exits_0_and_says_so(
    network: Network, remote_etcd: EmbeddedEtcd, tmp_path: Path
) -> None:
    """Cut off from everything until the two others finished the run: once it reaches etcd again there is nothing
    left to train, which a Kubernetes Job must not count as a failed pod (exit 0, one event saying so)."""
    hosts = {h.name: h for h in (network.add(f"e{i}") for i in range(3))}
    with Cluster(remote_etcd.endpoint, tmp_path, run_id="ended", min_nodes=2, max_nodes=3,
                 script_args=train_args(60)) as c:  # fmt: skip
        ranks = start_on_hosts(c, hosts)
        victim_name = next(n for n, r in ranks.items() if r == 2)
        victim = c.nodes[victim_name]
        network.cut(victim_name)
        try:
            for name in hosts:
                if name != victim_name:
                    assert c.nodes[name].wait(240) == 0, c.diagnostics()
        finally:
            network.heal(victim_name)
        assert victim.wait(120) == 0, victim.tail(60)
        (said,) = victim.events("run_finished_without_this_node")
        assert said["message"], said
