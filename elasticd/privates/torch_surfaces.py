"""Every private torch name elasticd uses, with what it is for, its check and its fallback (read with torch 2.13).

Users: the agent (``agent/supervisor.py`` overrides ``LocalElasticAgent``'s private steps), the rendezvous
(``rendezvous/``: ``DynamicRendezvousHandler``, its operation executor, its ``_delay``), the worker's hot path
(``worker/hot/``: DDP's reducer and buffer hook, c10d's abort and shrink, FSDP2's re-mesh), and the sharded snapshot
(``worker/snapshot.py``: DCP's staging). NCCL entries were read from torch's code, never exercised here (no GPU).
"""

from __future__ import annotations

from elasticd.privates.surface import (
    Check,
    Fallback,
    Process,
    Surface,
    assigned,
    callable_with,
    every,
    has,
    mentions,
    reads,
    resolve,
)

_API = "torch.distributed.elastic.agent.server.api:SimpleElasticAgent"
_LOCAL = "torch.distributed.elastic.agent.server.local_elastic_agent:LocalElasticAgent"
_RDZV = "torch.distributed.elastic.rendezvous.dynamic_rendezvous"
_HANDLER = f"{_RDZV}:DynamicRendezvousHandler"
_HANDLER_NAME = f"{_RDZV}.DynamicRendezvousHandler"
_HOLDER = f"{_RDZV}:_BackendRendezvousStateHolder"
_DDP = "torch.nn.parallel:DistributedDataParallel"
_C10D = "torch.distributed.distributed_c10d"

_SUPERVISOR = ("elasticd.agent.supervisor", "elasticd.agent.workers")
_HANDLERS = ("elasticd.rendezvous.handler", "elasticd.agent.liveness")
_REFORM = ("elasticd.worker.hot.reform",)
_BACKEND = ("elasticd.worker.hot.backend",)
_COMM_HOOK = ("elasticd.worker.hot.comm_hook",)


def _is_callable(owner: str) -> Check:
    def check() -> str | None:
        return None if callable(resolve(owner)) else "missing"

    return check


def _documented_with(owner: str, *words: str) -> Check:
    """For a compiled function (no Python source): its docstring still names each of ``words``."""

    def check() -> str | None:
        doc = getattr(resolve(owner), "__doc__", None) or ""
        absent = [w for w in words if w not in doc]
        return None if not absent else f"its docstring no longer names {', '.join(absent)}"

    return check


def _shrink_group() -> str | None:
    if not isinstance(resolve(f"{_C10D}:SHRINK_ABORT"), int):
        return "SHRINK_ABORT is missing"
    check = callable_with("torch.distributed:shrink_group", "ranks_to_exclude", "group", "shrink_flags", "pg_options")
    return check()


def _backend_shrinking() -> str | None:
    backend = resolve("torch._C._distributed_c10d:Backend")
    if not isinstance(getattr(backend, "supports_shrinking", None), property):
        return "Backend.supports_shrinking is missing"
    return _is_callable("torch.distributed:ProcessGroup._get_backend")()


def _agent(name: str, use: str, check: Check) -> Surface:
    return Surface(name, _SUPERVISOR, use, check, Fallback.REFUSE_TO_START, Process.DAEMON)


def _handler(name: str, use: str, check: Check, used_by: tuple[str, ...] = _HANDLERS) -> Surface:
    return Surface(name, used_by, use, check, Fallback.REFUSE_TO_START, Process.DAEMON)


def _hot(name: str, used_by: tuple[str, ...], use: str, check: Check, backend: str | None = None) -> Surface:
    return Surface(name, used_by, use, check, Fallback.COLD_RECOVERY, Process.WORKER, backend)


