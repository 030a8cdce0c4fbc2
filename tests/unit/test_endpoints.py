"""parse_endpoints: the spellings users write for etcd endpoints, and clear errors for the rest."""

from __future__ import annotations

import pytest

from elasticd.endpoints import DEFAULT_PORT, Endpoint, format_endpoints, parse_endpoints
from elasticd.errors import ConfigError, UsageError


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("10.0.0.5:2379", (Endpoint("10.0.0.5", 2379),)),
        ("etcd-0.etcd.svc:12379", (Endpoint("etcd-0.etcd.svc", 12379),)),
        ("localhost", (Endpoint("localhost", DEFAULT_PORT),)),
        ("http://127.0.0.1:2379", (Endpoint("127.0.0.1", 2379),)),
        ("HTTPS://etcd:2379/", (Endpoint("etcd", 2379),)),
        ("[::1]:2379", (Endpoint("::1", 2379),)),
        ("[fe80::1%eth0]", (Endpoint("fe80::1%eth0", DEFAULT_PORT),)),
        ("http://[::1]:4001", (Endpoint("::1", 4001),)),
        (" a:1 , b:2,c ", (Endpoint("a", 1), Endpoint("b", 2), Endpoint("c", DEFAULT_PORT))),
        ("a:1,a:1,b:2", (Endpoint("a", 1), Endpoint("b", 2))),
    ],
)
def test_accepted_spellings_parse_to_host_and_port(text: str, expected: tuple[Endpoint, ...]) -> None:
    assert parse_endpoints(text) == expected


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("", "no etcd endpoint"),
        ("   ", "no etcd endpoint"),
        ("a:1,,b:2", "entry 2"),
        ("a:1,", "entry 2"),
        ("host:abc", "'abc'"),
        ("host:0", "'0'"),
        ("host:65536", "'65536'"),
        ("host:", "''"),
        (":2379", "''"),
        ("::1", "in brackets"),
        ("[::1", "closing"),
        ("[::1]x", "'x'"),
        ("[zz]:1", "IPv6"),
        ("unix:///tmp/etcd.sock", "scheme"),
        ("grpc://etcd:2379", "scheme"),
        ("http://etcd:2379/v3", "path"),
        ("user@etcd:2379", "user"),
        ("bad host:2379", "'bad host'"),
        ("host..name:1", "'host..name'"),
        ("host:²", "'²'"),
    ],
)
def test_malformed_input_raises_config_error_naming_the_bad_part(text: str, names: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_endpoints(text, key="--etcd")
    message = str(info.value)
    assert message.startswith("--etcd: ")
    assert names in message
    assert info.value.key == "--etcd"
    assert isinstance(info.value, UsageError)  # the CLI turns it into one line and exit code 2


def test_error_names_the_option_it_was_read_from() -> None:
    with pytest.raises(ConfigError, match=r"^--rdzv-endpoint: .*expected HOST:PORT"):
        parse_endpoints("a:b", key="--rdzv-endpoint")


def test_endpoint_prints_as_host_port_and_brackets_ipv6() -> None:
    assert str(Endpoint("10.0.0.5", 2379)) == "10.0.0.5:2379"
    assert str(Endpoint("::1", 2379)) == "[::1]:2379"


def test_formatted_list_parses_back_to_the_same_endpoints() -> None:
    endpoints = (Endpoint("a", 1), Endpoint("::1", 2), Endpoint("b.c", 2379))
    assert parse_endpoints(format_endpoints(endpoints)) == endpoints


def test_endpoint_is_immutable_and_hashable() -> None:
    endpoint = Endpoint("a", 1)
    with pytest.raises(AttributeError):
        endpoint.port = 2  # type: ignore[misc]  # the point: it is frozen
    assert {endpoint, Endpoint("a", 1)} == {endpoint}
