"""Talking to etcd: the client (:mod:`.client`), credentials and TLS (:mod:`.access`), an embedded server
(:mod:`.server`) and ``elasticd etcd`` (:mod:`.dev`). Endpoint lists are text, parsed below the option table
(``elasticd/endpoints.py``), so that parsing a command line does not load gRPC.
"""

from __future__ import annotations

import os

from elasticd import envvars

# gRPC's C core logs every failed TLS handshake and reconnect at INFO on stderr, glog-style, interleaved with our
# one-line errors and JSON events; we report those failures ourselves. Set before gRPC loads (users may override).
os.environ.setdefault(envvars.GRPC_VERBOSITY, "ERROR")