_AGENT = (
    _agent(
        "torch.distributed.elastic.agent.server.api.SimpleElasticAgent._worker_group",
        "the worker group the decision loop observes, restarts and stops",
        assigned(f"{_API}.__init__", "_worker_group"),
    ),
    _agent(
        "torch.distributed.elastic.agent.server.api.SimpleElasticAgent._remaining_restarts",
        "--max-restarts left, counted down by our loop as torch's own _invoke_run would",
        mentions(f"{_API}.__init__", "self._remaining_restarts = self._worker_group.spec.max_restarts"),
    ),
    _agent(
        "torch.distributed.elastic.agent.server.local_elastic_agent.LocalElasticAgent._pcontext",
        "the workers' process context: their pids to signal, None for a spare",
        every(assigned(f"{_LOCAL}.__init__", "_pcontext"), assigned(f"{_LOCAL}._start_workers", "_pcontext")),
    ),
    _agent(
        "torch.distributed.elastic.agent.server.api.SimpleElasticAgent._invoke_run",
        "replaced by our decision loop (agent/controller.py); torch's run() calls it",
        every(callable_with(f"{_API}._invoke_run", "self", "role"), reads(f"{_API}.run", "_invoke_run")),
    ),
    _agent(
        "torch.distributed.elastic.agent.server.api.SimpleElasticAgent._rendezvous",
        "overridden: node ids, the lineage token and a lost round around torch's rendezvous",
        every(
            callable_with(f"{_API}._rendezvous", "self", "worker_group"),
            reads(f"{_API}._initialize_workers", "_rendezvous"),
        ),
    ),
    _agent(
        "torch.distributed.elastic.agent.server.api.SimpleElasticAgent._assign_worker_ranks",
        "overridden: ranks among the training nodes only, spares left out",
        every(
            callable_with(f"{_API}._assign_worker_ranks", "self", "store", "group_rank", "group_world_size", "spec"),
            reads(f"{_API}._rendezvous", "_assign_worker_ranks"),
        ),
    ),
    _agent(
        "torch.distributed.elastic.agent.server.local_elastic_agent.LocalElasticAgent._monitor_workers",
        "overridden and called: the worker group's state each loop step",
        callable_with(f"{_LOCAL}._monitor_workers", "self", "worker_group"),
    ),
    _agent(
        "torch.distributed.elastic.agent.server.local_elastic_agent.LocalElasticAgent._start_workers",
        "overridden: a spare starts no workers",
        callable_with(f"{_LOCAL}._start_workers", "self", "worker_group"),
    ),
    _agent(
        "torch.distributed.elastic.agent.server.local_elastic_agent.LocalElasticAgent._stop_workers",
        "stops the workers before a restart, a drain or an exit",
        callable_with(f"{_LOCAL}._stop_workers", "self", "worker_group"),
    ),
    _agent(
        "torch.distributed.elastic.agent.server.api.SimpleElasticAgent._exit_barrier",
        "overridden: the barrier at a finished run, bounded",
        callable_with(f"{_API}._exit_barrier", "self"),
    ),
    _agent(
        "torch.distributed.elastic.agent.server.api.SimpleElasticAgent._initialize_workers",
        "the first rendezvous and start of the workers",
        callable_with(f"{_API}._initialize_workers", "self", "worker_group"),
    ),
    _agent(
        "torch.distributed.elastic.agent.server.api.SimpleElasticAgent._restart_workers",
        "a restart decided by the policy: stop, rendezvous, start",
        callable_with(f"{_API}._restart_workers", "self", "worker_group"),
    ),
)

