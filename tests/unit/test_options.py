"""The option table (elasticd/options.py) is the one place an option is written: walked here, every option reaches
every place it must: its command's click option and ``ELASTICD_<NAME>``, the ``--config`` file, StartConfig's
field and default, the workers' environment and WorkerSettings, and every etcd client of a node gets the same
connect timeout and TLS settings. A new option is covered without touching this file."""

from __future__ import annotations

import dataclasses
import socket
from pathlib import Path
from typing import Any

import click
import pytest

from elasticd import cli, envvars, options
from elasticd.agent.daemon import rendezvous_parameters
from elasticd.config import StartConfig
from elasticd.etcd.client import EtcdClient
from elasticd.options import Option
from elasticd.worker.settings import WorkerSettings
from tests.helpers import records

START_FIELDS = {f.name: f for f in dataclasses.fields(StartConfig)}
ACCESS = set(options.ETCD_ACCESS)


def _params(command: str) -> dict[str, click.Option]:
    found = cli.cli.commands[command].params
    return {p.opts[0]: p for p in found if isinstance(p, click.Option) and p.opts[0] not in {"--help"}}


@pytest.mark.parametrize("command", sorted({c for o in options.TABLE for c in o.commands}))
def test_every_command_takes_exactly_the_table_s_options(command: str) -> None:
    assert set(_params(command)) == {o.flag for o in options.of(command)}


@pytest.mark.parametrize("option", options.TABLE, ids=lambda o: o.flag)
def test_each_option_s_click_option_has_its_env_name_default_and_help(option: Option) -> None:
    for command in option.commands:
        param = _params(command)[option.flag]
        assert param.envvar == (option.env if option.reads_env else None)
        assert param.help == option.help
        if option is not options.CONFIG:
            assert param.name == option.field
            assert param.default == option.default_for(command)


def test_env_names_are_derived_from_the_flags_and_unique() -> None:
    assert options.MIN_NODES.env == "ELASTICD_MIN_NODES"
    assert options.ETCD_CONNECT_TIMEOUT.env == "ELASTICD_ETCD_CONNECT_TIMEOUT"
    names = [o.env for o in options.TABLE]
    assert len(names) == len(set(names))


@pytest.mark.parametrize("option", options.of(options.START), ids=lambda o: o.flag)
def test_each_start_option_fills_a_start_config_field_with_the_table_s_default(option: Option) -> None:
    if option is options.CONFIG:
        return
    if option in ACCESS:
        assert "etcd_access" in START_FIELDS
        return
    assert option.field in START_FIELDS, f"{option.flag}: StartConfig has no field {option.field}"
    spec = START_FIELDS[option.field]
    default = spec.default_factory() if spec.default_factory is not dataclasses.MISSING else spec.default
    assert option.value(option.default) == default


def test_every_start_config_field_but_the_script_and_what_the_daemon_builds_comes_from_an_option() -> None:
    from_options = {o.field for o in options.of(options.START)}
    assert set(START_FIELDS) - from_options == {"script", "script_args", "etcd_access"}


def _write(path: Path, text: str = "x\n") -> str:
    path.write_text(text)
    return str(path)


@pytest.fixture
def script(tmp_path: Path) -> Path:
    return Path(_write(tmp_path / "train.py", "print('hi')\n"))


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> list[StartConfig]:
    seen: list[StartConfig] = []
    monkeypatch.setattr("elasticd.agent.daemon.run_daemon", records(seen, result=0))
    return seen


# A value other than the default for every start option a worker gets, as the user writes it.
_NON_DEFAULT = {
    options.MIN_NODES: "2",
    options.MAX_NODES: "3",
    options.ETCD: "etcd-a:2379,etcd-b:2379",
    options.ETCD_CONNECT_TIMEOUT: "7.5",
    options.RUN_ID: "job-7",
    options.NODE_ID: "node-x",
    options.LOCAL_ADDR: "127.0.0.1",  # must be an address of this host
    options.CHECKPOINT_DIR: "ckpt",
    options.CHECKPOINT_EVERY_STEPS: "17",
    options.CHECKPOINT_EVERY_SECONDS: "2.5",
    options.KEEP_CHECKPOINTS: "5",
    options.ON_NAN: "skip",
    options.RECOVERY: "cold",
    options.SHARD_MIRROR_EVERY: "8",
}


def test_every_worker_option_has_a_non_default_value_in_this_test() -> None:
    assert set(options.worker_options()) == set(_NON_DEFAULT)


