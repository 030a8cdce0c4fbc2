"""Names of the environment variables elasticd sets or reads, as constants: the one place they are written.

Two kinds. A start option marked ``worker`` in the option table (``options.py``) reaches the workers under its own
``ELASTICD_<NAME>`` (``--checkpoint-dir``: ``ELASTICD_CHECKPOINT_DIR``); its name is derived there and repeated here
only as an alias for readers. The rest are below: what the daemon tells its workers that is no option, test-only
fault injection, and the torch variables elasticd sets. ``tests/unit/test_envvars.py`` fails on an ``ELASTICD_`` or
``TORCH_`` string literal anywhere else in the package. A script started without a daemon sees none of them and the
worker library becomes a no-op.
"""

from __future__ import annotations

from elasticd import options as _o

PREFIX = _o.ENV_PREFIX

# --- options given to workers (aliases of the option table's names) ----------------------------------------------
RUN_ID = _o.RUN_ID.env
NODE_ID = _o.NODE_ID.env
ETCD = _o.ETCD.env
RECOVERY = _o.RECOVERY.env
# The address other nodes reach this node at (--local-addr): where the hot path's liveness probes connect.
LOCAL_ADDR = _o.LOCAL_ADDR.env

# --- what the daemon tells its workers ---------------------------------------------------------------------------
# Unix datagram socket of the local daemon; progress beats go there without ever blocking a step.
SOCKET = PREFIX + "SOCKET"
# "0" makes checkpoint saves blocking (the benchmarks compare both); default: asynchronous.
ASYNC_CHECKPOINTS = PREFIX + "ASYNC_CHECKPOINTS"
# Directory of the progress board (elasticd/board.py): a shared-memory slot per local worker, and where a worker
# writes its stacks and flight-recorder dump when its daemon suspects a hang.
BOARD = PREFIX + "BOARD"
# The rendezvous round the workers were started in (recorded in checkpoint manifests).
ROUND = PREFIX + "ROUND"
# The fencing token of the worker group (elasticd/lineage.py): a commit is recorded only while it is current.
FENCE_TOKEN = PREFIX + "FENCE_TOKEN"
# Set for the workers of a node that joins a group training in place (--recovery hot): the group's round. They
# start in a private world of their own node, prepare, then ask to be admitted and heal from a live peer.
JOIN_ROUND = PREFIX + "JOIN_ROUND"
# The daemon's pid. The worker launcher (elasticd/worker/launch.py) checks it is still its parent after asking the
# kernel for a death signal, and the reaper (elasticd/agent/reaper.py) kills every process that carries it once that
# daemon is gone: it marks everything a daemon started, down to the workers' own children.
DAEMON_PID = PREFIX + "DAEMON_PID"
# etcd's password, for a user who keeps it out of files (never a flag: a flag shows in `ps`); the daemon gives it to
# its workers this way when it had no --etcd-password-file.
ETCD_PASSWORD = PREFIX + "ETCD_PASSWORD"

# --- test-only fault injection (documented as a testing aid in docs/testing.md) ----------------------------------
FAULT = PREFIX + "FAULT"
# The daemon SIGKILLs itself at a point of a forming round (elasticd/rendezvous/faults.py).
FAULT_DIE_AFTER_RDZV = PREFIX + "FAULT_DIE_AFTER_RDZV"

# --- torch's own ---------------------------------------------------------------------------------------------------
# torch reads this inside DynamicRendezvousHandler.next_rendezvous: "1" makes every round pick a fresh worker
# store address instead of reusing round 1's, whose host may be gone (pytorch issue #135712).
TORCH_DISABLE_SHARED_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
# torch reads these when it creates an NCCL process group (elasticd/worker/hot/backend.py gives the daemon their
# values for hot recovery): what the watchdog does on an NCCL error or timeout (torch's default tears the process
# down), and whether NCCL communicators are non-blocking (so that an abort from another thread cannot hang).
TORCH_NCCL_ASYNC_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
TORCH_NCCL_USE_COMM_NONBLOCKING = "TORCH_NCCL_USE_COMM_NONBLOCKING"
# torch's collective diagnostics, which the daemon sets for its workers (agent/daemon.py): the flight recorder's
# buffer and dump file (current names: TORCH_NCCL_TRACE_BUFFER_SIZE and TORCH_NCCL_DEBUG_INFO_TEMP_FILE are
# deprecated aliases that make every worker warn), the dump on an NCCL timeout, and NCCL's heartbeat monitor.
TORCH_FR_BUFFER_SIZE = "TORCH_FR_BUFFER_SIZE"
TORCH_FR_DUMP_TEMP_FILE = "TORCH_FR_DUMP_TEMP_FILE"
TORCH_NCCL_DUMP_ON_TIMEOUT = "TORCH_NCCL_DUMP_ON_TIMEOUT"
TORCH_NCCL_ENABLE_MONITORING = "TORCH_NCCL_ENABLE_MONITORING"
TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC = "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"
