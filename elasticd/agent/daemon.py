"""``elasticd start``: wires configuration, etcd, the registry, metrics and the agent together, and maps the outcome
to an exit code (0 finished or drained · 1 gave up · 2 usage error).

Everything started here is stopped here, in reverse order, on every path out (an ``ExitStack``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import socket
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack
from functools import partial
from types import FrameType
from typing import TYPE_CHECKING, Any

from elasticd import __version__, envvars, rundir
from elasticd.accelerate_env import default_threads, physical_cores, worker_environment
from elasticd.addresses import check_local_addr, collective_env, listen_address
from elasticd.agent import warm_start
from elasticd.agent.agreement import HangAgreement
from elasticd.agent.beats import BeatReceiver
from elasticd.agent.hangs import HangHandler
from elasticd.agent.joining import group_to_join
from elasticd.agent.node_lease import REQUEST_TIMEOUT_S as LEASE_REQUEST_TIMEOUT_S
from elasticd.agent.node_lease import NodeLease
from elasticd.agent.policy import SupervisorPolicy
from elasticd.agent.reachability import reached
from elasticd.agent.reaper import Reaper
from elasticd.agent.registry import NodeRegistry
from elasticd.agent.spares import EtcdPlanStore, Sizing
from elasticd.agent.stragglers import StragglerDetector
from elasticd.agent.watchdog import AUTO_CAP_S, Watchdog
from elasticd.board import read_slot
from elasticd.config import StartConfig
from elasticd.control import drain_requested
from elasticd.endpoints import parse_endpoints
from elasticd.errors import EXIT_GAVE_UP, EXIT_OK
from elasticd.etcd import local_runs
from elasticd.etcd.client import EtcdClient, EtcdError
from elasticd.etcd.server import EmbeddedEtcd
from elasticd.group_record import GroupToJoin, group_nodes
from elasticd.keys import RunKeys
from elasticd.layout import RunLayout, RuntimeLayout, slot_path
from elasticd.lineage import ADOPTED, CheckpointRecord, Lineage
from elasticd.liveness_probe import ProbeListener
from elasticd.logging import configure_logging, get_logger
from elasticd.membership import Membership
from elasticd.metrics import Metrics, MetricsServer
from elasticd.node_records import read_nodes
from elasticd.worker.checkpoints import CheckpointStore
from elasticd.worker.launch import worker_args

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from elasticd.agent.supervisor import DaemonHandler, ElasticdAgent

# Seconds between two looks at a group that trains in place out of this node's reach (a partition).
OUT_OF_REACH_POLL_S = 1.0


def run_daemon(cfg: StartConfig) -> int:
    """Run this node's part of the job until it finishes, drains or gives up; returns the exit code."""
    # before anything starts: an address other nodes could not reach is a usage error (exit 2), not a crash loop
    check_local_addr(cfg.local_addr, [e.host for e in cfg.etcd], cfg.max_nodes)
    configure_logging(cfg.log_format)
    log = get_logger(run_id=cfg.run_id, node_id=cfg.node_id)
    # before anything starts: a directory no save can be written to is a usage error (exit 2), not a crash loop
    run_layout = RunLayout(cfg.checkpoint_dir.resolve(), cfg.run_id)
    rundir.prepare(run_layout.dir)
    with ExitStack() as stack:
        # First in, last out: everything started below carries this pid, and the reaper kills what is left of it
        # once the daemon is gone, whether it exits or is killed (elasticd/agent/reaper.py).
        os.environ[envvars.DAEMON_PID] = str(os.getpid())
        stack.enter_context(Reaper.start(os.getpid(), cfg.log_format))
        metrics = Metrics.create(
            version=__version__, node=cfg.node_id, min_nodes=cfg.min_nodes, max_nodes=cfg.max_nodes
        )
        if cfg.metrics_port:
            server = MetricsServer(metrics.registry, cfg.metrics_addr, cfg.metrics_port)
            stack.callback(server.close)
        if cfg.embedded_etcd:
            etcd = stack.enter_context(EmbeddedEtcd(auth=True))
            # From here on the run's etcd is this one, for every client of the node. No other local user may use it
            # (rendezvous state is a pickle): this daemon and its workers log in.
            cfg = dataclasses.replace(
                cfg,
                etcd=parse_endpoints(etcd.endpoint),
                etcd_access=etcd.access,
                local_addr=cfg.local_addr or "127.0.0.1",
            )
            log.info("embedded_etcd_started", endpoint=etcd.endpoint, pid=etcd.pid, credentials=str(etcd.password_file))
            _publish_local_run(stack, cfg, etcd.endpoint, log)
        client = EtcdClient.connect(**cfg.etcd_connect_args(), on_error=lambda _exc: metrics.etcd_errors_total.inc())
        stack.callback(client.close)
        keys = RunKeys(cfg.run_id)

        # the other daemons probe this node here, on the address they reach it at (agent/reachability.py)
        advertised = cfg.local_addr or socket.getfqdn()
        listener = ProbeListener(listen_address(advertised))
        stack.callback(listener.close)
        registry = NodeRegistry(client, keys, cfg.node_id, probe=f"{advertised}:{listener.port}")
        registry.claim()
        stack.callback(registry.release)
        registry.start_keepalive()

        # a vanished node's verdict, for the hot path and for the rendezvous (a re-forming round does not wait for a
        # node whose lease is gone): this key is gone about a second after we stop.
        # On a client of its own: behind the shared client's lock, a refresh would wait out every other call's
        # deadline while etcd is away, and the lease would lapse just after etcd came back (quorum regained)
        def lease_client() -> EtcdClient:
            return client.reconnect(request_timeout_s=LEASE_REQUEST_TIMEOUT_S)

        lease = NodeLease(
            lease_client(),
            keys,
            cfg.node_id,
            on_error=lambda e: log.warning("node_lease_failed", error=e),
            reconnect=lease_client,
        )
        lease.start()
        stack.callback(lease.close)
        # torch loads only now (~4 s on a busy host): what a user waits to hear about (metrics port, etcd, a node id
        # in use) is answered in about a second. tests/integration/test_startup_imports.py keeps it that way.
        from torch.distributed.elastic.agent.server.api import WorkerSpec
        from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std

        from elasticd.privates.check import check_daemon

        check_daemon(log)  # before the modules that import torch's privates: a moved one refuses to start, exit 2
        from elasticd.agent.liveness import RoundLiveness, read_view
        from elasticd.agent.supervisor import ElasticdAgent

        _clear_previous_run(client, keys, cfg.node_id, log)
        runtime = RuntimeLayout.create()
        stack.callback(shutil.rmtree, runtime.dir, ignore_errors=True)
        board_dir = runtime.board
        _export_worker_env(cfg, runtime, run_layout, log)
        worker_starts: Callable[[], AbstractContextManager[None]] = contextlib.nullcontext
        warm: warm_start.WarmStarts | None = None
        if warm_start.enabled():  # started with the first workers, in the workers' environment (exported above)
            warm = warm_start.WarmStarts(cfg.script, log)
            worker_starts = warm.handlers

        handler = _rendezvous_handler(cfg, lease)
        spec = WorkerSpec(
            role="default",
            local_world_size=cfg.nproc_per_node,
            entrypoint=sys.executable,
            # through the launcher, so that each worker dies with this daemon (elasticd/worker/launch.py)
            args=worker_args(str(cfg.script), cfg.script_args),
            rdzv_handler=handler,
            max_restarts=cfg.max_restarts,
            monitor_interval=cfg.monitor_interval_s,
            local_addr=cfg.local_addr,
        )
        agent = ElasticdAgent(
            spec=spec,
            logs_specs=DefaultLogsSpecs(log_dir=str(runtime.torchelastic_logs), redirects=Std.NONE),
            start_method="spawn",
            run_id=cfg.run_id,
            node_id=cfg.node_id,
            metrics=metrics,
            registry=registry,
            drain_requested=lambda: drain_requested(client, keys),
            lineage=Lineage(client, keys),
            adopt=lambda: _adopt_from_disk(cfg, log),
            checkpoint_timeout_s=cfg.drain_timeout_s,
            policy=SupervisorPolicy(hang_attempts=cfg.hang_attempts),
            hangs=HangHandler(
                watchdog=Watchdog(
                    lambda local_rank: read_slot(slot_path(board_dir, local_rank)),
                    timeout_s=cfg.hang_timeout_s,
                    startup_s=cfg.startup_timeout_s,
                ),
                agreement=HangAgreement(
                    client,
                    keys,
                    cfg.node_id,
                    reach=lambda members: reached(read_nodes(client, keys), cfg.node_id, members),
                ),
                node_id=cfg.node_id,
                board_dir=board_dir,
                run=run_layout,
                metrics=metrics,
                log=lambda: agent.log,
                liveness=RoundLiveness(cfg.node_id, lambda: read_nodes(client, keys), lambda: read_view(handler)),
            ),
            stragglers=StragglerDetector(factor=cfg.straggler_factor, window_s=cfg.straggler_window_s),
            read_peers=lambda: read_nodes(client, keys),
            sizing=Sizing(
                min_nodes=cfg.min_nodes,
                max_nodes=cfg.max_nodes,
                plans=EtcdPlanStore(client, keys),
                participants=handler.participants,
                read_peers=lambda: read_nodes(client, keys),
                metrics=metrics,
                registry=registry,
            ),
            membership=Membership(client, keys),
            join_finder=(
                partial(_group_to_join, client, keys, cfg, handler.num_nodes_waiting) if cfg.recovery == "hot" else None
            ),
            announce_leaving=lease.announce_leaving if cfg.recovery == "hot" else None,
            group_nodes=lambda: group_nodes(client, keys),
            worker_starts=worker_starts,
        )
        stack.callback(BeatReceiver(str(runtime.socket), on_beat=agent.on_beat, log=log).close)
        _install_leave_signals(agent)
        log.info(
            "daemon_started",
            version=__version__,
            script=str(cfg.script),
            min_nodes=cfg.min_nodes,
            max_nodes=cfg.max_nodes,
            nproc_per_node=cfg.nproc_per_node,
            etcd=cfg.etcd_text,
            metrics_port=cfg.metrics_port,
            hang_timeout_s=cfg.hang_timeout_s or "auto",
        )
        _warm_before_joining(warm, lambda: read_nodes(client, keys), cfg.node_id, log)
        return _run_agent(agent, handler)
    return EXIT_GAVE_UP  # pragma: no cover - the with-block always returns


