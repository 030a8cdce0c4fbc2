"""Runs on this machine with an embedded etcd, where ``elasticd status`` and ``stop`` without ``--etcd`` find them.

A daemon that starts its own etcd (no ``--etcd``) listens on a random port and keeps ``root``'s password in a 0600
file of a temporary directory: nothing another terminal could guess. So the daemon publishes a record of its run
(run id, endpoint, user, the password file's path, its pid) in a per-user directory: ``$XDG_RUNTIME_DIR/elasticd``
(systemd's per-user runtime directory, 0700), else ``<tmp>/elasticd-<uid>``. The directory must be the user's own and
closed to everyone else (0700), each record is 0600 and written atomically; a directory that another user owns or
that others may read is refused (someone else could plant a record pointing at their etcd). The record holds the
password file's path, never the password. It is withdrawn when the daemon ends; one whose daemon is gone (killed)
is skipped and removed by the next reader.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elasticd import layout
from elasticd import options as o
from elasticd.errors import ConfigError, ElasticdError


class LocalRunsError(ElasticdError):
    """The per-user directory is not safe to use (another owner, or open to others)."""


@dataclass(frozen=True, slots=True)
class LocalRun:
    run_id: str
    endpoint: str  # HOST:PORT
    user: str | None
    password_file: str | None
    pid: int  # the daemon that published it
    node_id: str


def runs_dir(environ: dict[str, str] | None = None) -> Path:
    """This user's directory of local runs (created 0700 when absent). Raises :class:`LocalRunsError` when it is not
    the user's own or others may enter it."""
    env = os.environ if environ is None else environ
    runtime = env.get("XDG_RUNTIME_DIR")
    base = layout.local_runs_dir(runtime, tempfile.gettempdir(), os.getuid())
    with contextlib.suppress(FileExistsError):
        base.mkdir(mode=0o700, parents=bool(runtime))
    info = base.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise LocalRunsError(f"{base} must be a directory of user {os.getuid()} closed to others (mode 0700)")
    return base


def publish(run: LocalRun, directory: Path | None = None) -> Path:
    """Write ``run``'s record (0600, atomically); returns its path, for :func:`withdraw`."""
    base = runs_dir() if directory is None else directory
    path = base / layout.local_run_name(run.run_id, run.node_id, run.pid)
    fd, tmp = tempfile.mkstemp(dir=base, prefix=".record-")  # 0600
    with os.fdopen(fd, "w") as f:
        json.dump(
            {
                "run_id": run.run_id,
                "endpoint": run.endpoint,
                "user": run.user,
                "password_file": run.password_file,
                "pid": run.pid,
                "node_id": run.node_id,
            },
            f,
        )
    os.replace(tmp, path)
    return path


def withdraw(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def find(directory: Path | None = None) -> list[LocalRun]:
    """The records whose daemon is alive, oldest first; the others are removed."""
    base = runs_dir() if directory is None else directory
    found: list[tuple[float, LocalRun]] = []
    for path in base.glob(f"*{layout.LOCAL_RUN_SUFFIX}"):
        try:
            data = json.loads(path.read_text())
            run = LocalRun(
                run_id=str(data["run_id"]),
                endpoint=str(data["endpoint"]),
                user=data.get("user"),
                password_file=data.get("password_file"),
                pid=int(data["pid"]),
                node_id=str(data.get("node_id", "")),
            )
            mtime = path.stat().st_mtime
        except (OSError, ValueError, KeyError, TypeError):
            continue  # half-written by someone else's editor, or gone meanwhile: not a record
        if _alive(run.pid):
            found.append((mtime, run))
        else:
            withdraw(path)
    return [run for _, run in sorted(found, key=lambda item: item[0])]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, another user's (cannot be: the directory is ours; harmless either way)
    return True


def fill_in(
    values: Mapping[str, Any], given: Callable[[str], bool], local: Callable[[], list[LocalRun]]
) -> dict[str, Any]:
    """``status``/``stop``'s option values (by field) with the local run's etcd and login, when the user named no etcd
    and no credentials (``given(field)``: the user set it, on the command line, in the environment or the config
    file) and ``local()`` (:func:`find`, read only then) holds one for the run asked for (``--run-id``, or any when
    not given). Raises :class:`ConfigError` when several match: the user must pick."""
    if given(o.ETCD.field) or any(given(option.field) for option in o.ETCD_ACCESS):
        return dict(values)
    try:
        runs = local()
    except LocalRunsError:
        return dict(values)  # an unsafe directory: no lookup (the daemon refuses to publish there and says so)
    if given(o.RUN_ID.field):
        runs = [run for run in runs if run.run_id == values[o.RUN_ID.field]]
    if not runs:
        return dict(values)
    if len({(run.run_id, run.endpoint) for run in runs}) > 1:
        listed = ", ".join(f"{run.run_id} at {run.endpoint} (pid {run.pid})" for run in runs)
        flag = o.ETCD.flag if len({run.run_id for run in runs}) == 1 else o.RUN_ID.flag
        raise ConfigError(flag, f"{len(runs)} runs with an embedded etcd on this machine: {listed}; name one")
    run = runs[0]
    return {
        **values,
        o.ETCD.field: run.endpoint,
        o.RUN_ID.field: run.run_id,
        o.ETCD_USER.field: run.user,
        o.ETCD_PASSWORD_FILE.field: run.password_file,
    }