_RENDEZVOUS = (
    _handler(
        f"{_HANDLER_NAME}._state_holder",
        "the shared state: the round, its participants and heartbeats",
        assigned(f"{_HANDLER}.__init__", "_state_holder"),
    ),
    _handler(
        f"{_HANDLER_NAME}._op_executor",
        "replaced by quorum.ReformingExecutor; leave() runs its own operation through it",
        every(
            assigned(f"{_HANDLER}.__init__", "_op_executor"),
            reads(f"{_HANDLER}.next_rendezvous", "_op_executor"),
        ),
        ("elasticd.rendezvous.handler",),
    ),
    _handler(
        f"{_HANDLER_NAME}._this_node",
        "this node as the state names it (its address, the member name)",
        assigned(f"{_HANDLER}.__init__", "_this_node"),
    ),
    _handler(
        f"{_HANDLER_NAME}._settings",
        "the keep-alive interval and the last-call timeout",
        assigned(f"{_HANDLER}.__init__", "_settings"),
    ),
    _handler(
        f"{_HANDLER_NAME}._heartbeat_lock",
        "held while reading the state, as torch's own readers do",
        assigned(f"{_HANDLER}.__init__", "_heartbeat_lock"),
    ),
    _handler(
        f"{_HANDLER_NAME}._store",
        "the etcd store, to hand each round a store bounded by its members' liveness",
        assigned(f"{_HANDLER}.__init__", "_store"),
        ("elasticd.rendezvous.handler",),
    ),
    _handler(
        f"{_HANDLER_NAME}._get_store",
        "overridden: each round's store, whose waits end when a member is lost",
        every(
            callable_with(f"{_HANDLER}._get_store", "self"),
            reads(f"{_HANDLER}.next_rendezvous", "_get_store"),
        ),
        ("elasticd.rendezvous.handler",),
    ),
    _handler(
        f"{_HANDLER_NAME}._wrap_store",
        "torch's per-round prefix over that store",
        callable_with(f"{_HANDLER}._wrap_store", "self", "store"),
        ("elasticd.rendezvous.handler",),
    ),
    _handler(
        f"{_HANDLER_NAME}._get_deadline",
        "the deadline of our leave operation",
        callable_with(f"{_HANDLER}._get_deadline", "self", "timeout"),
        ("elasticd.rendezvous.handler",),
    ),
    _handler(
        f"{_HANDLER_NAME}._stop_heartbeats",
        "leave() stops the keep-alive before leaving",
        callable_with(f"{_HANDLER}._stop_heartbeats", "self"),
        ("elasticd.rendezvous.handler",),
    ),
    _handler(
        f"{_RDZV}._BackendRendezvousStateHolder",
        "the holder type whose state we sync and read",
        every(callable_with(f"{_HOLDER}.sync", "self"), has(_HOLDER, "state")),
        ("elasticd.rendezvous.handler", "elasticd.rendezvous.wakeup"),
    ),
    _handler(
        f"{_RDZV}._BackendRendezvousStateHolder._last_sync_time",
        "the age of the cached state (heartbeat ages); set to -1 to bypass the 1 s cache after a wake-up",
        every(reads(f"{_HOLDER}.sync", "_last_sync_time"), assigned(f"{_HOLDER}.sync", "_last_sync_time")),
        ("elasticd.agent.liveness", "elasticd.rendezvous.wakeup"),
    ),
    _handler(
        f"{_RDZV}._RendezvousState",
        "the round, participants, wait and redundancy lists, heartbeats, deadline of the shared state",
        every(
            *(
                assigned(f"{_RDZV}:_RendezvousState.__init__", field)
                for field in (
                    "round",
                    "complete",
                    "deadline",
                    "closed",
                    "participants",
                    "wait_list",
                    "redundancy_list",
                    "last_heartbeats",
                )
            )
        ),
        ("elasticd.rendezvous.wakeup", "elasticd.rendezvous.quorum", "elasticd.agent.liveness"),
    ),
    _handler(
        f"{_RDZV}._NodeDesc",
        "a member of the state: its address, and its name for lost members",
        has(f"{_RDZV}:_NodeDesc", "addr", "pid", "local_id"),
        ("elasticd.rendezvous.wakeup", "elasticd.rendezvous.handler"),
    ),
    _handler(
        f"{_RDZV}._RendezvousContext",
        "what an operation sees (node, state, settings): our leave and early-close operations",
        callable_with(f"{_RDZV}:_RendezvousContext.__init__", "self", "node", "state", "settings"),
        ("elasticd.rendezvous.handler", "elasticd.rendezvous.quorum"),
    ),
    _handler(
        f"{_RDZV}._Action",
        "what an operation returns: leave the lists, sync, close the round early",
        has(
            f"{_RDZV}:_Action",
            "REMOVE_FROM_PARTICIPANTS",
            "REMOVE_FROM_WAIT_LIST",
            "REMOVE_FROM_REDUNDANCY_LIST",
            "FINISH",
            "ERROR_TIMEOUT",
            "SYNC",
            "MARK_RENDEZVOUS_COMPLETE",
        ),
        ("elasticd.rendezvous.handler", "elasticd.rendezvous.quorum"),
    ),
    _handler(
        f"{_RDZV}._RendezvousOpExecutor",
        "the base of quorum.ReformingExecutor, which wraps torch's executor",
        callable_with(f"{_RDZV}:_RendezvousOpExecutor.run", "self", "state_handler", "deadline", "update_deadline"),
        ("elasticd.rendezvous.quorum",),
    ),
    _handler(
        f"{_RDZV}._RendezvousJoinOp",
        "the join operation quorum.py wraps to close a re-forming round once every live node is in",
        callable_with(f"{_RDZV}:_RendezvousJoinOp.__call__", "self", "ctx", "deadline"),
        ("elasticd.rendezvous.quorum",),
    ),
    Surface(
        f"{_RDZV}._BackendRendezvousStateHolder._sanitize",
        ("elasticd.rendezvous.lapsed",),
        "extended on our holder only: after torch's heartbeat expiry, drop a late node whose liveness lease is gone"
        " (run on every read of the state, as torch's is)",
        every(callable_with(f"{_HOLDER}._sanitize", "self"), mentions(f"{_HOLDER}.sync", "self._sanitize()")),
        Fallback.TORCH_TIMING,
        Process.DAEMON,
    ),
    Surface(
        f"{_RDZV}._remove_participant_epilogue",
        ("elasticd.rendezvous.lapsed",),
        "what torch does after removing a participant (the round advances once none is left), for a lapsed node",
        callable_with(f"{_RDZV}:_remove_participant_epilogue", "state", "settings"),
        Fallback.TORCH_TIMING,
        Process.DAEMON,
    ),
    Surface(
        f"{_RDZV}._delay",
        ("elasticd.rendezvous.wakeup",),
        "replaced for the whole process: the 1 s wait of torch's executor (_DistributedRendezvousOpExecutor.run),"
        " in our handler's thread, ends on an etcd change",
        every(
            callable_with(f"{_RDZV}:_delay", "seconds"),
            mentions(f"{_RDZV}:_DistributedRendezvousOpExecutor.run", "_delay(seconds=1)"),
        ),
        Fallback.TORCH_TIMING,
        Process.DAEMON,
    ),
    Surface(
        f"{_RDZV}.get_method_name",
        ("elasticd.rendezvous.event_names",),
        "replaced for the whole process: torch names each rendezvous event it records with it (two inspect.stack()"
        " walks a call); ours reads the caller's frame",
        every(
            callable_with(f"{_RDZV}:get_method_name", "depth"),
            mentions(f"{_RDZV}:_BackendRendezvousStateHolder._record", "get_method_name()"),
            mentions(f"{_RDZV}:_DistributedRendezvousOpExecutor._record", "get_method_name()"),
            mentions(f"{_RDZV}:DynamicRendezvousHandler._record", "get_method_name()"),
        ),
        Fallback.TORCH_EVENT_NAMES,
        Process.DAEMON,
    ),
)

