"""``bench/recovery.py --netns``: every node of a job on a host of its own (``bench/hosts.py``), the node-loss
scenarios by kill -9 and by full isolation, a results file tagged ``-netns``; without the flag, the run as before.

Nothing here starts a daemon or makes a namespace: the hosts are ``tests/integration/netns.py``'s ``Host`` records
from a fake network, so what is checked is the command line and environment each node would get."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import hosts, recovery
from bench.common import Launcher, results_path
from bench.report import _COMMIT_IN_NAME
from bench.tables import recovery_table
from tests.integration.netns import Host

GATEWAY = "10.77.1.1"


class FakeNetwork:
    """What ``Namespaces`` uses of ``Network``: hosts made on first use, a gateway, cuts and heals recorded."""

    def __init__(self) -> None:
        self.gateway = GATEWAY
        self.hosts: dict[str, Host] = {}
        self.faults: list[tuple[str, str, str]] = []

    def add(self, name: str) -> Host:
        index = len(self.hosts) + 10
        self.hosts[name] = Host(name, f"ed-t-{name}", f"10.10.1.{index}", f"10.77.1.{index}")
        return self.hosts[name]

    def cut(self, name: str, link: str = "all") -> None:
        self.faults.append(("cut", name, link))

    def heal(self, name: str, link: str = "all") -> None:
        self.faults.append(("heal", name, link))


@pytest.fixture
def namespaces() -> hosts.Namespaces:
    return hosts.Namespaces(FakeNetwork())  # type: ignore[arg-type]


@pytest.fixture(autouse=True)
def _no_port(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(recovery, "free_port", lambda: 29400)  # no socket in a unit test


def _after(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


def test_without_netns_every_system_measures_what_it_always_did() -> None:
    for system in recovery.SYSTEMS:
        assert recovery.scenarios_for(system, netns=False) == list(recovery.SCENARIOS[system]), system
        assert recovery.Scenario.NODE_ISOLATED not in recovery.SCENARIOS[system]
    assert recovery.scenarios_for("elasticd", False, [recovery.Scenario.NODE_ISOLATED]) == []


def test_with_netns_every_system_measures_node_loss_by_kill_and_by_isolation_and_elasticd_with_etcds_leader() -> None:
    loss, isolated = recovery.Scenario.NODE_LOSS, recovery.Scenario.NODE_ISOLATED
    leader = recovery.Scenario.NODE_LOSS_ETCD_LEADER
    for system in recovery.SYSTEMS:
        expected = [loss, isolated, leader] if system == "elasticd" else [loss, isolated]
        assert recovery.scenarios_for(system, netns=True) == expected, system
    assert recovery.scenarios_for("elasticd", False, [leader]) == []  # needs hosts of their own
    # asked for: in the trial's order, and only what the system can run
    asked = [isolated, recovery.Scenario.JOIN, recovery.Scenario.HANG]
    assert recovery.scenarios_for("elasticd", True, asked) == [recovery.Scenario.JOIN, recovery.Scenario.HANG, isolated]
    assert recovery.scenarios_for("torchrun", True, asked) == [recovery.Scenario.JOIN, isolated]


def test_the_netns_flag_is_parsed_and_isolation_without_it_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(recovery, "netns_unavailable", lambda: None)
    assert recovery.parse_args(["--netns", "--trials", "1"]).netns is True
    assert recovery.parse_args([]).netns is False
    with pytest.raises(SystemExit) as exited:
        recovery.parse_args(["--scenarios", "node_isolated"])
    assert exited.value.code == 2 and "needs --netns" in capsys.readouterr().err
    monkeypatch.setattr(recovery, "netns_unavailable", lambda: "network namespaces need root")
    with pytest.raises(SystemExit) as exited:
        recovery.parse_args(["--netns"])
    assert exited.value.code == 2 and "--netns: network namespaces need root" in capsys.readouterr().err


def test_an_elasticd_node_under_netns_runs_in_its_own_namespace_on_its_data_address(
    tmp_path: Path, namespaces: hosts.Namespaces
) -> None:
    launcher = Launcher(tmp_path, tag="t")
    job = recovery.ElasticdJob(launcher, "r", tmp_path, tmp_path / "train.py", "10.77.1.1:2379", placement=namespaces)
    command = job.node_command("n1")
    assert command[:4] == ["ip", "netns", "exec", "ed-t-n1"]
    assert _after(command, "--local-addr") == "10.10.1.10" and _after(command, "--etcd") == "10.77.1.1:2379"
    assert namespaces.etcd_host == GATEWAY
    assert _after(job.node_command("n2"), "--local-addr") == "10.10.1.11"  # a host per node
    assert job.node_command("n1") == command  # the same host each time it is named
    assert "GLOO_SOCKET_IFNAME" not in job.env()  # elasticd sets it from --local-addr itself


def test_a_torchrun_node_under_netns_reaches_the_store_on_n0s_data_address_and_binds_the_data_interface(
    tmp_path: Path, namespaces: hosts.Namespaces
) -> None:
    launcher = Launcher(tmp_path, tag="t")
    job = recovery.TorchrunJob(launcher, "r", tmp_path, tmp_path / "train.py", tuned=True, placement=namespaces)
    store, other = job.node_command("n0"), job.node_command("n1")
    assert store[:4] == ["ip", "netns", "exec", "ed-t-n0"] and other[:4] == ["ip", "netns", "exec", "ed-t-n1"]
    assert _after(store, "--rdzv-endpoint") == _after(other, "--rdzv-endpoint") == "10.10.1.10:29400"
    assert _after(store, "--local-addr") == "10.10.1.10" and _after(other, "--local-addr") == "10.10.1.11"
    # c10d cannot tell the store's node by its host name there (it resolves to 127.0.0.1): it is told, alone
    assert _after(store, "--rdzv-conf") == recovery.TUNED_RDZV_CONF + ",is_host=1"
    assert _after(other, "--rdzv-conf") == recovery.TUNED_RDZV_CONF
    assert job.env()["GLOO_SOCKET_IFNAME"] == "data"


def test_without_netns_the_node_commands_are_todays(tmp_path: Path) -> None:
    launcher = Launcher(tmp_path, tag="t")
    torchrun = recovery.TorchrunJob(launcher, "r", tmp_path, tmp_path / "train.py")
    command = torchrun.node_command("n0")
    assert command[0] != "ip" and "--rdzv-conf" not in command
    assert _after(command, "--rdzv-endpoint") == "127.0.0.1:29400" and _after(command, "--local-addr") == "127.0.0.1"
    assert "GLOO_SOCKET_IFNAME" not in torchrun.env()
    elasticd = recovery.ElasticdJob(launcher, "r", tmp_path, tmp_path / "train.py", "127.0.0.1:2379")
    assert _after(elasticd.node_command("n1"), "--local-addr") == "127.0.0.1"


def test_isolation_cuts_both_links_and_needs_hosts_of_their_own(tmp_path: Path, namespaces: hosts.Namespaces) -> None:
    namespaces.isolate("n2")
    namespaces.heal("n2")
    assert namespaces.network.faults == [("cut", "n2", "all"), ("heal", "n2", "all")]  # type: ignore[attr-defined]
    job = recovery.ElasticdJob(Launcher(tmp_path, tag="t"), "r", tmp_path, tmp_path / "train.py", "127.0.0.1:2379")
    with pytest.raises(ValueError, match="--netns"):
        recovery.measure_isolation(job, 1, None, None)  # type: ignore[arg-type]


def test_a_store_port_is_found_in_the_nodes_own_namespace_tcp_table(tmp_path: Path) -> None:
    header = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
    listen = "   0: 0A01010A:72D8 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 1\n"
    established = "   1: 0A01010A:9C40 0B01010A:72D8 01 00000000:00000000 00:00000000 00000000     0        0 2 1\n"
    (tmp_path / "tcp").write_text(header + listen + established)
    assert hosts.listening_in(tmp_path, 0x72D8)
    assert not hosts.listening_in(tmp_path, 0x9C40)  # a connection from that port, not a listener
    assert not hosts.listening_in(tmp_path / "gone", 0x72D8)


def test_a_netns_result_is_tagged_in_its_file_name_and_its_table_says_where_the_nodes_ran() -> None:
    name = results_path("recovery", {"commit": "abc1234", "uncommitted_changes": True}, tag="netns").name
    assert name == "recovery-abc1234-netns-dirty.json"
    assert results_path("recovery", {"commit": "abc1234"}).name == "recovery-abc1234.json"
    for file_name in (name, "recovery-abc1234-netns.json", "recovery-abc1234.json"):
        match = _COMMIT_IN_NAME.search(file_name)
        assert match is not None and match.group(1) == "abc1234", file_name
    sample = recovery.Sample("elasticd", "node_isolated", 1, 1.1)
    rows = recovery.summarize([sample])
    assert rows[0]["target"] == "hot <= 2 s: met"
    config = {"trials": 1, "backend": "gloo (CPU), one worker per node, its host's data address"}
    config["network"] = hosts.NETNS_NETWORK
    results = {"code": {"commit": "abc1234"}, "machine": {"cpus": 2}, "config": config, "summary": rows}
    table = recovery_table(results)
    assert "3 node processes on one machine (each node in its own network namespace" in table.splitlines()[0]
    assert "| node cut off (data and control links, 3 -> 2) | **1.10** (1.10) |" in table


def test_the_etcd_profile_is_fast_unless_asked_and_names_the_results_file(capsys: pytest.CaptureFixture[str]) -> None:
    assert recovery.parse_args([]).etcd_profile == "fast"
    assert recovery.parse_args(["--etcd-profile", "default"]).etcd_profile == "default"
    with pytest.raises(SystemExit):
        recovery.parse_args(["--etcd-profile", "slow"])
    assert "invalid choice: 'slow'" in capsys.readouterr().err
