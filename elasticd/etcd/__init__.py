"""Talking to etcd: endpoint lists (:mod:`.endpoints`), the client (:mod:`.client`), an embedded server
(:mod:`.server`).

Only the endpoint types are re-exported here, so that parsing a command line does not load gRPC.
"""

from __future__ import annotations

from elasticd.etcd.endpoints import DEFAULT_PORT, Endpoint, format_endpoints, parse_endpoints

__all__ = ["DEFAULT_PORT", "Endpoint", "format_endpoints", "parse_endpoints"]
