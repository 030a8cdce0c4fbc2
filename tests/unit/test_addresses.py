"""This host's addresses (``elasticd/addresses.py``) and the start-up checks of ``--local-addr`` built on them:
an address that is not this host's, or a host name that stands for loopback while etcd is elsewhere, is one line
and exit 2 (DESIGN.md, "Addresses"), never a loop of worker restarts."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from elasticd import addresses, envvars
from elasticd.cli import main
from elasticd.errors import ConfigError
from tests.unit.test_cli_config import assert_one_line_error

# TEST-NET-2 (RFC 5737): never an address of this host
FOREIGN = "198.51.100.7"


def test_the_loopback_address_is_on_the_loopback_interface_and_a_foreign_one_on_none() -> None:
    assert addresses.interface_of("127.0.0.1") == "lo"
    assert addresses.interface_of("localhost") == "lo"  # a name: what it resolves to
    assert addresses.interface_of(FOREIGN) is None
    assert addresses.interface_of("no-such-host.invalid") is None
    assert addresses.interface_of("garbage!!") is None


def test_every_interface_address_is_found_on_its_own_interface() -> None:
    for name, found in addresses.interfaces().items():
        for address in found:
            assert addresses.interface_of(address) == name, (name, address)


def test_loopback_names_and_listen_addresses() -> None:
    assert addresses.is_loopback("localhost") and addresses.is_loopback("127.0.0.1")
    assert not addresses.is_loopback(FOREIGN) and not addresses.is_loopback("no-such-host.invalid")
    assert addresses.listen_address("127.0.0.1") == "127.0.0.1"
    assert addresses.listen_address("localhost") == "127.0.0.1"
    assert addresses.listen_address("no-such-host.invalid") == "0.0.0.0"


def test_the_collectives_get_the_interface_of_the_local_address_unless_the_user_chose_one() -> None:
    chosen = addresses.collective_env("127.0.0.1", {})
    assert chosen.env == {envvars.GLOO_SOCKET_IFNAME: "lo", envvars.NCCL_SOCKET_IFNAME: "lo"}
    assert chosen.fields["interface"] == "lo"
    mine = addresses.collective_env("127.0.0.1", {envvars.GLOO_SOCKET_IFNAME: "eth7"})
    assert mine.env == {envvars.NCCL_SOCKET_IFNAME: "lo"}  # the user's is kept, and said to be theirs
    assert "set by the user" in mine.fields[envvars.GLOO_SOCKET_IFNAME]


def test_a_local_address_that_is_not_this_hosts_is_a_config_error_naming_it() -> None:
    with pytest.raises(ConfigError, match="not an address of this host") as raised:
        addresses.check_local_addr(FOREIGN, [], 1)
    assert "--local-addr" in str(raised.value) and FOREIGN in str(raised.value)
    with pytest.raises(ConfigError, match="not an address of this host"):
        addresses.check_local_addr("not an address", ["127.0.0.1"], 3)
    addresses.check_local_addr("127.0.0.1", [FOREIGN], 3)  # an address of this host: fine


def test_a_host_name_that_stands_for_loopback_with_a_remote_etcd_is_a_config_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(socket, "getfqdn", lambda *_: "localhost")  # as Debian's /etc/hosts makes a host's name
    with pytest.raises(ConfigError, match="loopback") as raised:
        addresses.check_local_addr(None, [FOREIGN], 3)
    assert "--local-addr" in str(raised.value) and "'localhost'" in str(raised.value) and FOREIGN in str(raised.value)
    addresses.check_local_addr(None, [FOREIGN], 1)  # one node: nobody needs to reach it
    addresses.check_local_addr(None, ["127.0.0.1"], 3)  # every node on this host
    addresses.check_local_addr(None, [], 3)  # the embedded etcd


def test_the_daemon_checks_the_address_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    code = main(["start", "--local-addr", FOREIGN, "--checkpoint-dir", str(tmp_path / "c"), str(script)])
    assert_one_line_error(code, capsys.readouterr().err, "--local-addr", FOREIGN, "not an address of this host")
    assert not (tmp_path / "c").exists()  # nothing was started or created