def _rendezvous_handler(cfg: StartConfig, lease: NodeLease) -> DaemonHandler:
    """The daemon's rendezvous: the lease rendezvous (``rendezvous/lease_handler.py``), or torch's dynamic one with
    ``ELASTICD_RENDEZVOUS=torch`` (``rendezvous/handler.py``, as torchrun with ``--rdzv-backend etcd-v3`` has it)."""
    from elasticd.rendezvous.handler import create_handler
    from elasticd.rendezvous.lease_handler import create_lease_handler

    if os.environ.get(envvars.RENDEZVOUS, "lease") == "torch":
        handler = create_handler(rendezvous_parameters(cfg))
        handler.use_liveness_lease(lease.hold)
        return handler
    return create_lease_handler(rendezvous_parameters(cfg), lease)


def _warm_before_joining(
    warm: warm_start.WarmStarts | None, peers: Callable[[], list[dict[str, Any]]], node_id: str, log: Any
) -> None:
    """A node that comes while others train imports first, then enters the rendezvous.

    Its arrival in the rendezvous stops the running workers (a cold join restarts them all, from a checkpoint taken
    for it), and the new round trains only once this node's workers have imported torch and accelerate: on a busy
    host that import was most of the running group's pause (measured: 3.6 s of a 6.3 s cold join). So the warm
    server starts now and is waited for (at most its ready timeout) while the others go on training. At a job's
    start no peer is running yet, and every node keeps the usual order (see :meth:`WarmStarts.start` for why)."""
    if warm is None:
        return
    from elasticd.agent.controller import NodeState

    try:
        running = [p for p in peers() if p.get("node_id") != node_id and p.get("state") == NodeState.RUNNING]
    except EtcdError:
        return  # etcd busy: the usual order
    if not running:
        return
    begun = time.monotonic()
    warm.start()
    usable = warm.wait_ready()
    log.info(
        "warm_before_joining", running_nodes=len(running), waited_s=round(time.monotonic() - begun, 3), usable=usable
    )


