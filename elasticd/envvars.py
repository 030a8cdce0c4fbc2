"""Names of the environment variables elasticd sets or reads, as constants: the one place they are written.

Two kinds. A start option marked ``worker`` in the option table (``options.py``) reaches the workers under its own
``ELASTICD_<NAME>`` (``--checkpoint-dir``: ``ELASTICD_CHECKPOINT_DIR``); its name is derived there and repeated here
only as an alias for readers. The rest are below: what the daemon tells its workers that is no option, test-only
fault injection, the variables of torch, torchrun, accelerate, OpenMP, Python, gRPC and etcd that elasticd sets or
reads. ``tests/unit/test_one_place.py`` fails on a string literal that starts like one of these names (``ELASTICD_``,
``TORCH_``, ``TORCHELASTIC_``, ``MASTER_``, ``OMP_``, ``ACCELERATE_``, ``GLOO_``, ``NCCL_``, ..., or is one of
torchrun's rank names) anywhere else in the package. A script started without a daemon sees none of elasticd's own
and the worker library becomes a no-op.
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
# "0": the daemon starts each worker as a new interpreter, not forked from its warm server (agent/warm_start.py).
WARM_START = PREFIX + "WARM_START"
# The daemon's rendezvous: "lease" (default: rendezvous/lease_handler.py, one small key per node) or "torch" (torch's
# dynamic rendezvous over one shared state, rendezvous/handler.py: what torchrun --rdzv-backend etcd-v3 uses).
RENDEZVOUS = PREFIX + "RENDEZVOUS"
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
# The interface gloo's and NCCL's transports bind (default: the address the host name resolves to); the daemon names
# the one that holds --local-addr unless the user set them (elasticd/addresses.py).
GLOO_SOCKET_IFNAME = "GLOO_SOCKET_IFNAME"
NCCL_SOCKET_IFNAME = "NCCL_SOCKET_IFNAME"
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

# --- torchrun's: what torch's agent gives every worker, and what it reads itself ---------------------------------
# A worker's global and local rank, and the workers of its node (the worker library reads them before accelerate
# is up: beats name their rank, settings the node's worker count).
RANK = "RANK"
LOCAL_RANK = "LOCAL_RANK"
LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
# How many times the agent restarted this worker group: a test fault with restart=N fires in that generation only.
TORCHELASTIC_RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
# The signals torch's agent turns into an immediate stop; the daemon leaves SIGTERM and SIGINT out of it, for a
# graceful leave (agent/daemon.py).
TORCHELASTIC_SIGNALS_TO_HANDLE = "TORCHELASTIC_SIGNALS_TO_HANDLE"
# The round's store address, set by torch's agent for every worker each round: never taken from accelerate's config
# file (accelerate_env.py).
MASTER_ADDR = "MASTER_ADDR"
MASTER_PORT = "MASTER_PORT"

# --- the workers' runtime, set by the daemon unless the user did -------------------------------------------------
# accelerate on a host without GPUs ignores torchrun's WORLD_SIZE unless told to use the CPU (accelerate's state.py).
ACCELERATE_USE_CPU = "ACCELERATE_USE_CPU"
# accelerate's FSDP switch, from an FSDP config file (with FSDP_VERSION and the other FSDP_* settings); on a host
# without GPUs the worker library makes accelerate honour it on gloo (worker/fsdp.py).
ACCELERATE_USE_FSDP = "ACCELERATE_USE_FSDP"
# A hybrid-shard config (accelerate's parallelism_config_dp_replicate_size above 1): shard inside each node,
# replicate across nodes (elasticd/worker/hybrid.py); set by the daemon from the config file.
HYBRID_SHARD = "ELASTICD_HYBRID_SHARD"
FSDP_VERSION = "FSDP_VERSION"
# OpenMP's threads per worker: the daemon divides the physical cores among its workers (accelerate_env.py).
OMP_NUM_THREADS = "OMP_NUM_THREADS"
# A worker that dies on a signal (SIGSEGV in native code) prints every thread's Python stack to its stderr.
PYTHONFAULTHANDLER = "PYTHONFAULTHANDLER"
# read by the interpreter at start-up only: a warm-started worker (worker/warm.py) applies it itself
PYTHONDONTWRITEBYTECODE = "PYTHONDONTWRITEBYTECODE"

# --- the etcd side ---------------------------------------------------------------------------------------------------
# gRPC's C core log level: it logs every failed TLS handshake and reconnect at INFO on stderr (etcd/__init__.py).
GRPC_VERBOSITY = "GRPC_VERBOSITY"
# etcd reads every variable with this prefix as one of its flags (ETCD_ENABLE_V2=true would turn v2 on): the
# embedded server is started without them (etcd/server.py).
ETCD_FLAG_PREFIX = "ETCD_"
