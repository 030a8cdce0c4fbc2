"""Bad input to ``elasticd start`` ends in one clear line on stderr and exit code 2, never a traceback."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from elasticd.cli import main
from elasticd.config import StartConfig
from elasticd.endpoints import Endpoint, format_endpoints


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text("print('hi')\n")
    return path


@pytest.fixture
def captured_config(monkeypatch: pytest.MonkeyPatch) -> list[StartConfig]:
    """Replace the daemon with a recorder, so parsing is tested without starting anything."""
    seen: list[StartConfig] = []

    def fake_run(cfg: StartConfig) -> int:
        seen.append(cfg)
        return 0

    monkeypatch.setattr("elasticd.agent.daemon.run_daemon", fake_run)
    return seen


def run_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(args)
    err = capsys.readouterr().err
    return code, err


def assert_one_line_error(code: int, err: str, *needles: str) -> None:
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("elasticd: error: ")
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["--min-nodes", "3", "--max-nodes", "2"], ["--min-nodes", "3", "--max-nodes 2"]),
        (["--min-nodes", "0"], ["--min-nodes", ">= 1"]),
        (["--max-nodes", "-1"], ["--max-nodes"]),
        (["--nproc-per-node", "0"], ["--nproc-per-node"]),
        (["--nproc-per-node", "many"], ["--nproc-per-node", "many"]),
        (["--etcd", "localhost:notaport"], ["--etcd", "notaport"]),
        (["--run-id", "a/b"], ["--run-id", "a/b"]),
        (["--run-id", ".."], ["--run-id"]),
        (["--hang-timeout", "-3"], ["--hang-timeout"]),
        (["--hang-timeout", "soon"], ["--hang-timeout", "soon", "auto"]),
        (["--hang-attempts", "0"], ["--hang-attempts", ">= 1"]),
        (["--startup-timeout", "0"], ["--startup-timeout"]),
        (["--straggler-factor", "0.5"], ["--straggler-factor", "0 to disable"]),
        (["--straggler-window", "-1"], ["--straggler-window"]),
        (["--drain-timeout", "0"], ["--drain-timeout"]),
        (["--etcd", "127.0.0.1:2379", "--etcd-user", "root"], ["--etcd-user", "ELASTICD_ETCD_PASSWORD"]),
        (["--etcd", "127.0.0.1:2379", "--etcd-cacert", "/no/such/ca.pem"], ["--etcd-cacert", "/no/such/ca.pem"]),
        (["--etcd", "127.0.0.1:2379", "--etcd-password-file", "/no/pw"], ["--etcd-password-file", "/no/pw"]),
        (["--etcd-user", "root", "--etcd-password-file", __file__], ["--etcd", "external etcd"]),
        (["--on-nan", "explode"], ["--on-nan", "explode"]),
        (["--metrics-port", "70000"], ["--metrics-port"]),
        (["--keep-checkpoints", "0"], ["--keep-checkpoints"]),
        (["--rdzv-conf", "bogus=1"], ["--rdzv-conf", "bogus"]),
    ],
)
def test_bad_flag_is_one_line_and_exit_2(
    args: list[str],
    needles: list[str],
    script: Path,
    captured_config: list[StartConfig],
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, err = run_cli(["start", *args, str(script)], capsys)
    assert_one_line_error(code, err, *needles)
    assert captured_config == []


@pytest.mark.parametrize("args", [[], ["--min-nodes", "2"]])
def test_start_without_a_script_is_a_three_line_usage_error(
    args: list[str], captured_config: list[StartConfig], capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = run_cli(["start", *args], capsys)
    assert code == 2
    assert err.splitlines() == [
        "Usage: elasticd start [OPTIONS] SCRIPT [SCRIPT_ARGS]...",
        "Try 'elasticd start --help' for the options.",
        "elasticd: error: Missing argument 'SCRIPT'.",
    ]
    assert captured_config == []


def test_missing_script_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run_cli(["start", str(tmp_path / "nope.py")], capsys)
    assert_one_line_error(code, err, "nope.py", "does not exist")


def test_bad_env_value_names_the_variable(
    script: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("ELASTICD_MIN_NODES", "two")
    code, err = run_cli(["start", str(script)], capsys)
    assert_one_line_error(code, err, "ELASTICD_MIN_NODES", "two")


def test_unknown_yaml_key_is_named_with_a_suggestion(script: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = script.parent / "elasticd.yaml"
    cfg.write_text("min-nodes: 1\nmax_node: 4\n")
    code, err = run_cli(["start", "--config", str(cfg), str(script)], capsys)
    assert_one_line_error(code, err, "max_node", "unknown key", "max-nodes")


def test_bad_yaml_value_names_file_and_key(script: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = script.parent / "elasticd.yaml"
    cfg.write_text("max-nodes: lots\n")
    code, err = run_cli(["start", "--config", str(cfg), str(script)], capsys)
    assert_one_line_error(code, err, str(cfg), "max-nodes", "lots")


def test_malformed_yaml_is_reported(script: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = script.parent / "elasticd.yaml"
    cfg.write_text("min-nodes: [1,\n")
    code, err = run_cli(["start", "--config", str(cfg), str(script)], capsys)
    assert_one_line_error(code, err, "not valid YAML")


def test_precedence_cli_over_env_over_file_over_default(
    script: Path,
    monkeypatch: pytest.MonkeyPatch,
    captured_config: list[StartConfig],
    capsys: pytest.CaptureFixture[str],
) -> None:
    cfg = script.parent / "elasticd.yaml"
    cfg.write_text("min_nodes: 2\nmax-nodes: 5\nrun-id: from-file\nkeep-checkpoints: 7\n")
    monkeypatch.setenv("ELASTICD_MAX_NODES", "6")
    monkeypatch.setenv("ELASTICD_RUN_ID", "from-env")
    code, err = run_cli(["start", "--config", str(cfg), "--run-id", "from-cli", str(script), "--lr", "3"], capsys)
    assert code == 0, err
    (c,) = captured_config
    assert (c.min_nodes, c.max_nodes, c.run_id, c.keep_checkpoints) == (2, 6, "from-cli", 7)
    assert c.metrics_port == 9400  # default
    assert c.script_args == ("--lr", "3")  # everything after SCRIPT belongs to the script


def test_options_with_a_unit_suffix_are_read_from_the_config_file(
    script: Path, captured_config: list[StartConfig], capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = script.parent / "elasticd.yaml"
    cfg.write_text(
        "drain-timeout: 170\nstartup-timeout: 90\netcd-connect-timeout: 4\nstraggler-window: 12\n"
        "monitor-interval: 0.5\nhang-timeout: 7\n"
    )
    code, err = run_cli(["start", "--config", str(cfg), str(script)], capsys)
    assert code == 0, err
    (c,) = captured_config
    assert (c.drain_timeout_s, c.startup_timeout_s, c.etcd_connect_timeout_s) == (170.0, 90.0, 4.0)
    assert (c.straggler_window_s, c.monitor_interval_s, c.hang_timeout_s) == (12.0, 0.5, 7.0)


def test_config_file_from_env(
    script: Path,
    monkeypatch: pytest.MonkeyPatch,
    captured_config: list[StartConfig],
    capsys: pytest.CaptureFixture[str],
) -> None:
    cfg = script.parent / "elasticd.yaml"
    cfg.write_text("max-nodes: 3\n")
    monkeypatch.setenv("ELASTICD_CONFIG", str(cfg))
    code, err = run_cli(["start", str(script)], capsys)
    assert code == 0, err
    assert captured_config[0].max_nodes == 3


def test_defaults_work_without_any_flag(
    script: Path, captured_config: list[StartConfig], capsys: pytest.CaptureFixture[str]
) -> None:
    code, _ = run_cli(["start", str(script)], capsys)
    assert code == 0
    (c,) = captured_config
    assert c.embedded_etcd and c.min_nodes == c.max_nodes == 1 and c.run_id == "default"
    assert c.node_id == socket.gethostname() and c.hang_timeout_s is None and c.on_nan == "rollback"


def test_status_and_stop_read_start_s_config_file_and_ignore_its_other_keys(
    script: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    seen: list[tuple[str, str]] = []

    def fake(etcd: tuple[Endpoint, ...], run_id: str, _timeout: float, **_kw: object) -> int:
        seen.append((format_endpoints(etcd), run_id))
        return 0

    monkeypatch.setattr("elasticd.status.show_status", fake)
    monkeypatch.setattr("elasticd.control.request_drain", fake)
    cfg = script.parent / "elasticd.yaml"
    cfg.write_text("etcd: etcd-0:2379\nrun-id: job7\nmin-nodes: 2\nhang-timeout: auto\n")
    assert run_cli(["status", "--config", str(cfg)], capsys)[0] == 0
    monkeypatch.setenv("ELASTICD_CONFIG", str(cfg))
    assert run_cli(["stop", "--run-id", "other"], capsys)[0] == 0
    assert seen == [("etcd-0:2379", "job7"), ("etcd-0:2379", "other")]
    cfg.write_text("etcd: etcd-0:2379\nmin-nodez: 2\n")
    code, err = run_cli(["status", "--config", str(cfg)], capsys)
    assert_one_line_error(code, err, "min-nodez", "min-nodes")


@pytest.mark.parametrize(
    ("typed", "said"),
    [
        (["--max-node", "3"], "no such option: --max-node (did you mean --max-nodes?)"),
        (["--nproc-per-nod=2"], "no such option: --nproc-per-nod (did you mean --nproc-per-node?)"),
        (["--bogus-flag"], "no such option: --bogus-flag ('elasticd start --help' lists them)"),
    ],
)
def test_a_mistyped_option_before_the_script_is_named_as_one_with_the_nearest(
    typed: list[str], said: str, script: Path, captured_config: list[StartConfig], capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = run_cli(["start", "--min-nodes", "1", *typed, str(script)], capsys)
    assert code == 2 and err == f"elasticd: error: {said}\n"
    assert captured_config == []


def test_options_after_the_script_go_to_it_untouched_and_a_script_named_like_an_option_runs(
    tmp_path: Path,
    script: Path,
    captured_config: list[StartConfig],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    code, err = run_cli(["start", str(script), "--max-node", "3", "--bogus-flag"], capsys)
    assert code == 0, err
    assert captured_config[-1].script_args == ("--max-node", "3", "--bogus-flag")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "-odd.py").write_text("print('hi')\n")
    code, err = run_cli(["start", "-odd.py"], capsys)
    assert code == 0, err