_HOT_PATH = (
    _hot(
        "torch.nn.parallel.DistributedDataParallel._update_process_group",
        _REFORM,
        "moves the prepared model to the new group and resets its reducer",
        every(
            callable_with(f"{_DDP}._update_process_group", "self", "new_process_group"),
            mentions(
                f"{_DDP}._update_process_group", "self.reducer._reset_state()", "self.reducer._update_process_group("
            ),
        ),
    ),
    _hot(
        "torch.nn.parallel.DistributedDataParallel._register_buffer_comm_hook",
        _COMM_HOOK,
        "rank 0's buffers broadcast before each forward by the hot path (a peer lost fails the step, not the forward)",
        callable_with(f"{_DDP}._register_buffer_comm_hook", "self", "state", "hook", "comm_hook_location"),
    ),
    _hot(
        "torch.nn.parallel.distributed._BufferCommHookLocation",
        _COMM_HOOK,
        "PRE_FORWARD: the buffer hook runs where DDP's own broadcast would",
        has("torch.nn.parallel.distributed:_BufferCommHookLocation", "PRE_FORWARD"),
    ),
    _hot(
        "torch.nn.parallel.DistributedDataParallel._has_rebuilt_buckets",
        _REFORM,
        "set after the bucket re-sync, as DDP's own forward pass would",
        assigned(f"{_DDP}.__init__", "_has_rebuilt_buckets"),
    ),
    _hot(
        "torch.distributed.Reducer._push_all_rebuilt_params",
        _REFORM,
        "bucket re-sync: every parameter counts as rebuilt, in parameter order",
        _is_callable("torch.distributed:Reducer._push_all_rebuilt_params"),
    ),
    _hot(
        "torch.distributed.Reducer._rebuild_buckets",
        _REFORM,
        "bucket re-sync: rebuilds now, broadcasting rank 0's bucket indices",
        _is_callable("torch.distributed:Reducer._rebuild_buckets"),
    ),
    _hot(
        "torch.distributed.distributed_c10d._abort_process_group",
        _BACKEND,
        "retires the old NCCL group: ncclCommAbort on its communicators, no shutdown (which could wait on a dead peer)",
        every(
            callable_with(f"{_C10D}:_abort_process_group", "group"),
            mentions(f"{_C10D}:_abort_process_group", ".abort()", "_update_default_pg(None)"),
        ),
        backend="nccl",
    ),
    _hot(
        "torch.distributed.distributed_c10d.SHRINK_ABORT",
        _BACKEND,
        "shrink_group(excluded, shrink_flags=SHRINK_ABORT) after a node loss on NCCL",
        _shrink_group,
        backend="nccl",
    ),
    _hot(
        "torch.distributed.ProcessGroup._get_backend",
        _BACKEND,
        "asks the NCCL backend whether it can shrink (supports_shrinking) and for its error",
        _backend_shrinking,
        backend="nccl",
    ),
    _hot(
        "torch._C._distributed_c10d.ErrorType",
        _BACKEND,
        "the NCCL backend's error (get_error() != SUCCESS: a communicator failed)",
        has("torch._C._distributed_c10d:ErrorType", "SUCCESS"),
        backend="nccl",
    ),
)

