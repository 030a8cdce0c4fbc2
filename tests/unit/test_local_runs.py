"""The per-user directory where a daemon with an embedded etcd says where it is (``elasticd/etcd/local_runs.py``):
records are the user's only, stale ones go, and ``status``/``stop`` without ``--etcd`` take the one that matches."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from elasticd import options as o
from elasticd.errors import ConfigError
from elasticd.etcd import local_runs
from elasticd.etcd.local_runs import LocalRun


def _run(run_id: str = "demo", endpoint: str = "127.0.0.1:40001", pid: int | None = None) -> LocalRun:
    return LocalRun(run_id, endpoint, "root", "/tmp/x/password", os.getpid() if pid is None else pid, "node-a")


def _dead_pid() -> int:
    """A pid no process has: the kernel hands out pids below pid_max (a unit test starts no process to reap)."""
    return int(Path("/proc/sys/kernel/pid_max").read_text())


def test_a_record_is_the_user_s_own_found_while_its_daemon_lives_and_gone_when_withdrawn(tmp_path: Path) -> None:
    directory = local_runs.runs_dir({"XDG_RUNTIME_DIR": str(tmp_path)})
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    path = local_runs.publish(_run(), directory)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert local_runs.find(directory) == [_run()]
    local_runs.withdraw(path)
    assert local_runs.find(directory) == []


def test_a_record_whose_daemon_died_is_skipped_and_removed(tmp_path: Path) -> None:
    directory = local_runs.runs_dir({"XDG_RUNTIME_DIR": str(tmp_path)})
    stale = local_runs.publish(_run("old", pid=_dead_pid()), directory)
    (directory / "junk.json").write_text("{not json")
    live = local_runs.publish(_run("new"), directory)
    assert [r.run_id for r in local_runs.find(directory)] == ["new"]
    assert not stale.exists() and live.exists()


def test_a_directory_open_to_others_is_refused(tmp_path: Path) -> None:
    directory = local_runs.runs_dir({"XDG_RUNTIME_DIR": str(tmp_path)})
    directory.chmod(0o755)
    with pytest.raises(local_runs.LocalRunsError, match="closed to others"):
        local_runs.runs_dir({"XDG_RUNTIME_DIR": str(tmp_path)})


def _given(*fields: str):  # type: ignore[no-untyped-def]
    return lambda field: field in fields


VALUES = {o.ETCD.field: None, o.RUN_ID.field: "default", o.ETCD_USER.field: None, o.ETCD_PASSWORD_FILE.field: None}


def test_status_without_etcd_takes_the_one_local_run_and_its_login() -> None:
    filled = local_runs.fill_in(VALUES, _given(), lambda: [_run()])
    assert filled[o.ETCD.field] == "127.0.0.1:40001" and filled[o.RUN_ID.field] == "demo"
    assert filled[o.ETCD_USER.field] == "root" and filled[o.ETCD_PASSWORD_FILE.field] == "/tmp/x/password"


def test_a_named_etcd_or_login_is_never_replaced_and_a_named_run_must_match() -> None:
    for field in (o.ETCD.field, o.ETCD_USER.field, o.ETCD_CACERT.field):
        assert local_runs.fill_in(VALUES, _given(field), lambda: [_run()]) == VALUES
    assert (
        local_runs.fill_in({**VALUES, o.RUN_ID.field: "other"}, _given(o.RUN_ID.field), lambda: [_run()])[o.ETCD.field]
        is None
    )
    picked = local_runs.fill_in(
        {**VALUES, o.RUN_ID.field: "b"}, _given(o.RUN_ID.field), lambda: [_run("a"), _run("b", "127.0.0.1:40002")]
    )
    assert picked[o.ETCD.field] == "127.0.0.1:40002"


def test_several_local_runs_ask_the_user_to_name_one() -> None:
    with pytest.raises(ConfigError, match="--run-id: 2 runs with an embedded etcd on this machine: a at"):
        local_runs.fill_in(VALUES, _given(), lambda: [_run("a"), _run("b", "127.0.0.1:40002")])
    with pytest.raises(ConfigError, match="--etcd: 2 runs"):
        local_runs.fill_in(VALUES, _given(), lambda: [_run("a"), _run("a", "127.0.0.1:40002")])
