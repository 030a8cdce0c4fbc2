"""Names of the environment variables elasticd sets or reads, as constants (one place, DESIGN.md §3).

The daemon gives these to every worker on top of torchrun's own (RANK, WORLD_SIZE, ...). The worker library reads
them; a script started without a daemon sees none of them and the library becomes a no-op.
"""

from __future__ import annotations

# Unix datagram socket of the local daemon; progress beats go there without ever blocking a step.
SOCKET = "ELASTICD_SOCKET"
RUN_ID = "ELASTICD_RUN_ID"
NODE_ID = "ELASTICD_NODE_ID"
CHECKPOINT_DIR = "ELASTICD_CHECKPOINT_DIR"
CHECKPOINT_EVERY_STEPS = "ELASTICD_CHECKPOINT_EVERY_STEPS"
CHECKPOINT_EVERY_SECONDS = "ELASTICD_CHECKPOINT_EVERY_SECONDS"
KEEP_CHECKPOINTS = "ELASTICD_KEEP_CHECKPOINTS"
ON_NAN = "ELASTICD_ON_NAN"
ASYNC_CHECKPOINTS = "ELASTICD_ASYNC_CHECKPOINTS"
# --recovery: "hot" lets the worker library re-form the group in place after a failure (elasticd/worker/hot/).
RECOVERY = "ELASTICD_RECOVERY"
# The address other nodes reach this node at (--local-addr): where the hot path's liveness probes connect.
LOCAL_ADDR = "ELASTICD_LOCAL_ADDR"
# The daemon's own options, also given to workers: the fence needs etcd, the batch plan the elastic range.
ETCD = "ELASTICD_ETCD"
MIN_NODES = "ELASTICD_MIN_NODES"
MAX_NODES = "ELASTICD_MAX_NODES"
# Directory of the progress board (elasticd/board.py): a shared-memory slot per local worker, and where a worker
# writes its stacks and flight-recorder dump when its daemon suspects a hang.
BOARD = "ELASTICD_BOARD"
# The rendezvous round the workers were started in (recorded in checkpoint manifests).
ROUND = "ELASTICD_ROUND"
# The fencing token of the worker group (elasticd/lineage.py): a commit is recorded only while it is current.
FENCE_TOKEN = "ELASTICD_FENCE_TOKEN"
# Set for the workers of a node that joins a group training in place (--recovery hot): the group's round. They
# start in a private world of their own node, prepare, then ask to be admitted and heal from a live peer.
JOIN_ROUND = "ELASTICD_JOIN_ROUND"
# The daemon's pid. The worker launcher (elasticd/worker/launch.py) checks it is still its parent after asking the
# kernel for a death signal, and the reaper (elasticd/agent/reaper.py) kills every process that carries it once that
# daemon is gone: it marks everything a daemon started, down to the workers' own children.
DAEMON_PID = "ELASTICD_DAEMON_PID"
# Test-only fault injection (documented as a testing aid in docs/testing.md).
FAULT = "ELASTICD_FAULT"
# Test-only: the daemon SIGKILLs itself at a point of a forming round (elasticd/rendezvous/faults.py).
FAULT_DIE_AFTER_RDZV = "ELASTICD_FAULT_DIE_AFTER_RDZV"

# torch reads this inside DynamicRendezvousHandler.next_rendezvous: "1" makes every round pick a fresh worker
# store address instead of reusing round 1's, whose host may be gone (pytorch issue #135712).
TORCH_DISABLE_SHARED_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
# torch reads these when it creates an NCCL process group (elasticd/worker/hot/backend.py gives the daemon their
# values for hot recovery): what the watchdog does on an NCCL error or timeout (torch's default tears the process
# down), and whether NCCL communicators are non-blocking (so that an abort from another thread cannot hang).
TORCH_NCCL_ASYNC_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
TORCH_NCCL_USE_COMM_NONBLOCKING = "TORCH_NCCL_USE_COMM_NONBLOCKING"