_DIAGNOSTICS = (
    Surface(
        "torch._C._distributed_c10d._dump_fr_trace_json",
        ("elasticd.worker.diagnostics",),
        "the flight recorder's trace for the hang evidence, collectives included",
        every(
            _is_callable("torch._C._distributed_c10d:_dump_fr_trace_json"),
            _documented_with("torch._C._distributed_c10d:_dump_fr_trace_json", "includeCollectives"),
        ),
        Fallback.NO_FLIGHT_RECORDER,
        Process.WORKER,
    ),
)

_STAGING = "torch.distributed._state_dict_utils"

# The sharded snapshot stages as DCP's own stager does (worker/snapshot.py); if these moved, saves block.
_SHARDED_SNAPSHOT = (
    Surface(
        f"{_STAGING}._create_cpu_state_dict",
        ("elasticd.worker.snapshot",),
        "host buffers shaped like a sharded state dict (DTensors keep their placements), made once and reused",
        every(
            callable_with(f"{_STAGING}:_create_cpu_state_dict", "state_dict", "pin_memory", "share_memory"),
            mentions("torch.distributed.checkpoint.staging:BlockingAsyncStager.stage", "_create_cpu_state_dict("),
        ),
        Fallback.BLOCKING_SAVES,
        Process.WORKER,
    ),
    Surface(
        f"{_STAGING}._copy_state_dict",
        ("elasticd.worker.snapshot",),
        "copies a sharded state dict's local shards into those buffers: the blocking part of an asynchronous save",
        every(
            callable_with(
                f"{_STAGING}:_copy_state_dict", "state_dict", "copy_state_dict", "non_blocking", "type_check"
            ),
            mentions("torch.distributed.checkpoint.staging:BlockingAsyncStager.stage", "_copy_state_dict("),
        ),
        Fallback.BLOCKING_SAVES,
        Process.WORKER,
    ),
)

_FSDP2 = "torch.distributed.fsdp._fully_shard"
_REMESH = ("elasticd.worker.hot.remesh",)

