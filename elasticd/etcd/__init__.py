"""Talking to etcd: endpoint lists (:mod:`.endpoints`), the client (:mod:`.client`), an embedded server
(:mod:`.server`).

Only the endpoint types are re-exported here, so that parsing a command line does not load gRPC.
"""

from __future__ import annotations

import os

# gRPC's C core logs every failed TLS handshake and reconnect at INFO on stderr, glog-style, interleaved with our
# one-line errors and JSON events; we report those failures ourselves. Set before gRPC loads (users may override).
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

from elasticd.etcd.endpoints import DEFAULT_PORT, Endpoint, format_endpoints, parse_endpoints

__all__ = ["DEFAULT_PORT", "Endpoint", "format_endpoints", "parse_endpoints"]