def _run_agent(agent: ElasticdAgent, handler: DaemonHandler) -> int:
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.rendezvous.api import RendezvousClosedError, RendezvousError

    from elasticd.agent.controller import NodeState

    logger = agent.log
    try:
        outcome = agent.run()
    except SignalException as exc:
        # The agent already stopped the workers. Leave the round without closing it: the others go on.
        handler.leave()
        logger.warning("stopped_by_signal", signal=exc.sigval.name)
        return 128 + int(exc.sigval)
    except RendezvousClosedError:
        if agent.run_view.drain_requested():
            # `elasticd stop` closed the run while this node was between rounds (it took the drain's checkpoint,
            # asked for by a peer, for a membership change): the run ended as asked, nothing failed here.
            logger.info("drained_between_rounds")
            return EXIT_OK
        if agent.round_state.joined_in_place:
            # this node came to join a group training in place, and the run finished before it was admitted
            logger.info("finished_while_joining")
            return EXIT_OK
        if agent.round_state.round is not None:
            # this node trained in the run, then was cut off or frozen while the others completed it: nothing is left
            # to train, and a Kubernetes Job must not count that as a failed pod
            logger.info(
                "run_finished_without_this_node",
                round=agent.round_state.round,
                message="the others finished the run while this node was away: nothing left to train",
            )
            return EXIT_OK
        logger.error(
            "gave_up",
            message="the rendezvous of this run is closed (finished or stopped); use a new --run-id",
        )
        return EXIT_GAVE_UP
    except RendezvousError as exc:
        handler.leave()
        logger.error("gave_up", message=f"rendezvous failed: {type(exc).__name__}: {exc}")
        return EXIT_GAVE_UP
    if outcome.leaves:
        handler.leave()  # this node alone leaves (gave up, or SIGTERM): the others go on in a new round
    else:
        handler.shutdown()  # finished or drained: the run is over for every node, so close the rendezvous
    if outcome.node_state is NodeState.FAILED:
        logger.error("exit", code=outcome.exit_code, message=outcome.message)
        return outcome.exit_code
    drained = outcome.node_state is NodeState.DRAINING
    logger.info("exit", code=EXIT_OK, drained=drained, left=outcome.leaves)
    return EXIT_OK


