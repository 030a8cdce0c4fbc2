"""How to reach a protected etcd: TLS files and user/password, resolved and checked once, then handed to every user.

Anyone who can write torch's rendezvous state can make every agent unpickle what they wrote, so production etcd
must require TLS client certificates or a password (docs/deploy-kubernetes.md). One :class:`EtcdAccess` is built from
the ``--etcd-cacert/--etcd-cert/--etcd-key/--etcd-user/--etcd-password-file`` options (password also from
``ELASTICD_ETCD_PASSWORD``, never a flag: a flag shows in ``ps``), and used by the daemon's client, the rendezvous
(through its config keys, as ``torchrun --rdzv-conf`` also passes them), ``status``/``stop`` and the workers' fence
(through environment variables the daemon exports).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elasticd import options as o
from elasticd.envvars import ETCD_PASSWORD as PASSWORD_ENV
from elasticd.errors import ConfigError

# What the daemon exports so that workers connect the same way: each option's own ELASTICD_<NAME> (values are file
# paths, or the user name).
_WORKER_ENV = {
    "ca_cert": o.ETCD_CACERT.env,
    "cert": o.ETCD_CERT.env,
    "key": o.ETCD_KEY.env,
    "user": o.ETCD_USER.env,
}


@dataclass(frozen=True, slots=True)
class EtcdAccess:
    ca_cert: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password: str | None = None
    password_file: str | None = None  # where the password came from, so workers read the same file

    def connect_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of :meth:`elasticd.etcd.client.EtcdClient.connect`."""
        return {
            "ca_cert": self.ca_cert,
            "cert": self.cert,
            "key": self.key,
            "user": self.user,
            "password": self.password,
        }

    def rdzv_conf(self) -> dict[str, str]:
        """The rendezvous handler's config keys (the same names ``torchrun --rdzv-conf`` uses)."""
        pairs = {"cacert": self.ca_cert, "cert": self.cert, "key": self.key, "user": self.user}
        pairs["password"] = self.password
        return {k: v for k, v in pairs.items() if v is not None}

    def worker_env(self) -> dict[str, str]:
        env = {name: str(getattr(self, field)) for field, name in _WORKER_ENV.items() if getattr(self, field)}
        if self.password_file:
            env[o.ETCD_PASSWORD_FILE.env] = self.password_file
        elif self.password is not None:
            env[PASSWORD_ENV] = self.password  # workers are this daemon's own children
        return env

    @classmethod
    def from_worker_env(cls, env: Mapping[str, str] | None = None) -> EtcdAccess:
        e = os.environ if env is None else env
        return resolve_access(
            ca_cert=e.get(_WORKER_ENV["ca_cert"]),
            cert=e.get(_WORKER_ENV["cert"]),
            key=e.get(_WORKER_ENV["key"]),
            user=e.get(_WORKER_ENV["user"]),
            password_file=e.get(o.ETCD_PASSWORD_FILE.env),
            env=e,
        )


def resolve_access(
    *,
    ca_cert: str | None = None,
    cert: str | None = None,
    key: str | None = None,
    user: str | None = None,
    password_file: str | None = None,
    env: Mapping[str, str] | None = None,
) -> EtcdAccess:
    """Check the options together and read the password; every problem names the option."""
    e = os.environ if env is None else env
    for flag, path in ((o.ETCD_CACERT.flag, ca_cert), (o.ETCD_CERT.flag, cert), (o.ETCD_KEY.flag, key)):
        if path and not Path(path).is_file():
            raise ConfigError(flag, f"{path} does not exist or is not a file")
    if bool(cert) != bool(key):
        raise ConfigError(
            o.ETCD_CERT.flag if cert else o.ETCD_KEY.flag, "give the client certificate and its key together"
        )
    if cert and not ca_cert:
        raise ConfigError(o.ETCD_CACERT.flag, "a client certificate needs the CA certificate that signed the server's")
    password = None
    if password_file:
        try:
            password = Path(password_file).read_text().rstrip("\r\n")
        except OSError as exc:
            raise ConfigError(o.ETCD_PASSWORD_FILE.flag, f"cannot read {password_file}: {exc.strerror}") from None
    elif e.get(PASSWORD_ENV):
        password = e[PASSWORD_ENV]
    if user and password is None:
        raise ConfigError(o.ETCD_USER.flag, f"needs a password: {o.ETCD_PASSWORD_FILE.flag} or {PASSWORD_ENV}")
    if password is not None and not user:
        raise ConfigError(o.ETCD_USER.flag, "a password was given but no user")
    return EtcdAccess(
        ca_cert=ca_cert or None,
        cert=cert or None,
        key=key or None,
        user=user or None,
        password=password,
        password_file=password_file or None,
    )


def access_from_options(values: Mapping[str, object]) -> EtcdAccess:
    """The access the ``--etcd-cacert/--etcd-cert/--etcd-key/--etcd-user/--etcd-password-file`` options give (values
    by field name; the password also from its environment variable)."""

    def text(option: o.Option) -> str | None:
        value = values.get(option.field)
        return str(value) if value else None

    return resolve_access(
        ca_cert=text(o.ETCD_CACERT),
        cert=text(o.ETCD_CERT),
        key=text(o.ETCD_KEY),
        user=text(o.ETCD_USER),
        password_file=text(o.ETCD_PASSWORD_FILE),
    )
