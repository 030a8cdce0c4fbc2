"""Resolving etcd TLS files and credentials: checked together, password from a file or the environment."""

from __future__ import annotations

from pathlib import Path

import pytest

from elasticd import options
from elasticd.errors import ConfigError
from elasticd.etcd.access import PASSWORD_ENV, EtcdAccess, resolve_access

PASSWORD_FILE_ENV = options.ETCD_PASSWORD_FILE.env


@pytest.fixture
def files(tmp_path: Path) -> dict[str, str]:
    names = {"ca": "ca.pem", "cert": "c.pem", "key": "k.pem", "pw": "pw"}
    for name in names.values():
        (tmp_path / name).write_text("x\n")
    (tmp_path / "pw").write_text("hunter2\n")
    return {k: str(tmp_path / v) for k, v in names.items()}


def test_password_file_wins_and_loses_its_newline(files: dict[str, str]) -> None:
    access = resolve_access(user="root", password_file=files["pw"], env={PASSWORD_ENV: "from-env"})
    assert access.password == "hunter2"
    assert access.worker_env() == {"ELASTICD_ETCD_USER": "root", PASSWORD_FILE_ENV: files["pw"]}


def test_password_from_the_environment(files: dict[str, str]) -> None:
    access = resolve_access(user="root", env={PASSWORD_ENV: "from-env"})
    assert access.password == "from-env" and access.rdzv_conf() == {"user": "root", "password": "from-env"}


def test_tls_files_reach_the_client_the_rendezvous_and_the_workers(files: dict[str, str]) -> None:
    access = resolve_access(ca_cert=files["ca"], cert=files["cert"], key=files["key"], env={})
    assert access.connect_kwargs()["ca_cert"] == files["ca"]
    assert access.rdzv_conf() == {"cacert": files["ca"], "cert": files["cert"], "key": files["key"]}
    assert EtcdAccess.from_worker_env(access.worker_env()) == access


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"cert": "CERT"}, "--etcd-cert"),
        ({"key": "KEY"}, "--etcd-key"),
        ({"cert": "CERT", "key": "KEY"}, "--etcd-cacert"),
        ({"user": "root"}, "--etcd-user"),
        ({"ca_cert": "/nope"}, "--etcd-cacert"),
    ],
)
def test_inconsistent_options_name_the_flag(files: dict[str, str], kwargs: dict[str, str], flag: str) -> None:
    resolved = {k: files.get(v.lower(), v) for k, v in kwargs.items()}
    with pytest.raises(ConfigError) as error:
        resolve_access(**resolved, env={})
    assert error.value.key == flag


def test_a_password_without_a_user_is_refused() -> None:
    with pytest.raises(ConfigError, match="no user"):
        resolve_access(env={PASSWORD_ENV: "pw"})