def _publish_local_run(stack: ExitStack, cfg: StartConfig, endpoint: str, log: Any) -> None:
    """Where ``elasticd status``/``stop`` without ``--etcd`` find this run's embedded etcd, for this user on this
    machine (``etcd/local_runs.py``), withdrawn at exit; the exact command is logged too."""
    access = cfg.etcd_access
    command = f"elasticd status --etcd {endpoint} --run-id {cfg.run_id}"
    command += f" --etcd-user {access.user} --etcd-password-file {access.password_file}"
    try:
        record = local_runs.publish(
            local_runs.LocalRun(cfg.run_id, endpoint, access.user, access.password_file, os.getpid(), cfg.node_id)
        )
    except (OSError, local_runs.LocalRunsError) as exc:
        log.warning("local_run_not_published", error=str(exc), status_command=command)
        return
    stack.callback(local_runs.withdraw, record)
    log.info("local_run_published", path=str(record), status_command=command)


def _clear_previous_run(client: EtcdClient, keys: RunKeys, node_id: str, log: Any) -> None:
    """Clear what a finished run of the same id left in etcd, only when no other node of it is alive."""
    from elasticd.rendezvous.reset import clear_finished_run

    alone = not [n for n in read_nodes(client, keys) if n.get("node_id") != node_id]
    if alone and (removed := clear_finished_run(client, keys)):
        log.info("previous_run_cleared", removed=removed)


