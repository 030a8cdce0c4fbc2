"""What an etcd call that failed raises: :class:`EtcdError`, naming the operation, the endpoint and the gRPC code.

Below :mod:`elasticd.etcd.client` (which translates pyetcd's and grpc's exceptions into these) and its mixins.
"""

from __future__ import annotations

from elasticd.errors import ElasticdError

# What etcd answers while it elects a leader or has no quorum, and what a call to a dead member ends in (pyetcd: "No
# endpoint available"): worth a retry within a client's election grace (``connect``'s).
ELECTION_ANSWERS = ("leader changed", "no leader", "not leader", "request timed out", "timed out waiting for read index", "context deadline exceeded", "No endpoint available")  # fmt: skip  # noqa: E501
RETRY_CODES = ("UNAVAILABLE", "DEADLINE_EXCEEDED")
REFUSED_CODES = ("UNAUTHENTICATED", "PERMISSION_DENIED")  # etcd's permissions said no: the same answer again


class EtcdError(ElasticdError):
    """An etcd call failed; ``operation``, ``endpoint`` and the gRPC ``code`` name say where and why."""

    def __init__(self, operation: str, endpoint: str, code: str, detail: str) -> None:
        super().__init__(f"etcd {operation} at {endpoint} failed: {code or 'error'}: {detail}")
        self.operation = operation
        self.endpoint = endpoint
        self.code = code

    @property
    def transient(self) -> bool:
        """An answer of an election in progress or of an unreachable member: another member may serve a retry."""
        return self.code in RETRY_CODES or any(m in str(self) for m in ELECTION_ANSWERS)

    @property
    def refused(self) -> bool:
        """etcd answered no for good (authentication, permissions): asking again gets the same answer."""
        return self.code in REFUSED_CODES or "permission denied" in str(self).lower()


class EtcdLeaseNotFoundError(EtcdError):
    """A write named a lease that etcd no longer knows (expired, revoked, or etcd lost its data)."""
