"""Every float option refuses nan, ±inf and values beyond 1e9 with one line and exit 2: from the command line,
``ELASTICD_*`` env and the YAML config file alike. The options are found by walking the click commands, so a new
float option is covered without touching this file."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import click
import pytest

from elasticd.cli import SecondsOrAuto, cli, main
from elasticd.option_values import RDZV_CONF_KEYS
from tests.helpers import records

BAD = ["nan", "inf", "-inf", "1e308"]
YAML_BAD = {"nan": ".nan", "inf": ".inf", "-inf": "-.inf", "1e308": "1.0e+308"}  # YAML's own floats, not strings


def _float_options() -> Iterator[tuple[str, click.Option]]:
    for name, command in cli.commands.items():
        for param in command.params:
            if isinstance(param, click.Option) and isinstance(param.type, click.types.FloatParamType | SecondsOrAuto):
                yield name, param


FLOAT_OPTIONS = [pytest.param(cmd, opt, id=f"{cmd}{opt.opts[0]}") for cmd, opt in _float_options()]


def test_the_walk_finds_the_float_options_of_every_command() -> None:
    found = {(cmd, opt.opts[0]) for cmd, opt in _float_options()}
    expected = {("start", "--hang-timeout"), ("start", "--monitor-interval"), ("start", "--etcd-connect-timeout")}
    assert expected | {("status", "--etcd-connect-timeout"), ("stop", "--etcd-connect-timeout")} <= found
    assert len(found) >= 10


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text("print('hi')\n")
    return path


@pytest.fixture(autouse=True)
def nothing_runs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Whatever slips through validation is recorded instead of started (and fails the test)."""
    ran: list[str] = []
    monkeypatch.setattr("elasticd.agent.daemon.run_daemon", records(ran, "start", result=0))
    monkeypatch.setattr("elasticd.status.show_status", records(ran, "status", result=0))
    monkeypatch.setattr("elasticd.control.request_drain", records(ran, "stop", result=0))
    return ran


def _run(command: str, args: list[str], script: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main([command, *args, *([str(script)] if command == "start" else [])])
    return code, capsys.readouterr().err


def _assert_refused(code: int, err: str, ran: list[str], *needles: str) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("elasticd: error: "), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert ran == []


@pytest.mark.parametrize("value", BAD)
@pytest.mark.parametrize(("command", "option"), FLOAT_OPTIONS)
def test_float_option_on_the_command_line_refuses_nan_inf_and_huge(
    command: str,
    option: click.Option,
    value: str,
    script: Path,
    nothing_runs: list[str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, err = _run(command, [f"{option.opts[0]}={value}"], script, capsys)
    _assert_refused(code, err, nothing_runs, option.opts[0], value)


@pytest.mark.parametrize("value", BAD)
@pytest.mark.parametrize(("command", "option"), FLOAT_OPTIONS)
def test_float_option_from_the_environment_refuses_nan_inf_and_huge(
    command: str,
    option: click.Option,
    value: str,
    script: Path,
    nothing_runs: list[str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert isinstance(option.envvar, str)
    monkeypatch.setenv(option.envvar, value)
    code, err = _run(command, [], script, capsys)
    _assert_refused(code, err, nothing_runs, option.opts[0], value)


@pytest.mark.parametrize("value", BAD)
@pytest.mark.parametrize(("command", "option"), FLOAT_OPTIONS)
def test_float_option_from_the_config_file_refuses_nan_inf_and_huge(
    command: str,
    option: click.Option,
    value: str,
    script: Path,
    nothing_runs: list[str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    key = option.opts[0].lstrip("-")
    config = script.parent / "elasticd.yaml"
    config.write_text(f"{key}: {YAML_BAD[value]}\n")
    code, err = _run(command, ["--config", str(config)], script, capsys)
    _assert_refused(code, err, nothing_runs, str(config), key, str(float(value)))  # as YAML read it: 1e+308


@pytest.mark.parametrize("value", BAD)
@pytest.mark.parametrize("key", sorted(RDZV_CONF_KEYS))
@pytest.mark.parametrize("source", ["cli", "env", "file"])
def test_rdzv_conf_value_refuses_nan_inf_and_huge(
    key: str,
    value: str,
    source: str,
    script: Path,
    nothing_runs: list[str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    entry = f"{key}={value}"
    args: list[str] = []
    if source == "cli":
        args = ["--rdzv-conf", entry]
    elif source == "env":
        monkeypatch.setenv("ELASTICD_RDZV_CONF", entry)
    else:
        config = script.parent / "elasticd.yaml"
        config.write_text(f"rdzv-conf: {entry}\n")
        args = ["--config", str(config)]
    code, err = _run("start", args, script, capsys)
    _assert_refused(code, err, nothing_runs, "--rdzv-conf", key, value)


@pytest.mark.parametrize(("args", "needle"), [(["--hang-timeout", "-1"], "> 0"), (["--hang-timeout", "0"], "> 0")])
def test_hang_timeout_still_refuses_non_positive_seconds(
    args: list[str], needle: str, script: Path, nothing_runs: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = _run("start", args, script, capsys)
    _assert_refused(code, err, nothing_runs, "--hang-timeout", needle)


@pytest.mark.parametrize("command", ["status", "stop"])
@pytest.mark.parametrize("value", ["0", "-5"])
def test_etcd_connect_timeout_of_status_and_stop_must_be_positive(
    command: str, value: str, script: Path, nothing_runs: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = _run(command, [f"--etcd-connect-timeout={value}"], script, capsys)
    _assert_refused(code, err, nothing_runs, "--etcd-connect-timeout")


def test_finite_values_still_pass(script: Path, nothing_runs: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _run(
        "start",
        ["--hang-timeout", "2.5", "--monitor-interval", "0.2", "--rdzv-conf", "join_timeout=30"],
        script,
        capsys,
    )
    assert code == 0, err
    assert nothing_runs == ["start"]