def _group_to_join(
    client: EtcdClient, keys: RunKeys, cfg: StartConfig, nodes_waiting: Callable[[], int]
) -> GroupToJoin | None:
    """Hot recovery: the group training in place that this node's next round joins, if any; while that group is out
    of this node's reach (a partition), wait here rather than enter the rendezvous (``agent/joining.py``)."""
    said: list[bool] = []

    def wait(group: GroupToJoin) -> None:
        if not said:
            said.append(True)
            get_logger(run_id=cfg.run_id, node_id=cfg.node_id).warning(
                "group_out_of_reach",
                group_nodes=list(group.nodes),
                message="the group trains in place but none of its workers answers from here: waiting to reach it",
            )
        time.sleep(OUT_OF_REACH_POLL_S)

    return group_to_join(client, keys, cfg.node_id, max_nodes=cfg.max_nodes, nodes_waiting=nodes_waiting(), wait=wait)


def _adopt_from_disk(cfg: StartConfig, log: Any) -> CheckpointRecord | None:
    """A fresh lineage (a new run id, or an etcd that came back empty) starts from the newest checkpoint on disk
    that verifies; committed ``step-N`` directories only ever come from recorded commits."""
    store = CheckpointStore(cfg.checkpoint_dir.resolve(), cfg.run_id)
    found = store.latest_loadable(
        on_bad=lambda cp, reason: log.warning("checkpoint_unusable", path=str(cp.path), reason=reason)
    )
    if found is None:
        return None
    log.info("lineage_adopted", step=found.step, path=str(found.path))
    return store.record_for(found, ADOPTED)


def _install_leave_signals(agent: ElasticdAgent) -> None:
    """SIGTERM or SIGINT: leave cleanly (checkpoint, stop the workers, leave the round, exit 0).

    torch's agent turns these signals into an immediate stop; we keep that for SIGHUP and SIGQUIT, for a second
    signal, and for a signal that arrives while no workers run (waiting for a round, starting workers), when there
    is nothing to save and waiting could outlast a Kubernetes grace period.
    """
    from torch.distributed.elastic.multiprocessing import SignalException

    os.environ[envvars.TORCHELASTIC_SIGNALS_TO_HANDLE] = "SIGHUP,SIGQUIT"
    signals = agent.signals

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        if signals.leave_requested or not signals.graceful:
            raise SignalException(f"elasticd got {signal.Signals(signum).name}", sigval=signal.Signals(signum))
        signals.leave_requested = True

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)