# Moving an FSDP2 model onto a mesh of another size in place (worker/hot/remesh.py): what fully_shard does at wrap
# time, redone per FSDP state. Not armed by any job yet (the sharded hot path is being built: issue 26).
_SHARDED_IN_PLACE = (
    Surface(
        f"{_FSDP2}._fsdp_init._init_param_group",
        _REMESH,
        "builds a state's parameter groups over a mesh from plain parameters, as fully_shard does",
        every(
            callable_with(
                f"{_FSDP2}._fsdp_init:_init_param_group",
                "state",
                "params",
                "modules",
                "mesh_info",
                "post_forward_mesh_info",
                "device",
                "shard_placement_fn",
                "mp_policy",
                "offload_policy",
                "reshard_after_forward",
            ),
            mentions(f"{_FSDP2}._fsdp_init:_init_param_group", "state._fsdp_param_groups.append("),
        ),
        Fallback.COLD_RECOVERY,
        Process.WORKER,
    ),
    Surface(
        f"{_FSDP2}._fully_shard._get_mesh_info",
        _REMESH,
        "the mesh info of a 1-D mesh, and the post-forward one of reshard_after_forward=True",
        every(
            callable_with(f"{_FSDP2}._fully_shard:_get_mesh_info", "mesh", "dp_mesh_dims"),
            _is_callable(f"{_FSDP2}._fully_shard:_get_post_forward_mesh_info"),
        ),
        Fallback.COLD_RECOVERY,
        Process.WORKER,
    ),
    Surface(
        f"{_FSDP2}._fully_shard._get_post_forward_mesh_info",
        _REMESH,
        "the post-forward mesh info of a rebuilt group that resharded after forward (reshard_after_forward=True)",
        callable_with(f"{_FSDP2}._fully_shard:_get_post_forward_mesh_info", "reshard_after_forward", "mesh_info"),
        Fallback.COLD_RECOVERY,
        Process.WORKER,
    ),
    Surface(
        f"{_FSDP2}._fsdp_state._get_module_fsdp_state",
        _REMESH,
        "each FSDP state of the model (one per fully_shard call)",
        callable_with(f"{_FSDP2}._fsdp_state:_get_module_fsdp_state", "module"),
        Fallback.COLD_RECOVERY,
        Process.WORKER,
    ),
    *(
        Surface(
            f"{_FSDP2}._fsdp_state.FSDPState.{attribute}",
            _REMESH,
            what,
            every(
                assigned(f"{_FSDP2}._fsdp_state:FSDPState.__init__", attribute),
                mentions(f"{_FSDP2}._fsdp_state:FSDPState._lazy_init", needle),
            ),
            Fallback.COLD_RECOVERY,
            Process.WORKER,
        )
        for attribute, needle, what in (
            ("_fsdp_param_groups", "state._fsdp_param_groups", "a state's parameter groups, rebuilt over the new mesh"),
            ("_is_root", "if self._is_root is not None:", "reset to None: the next forward redoes the lazy init"),
            ("_state_ctx", "self._state_ctx.all_states.append(", "a new context: the lazy init lists the states anew"),
        )
    ),
    Surface(
        f"{_FSDP2}._fsdp_param.FSDPParam._module_info",
        _REMESH,
        "the module and attribute name (and shared ones) a parameter lives at: the plain parameter goes back there",
        every(
            mentions(f"{_FSDP2}._fsdp_param:FSDPParam.__init__", "self._module_info"),
            mentions(f"{_FSDP2}._fsdp_param:FSDPParam._setattr_on_modules", "shared_modules", "shared_param_names"),
        ),
        Fallback.COLD_RECOVERY,
        Process.WORKER,
    ),
    *(
        Surface(
            f"{_FSDP2}._fsdp_param_group.FSDPParamGroup.{attribute}",
            _REMESH,
            "the old group's state-dict hook handles, removed before its modules get a rebuilt group's hooks",
            mentions(f"{_FSDP2}._fsdp_param_group:FSDPParamGroup._register_state_dict_hooks", f"self.{attribute}"),
            Fallback.COLD_RECOVERY,
            Process.WORKER,
        )
        for attribute in (
            "_module_to_pre_save_state_dict_hook_handle",
            "_module_to_pre_load_state_dict_hook_handle",
        )
    ),
    Surface(
        f"{_FSDP2}._fsdp_param.FSDPParam._post_load_hook_handle",
        _REMESH,
        "an old parameter's load_state_dict post-hook, removed with it: it would re-pad a loaded shard to the old"
        " world's size (a checkpoint loaded in place after a re-mesh)",
        mentions(f"{_FSDP2}._fsdp_param:FSDPParam.__init__", "self._post_load_hook_handle"),
        Fallback.COLD_RECOVERY,
        Process.WORKER,
    ),
)

_MP = "torch.distributed.elastic.multiprocessing.api"

_WARM_STARTS = (
    Surface(
        f"{_MP}.get_subprocess_handler",
        ("elasticd.agent.warm_start",),
        "swapped while the agent starts its workers (SubprocessContext._start calls it for each): a warm worker's"
        " handler, whose proc torch uses for pid, poll() and wait(timeout), and whose close(signal) it calls",
        every(
            reads(f"{_MP}:SubprocessContext._start", "get_subprocess_handler"),
            callable_with(
                f"{_MP}:get_subprocess_handler",
                "entrypoint",
                "args",
                "env",
                "stdout",
                "stderr",
                "local_rank_id",
                "numa_options",
            ),
            mentions(f"{_MP}:SubprocessContext._close", "handler.proc.poll()", "handler.proc.wait(", "handler.close("),
            mentions(f"{_MP}:SubprocessContext.pids", "sh.proc.pid"),
            mentions(f"{_MP}:SubprocessContext._capture_process_failures", "handler.proc.poll()"),
        ),
        Fallback.COLD_STARTS,
        Process.DAEMON,
    ),
)

TORCH: tuple[Surface, ...] = (
    *_AGENT,
    *_RENDEZVOUS,
    *_HOT_PATH,
    *_DIAGNOSTICS,
    *_WARM_STARTS,
    *_SHARDED_SNAPSHOT,
    *_SHARDED_IN_PLACE,
)
