"""The worker library's side of recovery in place: when to arm it, what a recovery changes in the run, how it ends.

:meth:`HotPath.arm` (from ``run.resume``) arms :class:`~elasticd.worker.hot.session.HotSession` when the daemon asks
for ``--recovery hot`` and the setup is one it supports; otherwise it says why at start, once, and the run keeps
today's cold path. At each optimizer-step boundary :meth:`HotPath.recovered_from_failure` turns a failed step into a
recovery in place (the run continues at the new size from the same sample) or, when the hot path cannot go on, ends
the worker for the daemons' cold restart from the newest committed checkpoint. The first completed step at the new
size reports the recovery to the daemon (beat ``reconfigured``: metrics, events, ``elasticd status``).
"""

from __future__ import annotations

import os
import sys
import time
from typing import TYPE_CHECKING, Any, NoReturn

from elasticd.board import Phase
from elasticd.errors import ElasticdError
from elasticd.etcd.access import EtcdAccess
from elasticd.etcd.client import EtcdClient, EtcdError
from elasticd.etcd.endpoints import parse_endpoints
from elasticd.keys import RunKeys
from elasticd.worker.hot.errors import HotRecoveryError
from elasticd.worker.hot.session import HotFallback, HotSession, Identity, Recovered, advertised_host, is_gloo_world

if TYPE_CHECKING:
    from elasticd.worker.run import Run

# The exit code of a worker whose hot path gave up: a failure for the agent (it restarts the group cold).
EXIT_HOT_FALLBACK = 1


class HotPath:
    def __init__(self, run: Run, session: HotSession) -> None:
        self.run = run
        self.session = session
        self._report: dict[str, Any] | None = None  # the recovery to report at the first step after it

    @classmethod
    def arm(cls, run: Run, model: Any, optimizer: Any, scheduler: Any) -> HotPath | None:
        s = run.settings
        if s.recovery != "hot" or not (s.etcd and s.fence_token and s.node_id):
            return None  # cold by choice, or no daemon
        if run.world_size < 2:
            run.log.info("hot_recovery_off", reason="a world of one worker has nobody to re-form with")
            return None
        if not is_gloo_world():
            return cls._unsupported(run, "a process group other than gloo's default one (NCCL: not yet wired)")
        try:
            client = EtcdClient.connect(
                parse_endpoints(s.etcd), connect_timeout_s=10.0, **EtcdAccess.from_worker_env().connect_kwargs()
            )
        except (EtcdError, ElasticdError) as exc:
            return cls._unsupported(run, f"etcd unreachable from the worker: {exc}")
        identity = Identity(s.fence_token, run.rank, s.node_id, s.round, (s.min_nodes or 1) * s.nproc_per_node)
        try:
            session = HotSession(
                run.accelerator,
                model,
                optimizer,
                scheduler,
                client=client,
                keys=RunKeys(s.run_id),
                identity=identity,
                fence=s.fence_token,
            )
            session.start(advertised_host(s.local_addr))
        except HotRecoveryError as exc:  # an unsupported setup, or torch/accelerate moved a surface we rely on
            client.close()
            return cls._unsupported(run, str(exc))
        run.coordinator.on_failure = session.hook.abort
        run.log.info("hot_recovery_armed", member=identity.member, epoch=session.epoch)
        return cls(run, session)

    @staticmethod
    def _unsupported(run: Run, why: str) -> None:
        run.log.warning("hot_recovery_unsupported", reason=why, fallback="cold restarts from checkpoints")
        run.beats.send("hot_fallback", reason="unsupported", message=why)
        return None

    def recovered_from_failure(self) -> bool:
        """At an optimizer-step boundary: False when the step succeeded; True after a recovery in place."""
        failure = self.session.take_failure()
        if failure is None:
            return False
        run = self.run
        run.log.warning("step_failed", step=run.state.step + 1, reason=failure.reason, epoch=self.session.epoch)
        run.slot.set_phase(Phase.LOADING)  # the hang watchdog allows the startup timeout for what follows
        try:
            recovered = self.session.recover(failure, run.state, run.plan_for)
        except HotFallback as exc:
            self._fall_back(exc.reason, str(exc))
        self._adopt(recovered)
        return True

    def _adopt(self, recovered: Recovered) -> None:
        run = self.run
        run.regrouped(recovered.rank, recovered.world_size, recovered.state, recovered.plan, recovered.epoch.token)
        run.slot.set_phase(Phase.TRAINING)
        self._report = {
            "reason": recovered.epoch.reason,
            "epoch": recovered.epoch.number,
            "world_size": recovered.world_size,
            "nodes": max(1, recovered.world_size // max(1, run.settings.nproc_per_node)),
            "heal_bytes": recovered.heal_bytes,
            "lost_steps": 0,
            "token": recovered.epoch.token,
            "lost_nodes": list(recovered.lost_nodes),
            "detected_at": recovered.detected_at,
        }
        run.log.warning(
            "regrouped",
            epoch=recovered.epoch.number,
            rank=recovered.rank,
            world_size=recovered.world_size,
            step=recovered.state.step,
            heal_bytes=recovered.heal_bytes,
        )

    def stepped(self) -> None:
        """After every completed optimizer step: the first one at a new size reports the recovery."""
        if self._report is None:
            return
        report, self._report = self._report, None
        seconds = time.monotonic() - float(report.pop("detected_at"))
        self.run.beats.send("reconfigured", seconds=round(seconds, 4), **report)
        self.run.log.info("reconfigured", seconds=round(seconds, 4), **report)

    def _fall_back(self, reason: str, message: str) -> NoReturn:
        run = self.run
        run.log.error("hot_fallback", reason=reason, message=message)
        run.beats.send("hot_fallback", reason=reason, message=message)
        run.saver.wait()  # this rank's own write and commit: nothing sealed is lost
        sys.stdout.flush()
        sys.stderr.flush()
        # Not SystemExit: interpreter teardown would drop the abandoned gloo group, whose destructor waits out a
        # pending collective for the group's timeout (minutes). The daemon sees a failed worker and restarts cold.
        os._exit(EXIT_HOT_FALLBACK)

    def close(self) -> None:
        self.session.close()