def _export_worker_env(cfg: StartConfig, runtime: RuntimeLayout, run: RunLayout, log: Any) -> None:
    """Workers inherit the daemon's environment (torch copies ``os.environ``); this is what they learn from us,
    and from accelerate's config file (what ``accelerate launch`` would set)."""
    has_gpu = _has_gpu()
    accelerate = worker_environment(
        cfg.accelerate_config, nproc_per_node=cfg.nproc_per_node, max_nodes=cfg.max_nodes, has_gpu=has_gpu
    )
    if accelerate.path is not None:
        log.info("accelerate_config", path=str(accelerate.path), env=dict(accelerate.env))
    for line in accelerate.overridden:
        log.info("accelerate_setting_overridden", setting=line)
    os.environ.update(accelerate.env)
    os.environ.update(cfg.worker_env())
    if cfg.local_addr is not None:
        # gloo and NCCL bind the host name's address unless told an interface (elasticd/addresses.py)
        chosen = collective_env(cfg.local_addr, os.environ)
        os.environ.update(chosen.env)
        log.info("collective_interface", **chosen.fields)
    os.environ.update(
        {
            envvars.SOCKET: str(runtime.socket),
            envvars.BOARD: str(runtime.board),
            **cfg.etcd_access.worker_env(),
        }
    )
    for name, value in _torch_diagnostics_env(cfg, run).items():
        os.environ.setdefault(name, value)  # the user's own settings win
    # a worker that dies on a signal (SIGSEGV in native code) prints every thread's Python stack to its stderr
    os.environ.setdefault(envvars.PYTHONFAULTHANDLER, "1")
    if envvars.OMP_NUM_THREADS not in os.environ:
        cores = physical_cores()
        threads = default_threads(cfg.nproc_per_node, has_gpu=has_gpu, cpu_cores=cores)
        if threads is not None:
            os.environ[envvars.OMP_NUM_THREADS] = str(threads)
            log.info(
                "worker_threads",
                omp_num_threads=threads,
                message=f"{envvars.OMP_NUM_THREADS}={threads} per worker ({cores} physical cores, "
                f"{cfg.nproc_per_node} workers); set {envvars.OMP_NUM_THREADS} or accelerate's "
                "num_cpu_threads_per_process to choose",
            )
    if not has_gpu:
        # accelerate on a host without GPUs ignores torchrun's WORLD_SIZE unless told to use the CPU, and each
        # worker then trains alone without a word (accelerate's state.py, _prepare_backend).
        os.environ.setdefault(envvars.ACCELERATE_USE_CPU, "true")
    if cfg.recovery == "hot":
        from elasticd.worker.hot.backend import worker_env

        os.environ.update(worker_env(os.environ))  # NCCL: raise and keep the process on a communicator error


def rendezvous_parameters(cfg: StartConfig) -> RendezvousParameters:
    """torch's rendezvous parameters for this node: its etcd reached as the daemon reaches it (the same endpoints,
    connect timeout, TLS files and credentials), the elastic range, and the ``--rdzv-conf`` timings."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    return RendezvousParameters(
        backend="etcd-v3",
        endpoint=cfg.etcd_text,
        run_id=cfg.run_id,
        min_nodes=cfg.min_nodes,
        max_nodes=cfg.max_nodes,
        local_addr=cfg.local_addr,
        connect_timeout=cfg.etcd_connect_timeout_s,
        **dict(cfg.rdzv_conf),
        **cfg.etcd_access.rdzv_conf(),
    )


def _torch_diagnostics_env(cfg: StartConfig, run: RunLayout) -> dict[str, str]:
    """torch's collective diagnostics, set consistent with the timeout hierarchy (docs/architecture.md).

    The flight recorder keeps the last collectives of every process group (gloo and NCCL) for the hang evidence.
    On NCCL, torch's own watchdog comes second: its heartbeat timeout stays above our hang timeout plus the time to
    gather evidence, so elasticd diagnoses and restarts first, and torch dumps and aborts only if we could not.
    """
    hang_s = cfg.hang_timeout_s if cfg.hang_timeout_s is not None else AUTO_CAP_S
    return {
        envvars.TORCH_FR_BUFFER_SIZE: "2000",
        envvars.TORCH_NCCL_DUMP_ON_TIMEOUT: "1",
        envvars.TORCH_FR_DUMP_TEMP_FILE: run.nccl_trace_prefix,
        envvars.TORCH_NCCL_ENABLE_MONITORING: "1",
        envvars.TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC: str(int(max(480, 2 * hang_s + 60))),
    }


def _has_gpu() -> bool:
    import torch

    return bool(torch.cuda.is_available())
