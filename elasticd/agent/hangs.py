"""From a silent worker to an agreed diagnosis: detect, gather evidence, confirm, agree, write it down.

The supervisor loop calls :meth:`HangHandler.check` every monitor interval (a read of the board) and
:meth:`HangHandler.peer_claim` with its etcd polls. When either fires, :meth:`HangHandler.handle`:

1. logs ``hang_detected`` and gathers this node's evidence (stacks, flight recorder, process states) into a
   scratch directory; that takes up to a second, which doubles as a **confirmation**: if the silent ranks made
   progress meanwhile it was a slow step, not a hang (``hang_cleared``, nothing else happens);
2. gives up (``hang_abandoned``) as soon as a local worker has **exited**: its silence was a failure on its way
   (a collective that failed when a peer died, then seconds of interpreter teardown), which torch's monitor
   reports at its next poll as restart reason ``failure``. Nothing is written to the diagnostics directory;
3. checks that this node still belongs to the run's current round: a node that was stopped and evicted wakes up
   to silent workers in a round the others have left. Its late report is not a hang of the run (``hang_stale``):
   it restarts its workers to rejoin, with no diagnosis and no repeat counted;
4. claims the hang for the round, moves the evidence into the hang's directory
   ``<checkpoint-dir>/<run-id>/diagnostics/<UTC time>-hang/``, reports it, and waits for the agreed summary
   (``agreement.py``), never for a member whose daemon is gone or frozen (``liveness.py``); the owner writes
   ``summary.json``;
5. returns a :class:`~elasticd.agent.policy.HangReport` for the policy (restart, or stop after repeated hangs).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from enum import Enum
from pathlib import Path
from typing import Any, Protocol

from elasticd.agent.agreement import HangAgreement
from elasticd.agent.diagnosis import diagnose
from elasticd.agent.evidence import RankEvidence, collect, process_exited, process_state
from elasticd.agent.policy import HangReport
from elasticd.agent.watchdog import Suspicion, Watchdog
from elasticd.board import Phase
from elasticd.etcd.client import EtcdError
from elasticd.layout import HANG_SCRATCH_PREFIX, HANG_SUMMARY, RunLayout, hang_name, node_evidence_dir, slot_path
from elasticd.metrics import Metrics

# A suspicion stands only if the silent ranks stay silent for this share of their allowance after it fired (bounded
# below by the evidence gathering itself and above by CONFIRM_MAX_S): a slow step on a starved machine clears itself.
CONFIRM_SHARE = 0.5
CONFIRM_MAX_S = 2.0
# Hangs are agreed per round and membership epoch (hot recovery re-forms the group in place, within one round): the
# agreement's scope is round * EPOCH_SPAN + epoch.
EPOCH_SPAN = 1_000_000


class Liveness(Protocol):
    """Who of a round is still there (``liveness.RoundLiveness``)."""

    def lost(self, round_: int, members: Sequence[str], *, rendezvous: bool = True) -> dict[str, str]: ...

    def evicted(self, round_: int) -> str | None: ...


class _Confirmation(Enum):
    CONFIRMED = "confirmed"
    CLEARED = "cleared"  # the silent ranks made progress: a slow step
    EXITED = "exited"  # a local worker exited: a failure, not a hang


class HangHandler:
    def __init__(
        self,
        *,
        watchdog: Watchdog,
        agreement: HangAgreement | None,
        node_id: str,
        board_dir: Path,
        run: RunLayout,
        metrics: Metrics,
        log: Callable[[], Any],
        liveness: Liveness | None = None,
        clock: Callable[[], float] = time.monotonic,
        exited: Callable[[int], bool] = process_exited,
    ) -> None:
        self.watchdog = watchdog
        self._liveness = liveness
        self._exited = exited
        self._agreement = agreement
        self._node = node_id
        self._board_dir = board_dir
        self._run = run
        self._metrics = metrics
        self._log = log
        self._clock = clock
        self._local_last = (-1, 0)  # (step, hangs in a row there) when etcd cannot count them

    def reset(self, local_ranks: tuple[int, ...], started_at: float) -> None:
        """Workers are about to start: forget the previous generation's slots so none is read as this one's."""
        for rank in local_ranks:
            slot_path(self._board_dir, rank).unlink(missing_ok=True)
        self.watchdog.reset(local_ranks, started_at)

    def forget_rounds_before(self, round_: int) -> None:
        if self._agreement is not None:
            self._agreement.forget_rounds_before(round_ * EPOCH_SPAN)

    def check(self) -> Suspicion | None:
        suspicion = self.watchdog.check(self._clock())
        timeout = self.watchdog.timeout_s
        if timeout is not None:
            self._metrics.hang_timeout_seconds.set(timeout)
        return suspicion

    def exiting(self) -> bool:
        """Whether a local worker is on its way out (an exception escaped its script), within its exit allowance:
        a failure that torch's monitor is about to report, which no planned change should pre-empt."""
        now = self._clock()
        for slot in self.watchdog.slots().values():
            if slot is not None and slot.phase is Phase.EXITING:
                allowance = self.watchdog.allowance(slot)
                if allowance is not None and now - slot.progress_t <= allowance:
                    return True
        return False

    def peer_claim(self, round_: int, epoch: int = 0) -> str | None:
        """The name of a hang another node claimed in ``round_``'s membership ``epoch`` (hot recovery; else 0)."""
        if self._agreement is None:
            return None
        return self._agreement.claimed(_scope(round_, epoch))

    def handle(
        self,
        *,
        round_: int,
        members: list[str],
        pids: dict[int, int],
        ranks: dict[int, int],
        can_dump: set[int],
        started_at: float,
        suspicion: Suspicion | None,
        epoch: int = 0,
        in_place: bool = False,
    ) -> HangReport | None:
        """Confirm, gather evidence and agree on a hang in ``round_``'s membership ``epoch``. ``in_place``: the
        group re-formed in place since its round began, so the rendezvous no longer says who is in it (members come
        from the epoch, liveness from the registry alone, and "evicted from the round" means nothing)."""
        log = self._log()
        fired_at = self._clock()
        step = suspicion.step if suspicion is not None else None
        if suspicion is not None:
            log.warning(
                "hang_detected",
                timeout_s=round(suspicion.allowance_s, 3),
                silent_s=round(suspicion.silent_s, 3),
                step=suspicion.step,
                ranks=[ranks.get(r, r) for r in suspicion.local_ranks],
            )

        # a worker still exiting after its exit allowance is stuck in its exit: that one is a hang after all
        overdue = {
            r
            for r, slot in self.watchdog.slots().items()
            if slot is not None
            and slot.phase is Phase.EXITING
            and fired_at - slot.progress_t > (self.watchdog.allowance(slot) or 0.0)
        }

        def exited() -> list[int]:
            """Global ranks of the local workers that have exited, or are exiting (an uncaught exception)."""
            slots = self.watchdog.slots()
            return [
                ranks.get(r, r)
                for r, pid in sorted(pids.items())
                if self._exited(pid)
                or (r not in overdue and (slot := slots.get(r)) is not None and slot.phase is Phase.EXITING)
            ]

        if gone := exited():
            self._abandon(log, gone, step)
            return None
        scratch: Path | None = None
        evidence: list[RankEvidence] = []
        try:
            scratch = Path(tempfile.mkdtemp(prefix=HANG_SCRATCH_PREFIX, dir=self._board_dir))
            evidence = collect(
                node=self._node,
                board_dir=self._board_dir,
                out_dir=scratch,
                pids=pids,
                ranks=ranks,
                can_dump=can_dump,
                started_at=started_at,
                stop=lambda: bool(exited()),
            )
        except OSError as exc:  # the runtime dir's disk is full: diagnose from the other nodes' evidence
            self._write_failed(exc, scratch or self._board_dir)
        outcome = self._confirm(suspicion, fired_at, round_, epoch, exited)
        if outcome is not _Confirmation.CONFIRMED:
            if scratch is not None:
                shutil.rmtree(scratch, ignore_errors=True)
            if outcome is _Confirmation.EXITED:
                self._abandon(log, exited(), step)
                return None
            assert suspicion is not None
            log.info("hang_cleared", silent_s=round(suspicion.silent_s, 3), step=suspicion.step)
            return None
        liveness = self._liveness
        stale = self._safe(lambda: liveness.evicted(round_), None) if liveness is not None and not in_place else None
        if stale is not None:
            # stopped and evicted: the run went on without us; rejoin, and report nothing that could count
            if scratch is not None:
                shutil.rmtree(scratch, ignore_errors=True)
            step_now = max((e.entered_step or 0 for e in evidence), default=0)
            log.warning("hang_stale", reason=stale, step=step_now)
            return HangReport(step=step_now, attempt=0, path="", culprits=())
        self._metrics.hangs_total.inc()
        candidate = hang_name(time.gmtime())
        name, owner = candidate, True
        agreement = self._agreement
        if agreement is not None:
            scope = _scope(round_, epoch)
            name, owner = self._safe(lambda: agreement.claim(scope, candidate), (candidate, True))
        path = self._run.hang(name)
        if self._write_down(scratch, path):
            log.info("diagnostics_written", path=str(path), ranks=sorted(e.rank for e in evidence))
        extra = {
            "path": str(path),
            "hang": name,
            "detected_by": self._node if owner else None,
            "timeout_s": round(suspicion.allowance_s, 3) if suspicion else None,
        }
        summary = self._agree(
            round_, members, evidence, owner=owner, extra=extra, exited=exited, epoch=epoch, in_place=in_place
        )
        if summary is None:
            # abandoned while agreeing: take back what we wrote, so a failure leaves no hang diagnostics behind
            shutil.rmtree(path / node_evidence_dir(self._node), ignore_errors=True)
            with contextlib.suppress(OSError):
                path.rmdir()  # only when no other node's evidence is in it
            self._abandon(log, exited(), step)
            return None
        if self._moved_on_since(fired_at):
            # Every local worker made progress while the nodes agreed: the group got past it by itself (in place,
            # a vanished node's lease expired and the others re-formed without it). Nothing to act on here.
            log.info("hang_cleared", step=step, reason="the workers made progress while the nodes agreed")
            return None
        if owner:
            try:
                (path / HANG_SUMMARY).write_text(json.dumps(summary, indent=2))
            except OSError as exc:
                self._write_failed(exc, path / HANG_SUMMARY)
        log.warning(
            "hang_diagnosed",
            culprit_ranks=summary["culprit_ranks"],
            culprit_nodes=summary["culprit_nodes"],
            reason=summary["reason"],
            cause=summary.get("cause", "hang"),
            step=summary["step"],
            attempt=summary["attempt"],
            path=summary.get("path", str(path)),
        )
        return HangReport(
            step=int(summary["step"]),
            attempt=int(summary["attempt"]),
            path=str(summary.get("path", path)),
            culprits=tuple(summary["culprit_ranks"]),
            culprit_nodes=tuple(summary["culprit_nodes"]),
        )

    def _moved_on_since(self, fired_at: float) -> bool:
        slots = self.watchdog.slots()
        return bool(slots) and all(slot is not None and slot.progress_t > fired_at for slot in slots.values())

    def _abandon(self, log: Any, exited: list[int], step: int | None) -> None:
        """A local worker exited: a failure, which torch's monitor reports at its next poll (restart ``failure``)."""
        log.info("hang_abandoned", reason="a worker exited: a failure, not a hang", ranks=exited, step=step)

    def _write_down(self, scratch: Path | None, path: Path) -> bool:
        """Move the evidence from ``scratch`` into the hang's directory ``path``; False (and an event) when the disk
        refuses it. What could not be written is removed, so a full disk gets nothing back from a hang."""
        moved: list[Path] = []
        try:
            path.mkdir(parents=True, exist_ok=True)
            for item in scratch.iterdir() if scratch is not None else ():
                shutil.rmtree(path / item.name, ignore_errors=True)
                moved.append(path / item.name)
                shutil.move(str(item), path / item.name)
        except OSError as exc:  # shutil.Error too: a full or read-only checkpoint disk must never end the daemon
            for target in moved:
                shutil.rmtree(target, ignore_errors=True)
            self._write_failed(exc, path)
            return False
        finally:
            if scratch is not None:
                shutil.rmtree(scratch, ignore_errors=True)
        return True

    def _write_failed(self, exc: OSError, path: Path) -> None:
        """Diagnostics are a help, never a condition: a failed write is an event and the hang is handled anyway."""
        failure = str(exc)
        errors = exc.args[0] if isinstance(exc, shutil.Error) and exc.args else None
        if isinstance(errors, list) and errors and isinstance(errors[0], tuple):
            # copytree's list of (src, dst, why) per file: the first one says it ("[Errno 28] No space left ...")
            failure = f"{errors[0][-1]} ({len(errors)} files)"
        self._log().warning("diagnostics_write_failed", path=str(path), error=f"{type(exc).__name__}: {failure}")

    def _confirm(
        self,
        suspicion: Suspicion | None,
        fired_at: float,
        round_: int,
        epoch: int,
        exited: Callable[[], list[int]],
    ) -> _Confirmation:
        """Still silent once the confirmation window has passed (or a peer claimed the hang meanwhile)?"""
        if exited():
            return _Confirmation.EXITED
        if suspicion is None:
            return _Confirmation.CONFIRMED  # a peer's claim: its own confirmation stands
        until = fired_at + min(CONFIRM_MAX_S, CONFIRM_SHARE * suspicion.allowance_s)
        while True:
            if exited():
                return _Confirmation.EXITED
            if self.watchdog.check(self._clock()) is None:
                return _Confirmation.CLEARED
            if self._clock() >= until or self._safe(lambda: self.peer_claim(round_, epoch), None) is not None:
                return _Confirmation.CONFIRMED
            time.sleep(0.05)

    def _agree(
        self,
        round_: int,
        members: list[str],
        evidence: list[RankEvidence],
        *,
        owner: bool,
        extra: dict[str, Any],
        exited: Callable[[], list[int]],
        epoch: int,
        in_place: bool,
    ) -> dict[str, Any] | None:
        agreement = self._agreement
        liveness = self._liveness
        hang = str(extra["hang"])
        scope = _scope(round_, epoch)
        if agreement is not None:
            try:
                agreement.report(scope, evidence, hang, members)
                summary = agreement.decide(
                    scope,
                    members,
                    owner=owner,
                    extra=extra,
                    lost=(
                        (lambda: liveness.lost(round_, members, rendezvous=not in_place))
                        if liveness is not None
                        else dict
                    ),
                    abort=lambda: bool(exited()),
                )
                if summary is None and owner:
                    agreement.abandon(scope, hang, "a worker exited")
                elif summary is None:
                    # tell the owner our workers are gone, so it does not take them for hung
                    agreement.report(scope, [replace(e, process_state=process_state(e.pid)) for e in evidence], hang)
                return summary
            except EtcdError as exc:
                self._log().warning("etcd_unavailable", error=str(exc))
        if exited():
            return None
        # no etcd: this node's evidence alone, and repeats counted by this process
        diagnosis = diagnose(evidence)
        attempt = 0
        if diagnosis.counted:
            step, attempts = self._local_last
            self._local_last = (diagnosis.step, attempts + 1 if step == diagnosis.step else 1)
            attempt = self._local_last[1]
        return {**diagnosis.to_json(), "nodes_reported": [self._node], "attempt": attempt, **extra}

    def _safe(self, read: Callable[[], Any], fallback: Any) -> Any:
        try:
            return read()
        except EtcdError:
            return fallback


def _scope(round_: int, epoch: int) -> int:
    """The agreement's key for a hang now: a group re-formed in place agrees on its next hang afresh."""
    return round_ * EPOCH_SPAN + epoch