@pytest.mark.parametrize("source", ["cli", "env", "file"])
def test_worker_options_reach_the_workers_under_their_own_names_from_flag_env_and_file(
    source: str,
    script: Path,
    captured: list[StartConfig],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)
    args: list[str] = []
    if source == "cli":
        args = [part for option, value in _NON_DEFAULT.items() for part in (option.flag, value)]
    elif source == "env":
        for option, value in _NON_DEFAULT.items():
            monkeypatch.setenv(option.env, value)
    else:
        text = "".join(f"{option.name}: '{value}'\n" for option, value in _NON_DEFAULT.items())
        args = [options.CONFIG.flag, _write(tmp_path / "elasticd.yaml", text)]
    assert cli.main(["start", *args, str(script)]) == 0
    cfg = captured[-1]
    env = cfg.worker_env()
    assert set(env) == {o.env for o in options.worker_options()}
    settings = WorkerSettings.from_env(env)
    for option, text in _NON_DEFAULT.items():
        expected = option.value(text)
        if isinstance(expected, Path):
            expected = expected.resolve()
        if isinstance(expected, tuple):
            expected = text
        assert getattr(settings, option.field) == expected, option.flag


def test_a_worker_without_a_daemon_takes_the_table_s_defaults() -> None:
    settings = WorkerSettings.from_env({})
    for option in options.worker_options():
        expected = option.default if option.worker_default is ... else option.worker_default
        if option.parse is Path:
            expected = Path(expected)
        assert getattr(settings, option.field) == expected, option.flag
    assert (settings.recovery, settings.etcd, settings.min_nodes) == ("cold", None, None)


class _Recorded(Exception):
    pass


def test_every_etcd_client_of_a_node_gets_the_same_endpoints_connect_timeout_and_tls(
    script: Path, captured: list[StartConfig], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The daemon's client, the rendezvous handler's, the workers' (fence and hot path: WorkerSettings) and those of
    ``status`` and ``stop`` given the same options: one set of connect arguments."""
    monkeypatch.delenv(envvars.ETCD_PASSWORD, raising=False)
    access = [
        options.ETCD_CACERT.flag, _write(tmp_path / "ca.pem"),
        options.ETCD_CERT.flag, _write(tmp_path / "cert.pem"),
        options.ETCD_KEY.flag, _write(tmp_path / "key.pem"),
        options.ETCD_USER.flag, "trainer",
        options.ETCD_PASSWORD_FILE.flag, _write(tmp_path / "pw", "s3cret\n"),
    ]  # fmt: skip
    common = [options.ETCD.flag, "etcd-a:2379,etcd-b:2379", options.ETCD_CONNECT_TIMEOUT.flag, "7.5", *access]
    assert cli.main(["start", *common, str(script)]) == 0
    cfg = captured[-1]
    daemon = cfg.etcd_connect_args()
    assert daemon["connect_timeout_s"] == 7.5 and daemon["password"] == "s3cret" and daemon["ca_cert"]

    calls: list[dict[str, Any]] = []

    def record(endpoints: Any, **kwargs: Any) -> EtcdClient:
        calls.append({"endpoints": tuple(endpoints), **kwargs})
        raise _Recorded

    monkeypatch.setattr(EtcdClient, "connect", staticmethod(record))
    from elasticd.rendezvous.handler import create_handler

    with pytest.raises(_Recorded):
        create_handler(rendezvous_parameters(cfg))
    env = {**cfg.worker_env(), **cfg.etcd_access.worker_env()}
    worker = WorkerSettings.from_env(env).etcd_connect_args(env)
    for command in ("status", "stop"):
        with pytest.raises(_Recorded):
            cli.main([command, *common])
    rendezvous, status, stop = calls
    for name, args in {"rendezvous": rendezvous, "worker": worker, "status": status, "stop": stop}.items():
        assert {k: v for k, v in args.items() if k in daemon} == daemon, name


def test_rdzv_conf_refuses_a_second_connect_timeout(
    script: Path, captured: list[StartConfig], capsys: pytest.CaptureFixture[str]
) -> None:
    code = cli.main(["start", options.RDZV_CONF.flag, "connect_timeout=3", str(script)])
    assert (code, captured) == (2, [])
    assert options.ETCD_CONNECT_TIMEOUT.flag in capsys.readouterr().err


def test_the_node_id_defaults_to_the_host_name() -> None:
    assert options.NODE_ID.value(None) == socket.gethostname()
