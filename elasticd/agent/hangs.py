"""From a silent worker to an agreed diagnosis: detect, gather evidence, confirm, agree, write it down.

The supervisor loop calls :meth:`HangHandler.check` every monitor interval (a read of the board) and
:meth:`HangHandler.peer_claim` with its etcd polls. When either fires, :meth:`HangHandler.handle`:

1. logs ``hang_detected`` and gathers this node's evidence (stacks, flight recorder, process states) into a
   scratch directory; that takes up to a second, which doubles as a **confirmation**: if the silent ranks made
   progress meanwhile it was a slow step, not a hang (``hang_cleared``, nothing else happens);
2. claims the hang for the round, moves the evidence into the hang's directory
   ``<checkpoint-dir>/<run-id>/diagnostics/<UTC time>-hang/``, reports it, and waits for the agreed summary
   (``agreement.py``); the owner writes ``summary.json``;
3. returns a :class:`~elasticd.agent.policy.HangReport` for the policy (restart, or stop after repeated hangs).
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from elasticd.agent.agreement import HangAgreement
from elasticd.agent.diagnosis import diagnose
from elasticd.agent.evidence import RankEvidence, collect
from elasticd.agent.policy import HangReport
from elasticd.agent.watchdog import Suspicion, Watchdog
from elasticd.board import slot_path
from elasticd.etcd.client import EtcdError
from elasticd.metrics import Metrics

DIAGNOSTICS_DIR = "diagnostics"
# A suspicion stands only if the silent ranks stay silent for this share of their allowance after it fired (bounded
# below by the evidence gathering itself and above by CONFIRM_MAX_S): a slow step on a starved machine clears itself.
CONFIRM_SHARE = 0.5
CONFIRM_MAX_S = 2.0


class HangHandler:
    def __init__(
        self,
        *,
        watchdog: Watchdog,
        agreement: HangAgreement | None,
        node_id: str,
        board_dir: Path,
        run_dir: Path,
        metrics: Metrics,
        log: Callable[[], Any],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.watchdog = watchdog
        self._agreement = agreement
        self._node = node_id
        self._board_dir = board_dir
        self._run_dir = run_dir
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
            self._agreement.forget_rounds_before(round_)

    def check(self) -> Suspicion | None:
        suspicion = self.watchdog.check(self._clock())
        timeout = self.watchdog.timeout_s
        if timeout is not None:
            self._metrics.hang_timeout_seconds.set(timeout)
        return suspicion

    def peer_claim(self, round_: int) -> str | None:
        if self._agreement is None:
            return None
        return self._agreement.claimed(round_)

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
    ) -> HangReport | None:
        log = self._log()
        fired_at = self._clock()
        if suspicion is not None:
            log.warning(
                "hang_detected",
                timeout_s=round(suspicion.allowance_s, 3),
                silent_s=round(suspicion.silent_s, 3),
                step=suspicion.step,
                ranks=[ranks.get(r, r) for r in suspicion.local_ranks],
            )
        scratch: Path | None = None
        evidence: list[RankEvidence] = []
        try:
            scratch = Path(tempfile.mkdtemp(prefix="hang-", dir=self._board_dir))
            evidence = collect(
                node=self._node,
                board_dir=self._board_dir,
                out_dir=scratch,
                pids=pids,
                ranks=ranks,
                can_dump=can_dump,
                started_at=started_at,
            )
        except OSError as exc:  # the runtime dir's disk is full: diagnose from the other nodes' evidence
            self._write_failed(exc, scratch or self._board_dir)
        if suspicion is not None and not self._confirmed(suspicion, fired_at, round_):
            log.info("hang_cleared", silent_s=round(suspicion.silent_s, 3), step=suspicion.step)
            if scratch is not None:
                shutil.rmtree(scratch, ignore_errors=True)
            return None
        self._metrics.hangs_total.inc()
        candidate = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-hang"
        name, owner = candidate, True
        if self._agreement is not None:
            name, owner = self._safe(lambda: self._agreement.claim(round_, candidate), (candidate, True))  # type: ignore[union-attr]
        path = self._run_dir / DIAGNOSTICS_DIR / name
        if self._write_down(scratch, path):
            log.info("diagnostics_written", path=str(path), ranks=sorted(e.rank for e in evidence))
        extra = {
            "path": str(path),
            "hang": name,
            "detected_by": self._node if owner else None,
            "timeout_s": round(suspicion.allowance_s, 3) if suspicion else None,
        }
        summary = self._agree(round_, members, evidence, owner=owner, extra=extra)
        if owner:
            try:
                (path / "summary.json").write_text(json.dumps(summary, indent=2))
            except OSError as exc:
                self._write_failed(exc, path / "summary.json")
        log.warning(
            "hang_diagnosed",
            culprit_ranks=summary["culprit_ranks"],
            culprit_nodes=summary["culprit_nodes"],
            reason=summary["reason"],
            step=summary["step"],
            attempt=summary["attempt"],
            path=summary.get("path", str(path)),
        )
        return HangReport(
            step=int(summary["step"]),
            attempt=int(summary["attempt"]),
            path=str(summary.get("path", path)),
            culprits=tuple(summary["culprit_ranks"]),
        )

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

    def _confirmed(self, suspicion: Suspicion, fired_at: float, round_: int) -> bool:
        """Still silent once the confirmation window has passed (or a peer claimed the hang meanwhile)?"""
        until = fired_at + min(CONFIRM_MAX_S, CONFIRM_SHARE * suspicion.allowance_s)
        while True:
            if self.watchdog.check(self._clock()) is None:
                return False
            if self._clock() >= until or self._safe(lambda: self.peer_claim(round_), None) is not None:
                return True
            time.sleep(0.05)

    def _agree(
        self, round_: int, members: list[str], evidence: list[Any], *, owner: bool, extra: dict[str, Any]
    ) -> dict[str, Any]:
        agreement = self._agreement
        if agreement is not None:
            try:
                agreement.report(round_, evidence)
                return agreement.decide(round_, members, owner=owner, extra=extra)
            except EtcdError as exc:
                self._log().warning("etcd_unavailable", error=str(exc))
        # no etcd: this node's evidence alone, and repeats counted by this process
        diagnosis = diagnose(evidence)
        step, attempts = self._local_last
        self._local_last = (diagnosis.step, attempts + 1 if step == diagnosis.step else 1)
        return {**diagnosis.to_json(), "nodes_reported": [self._node], "attempt": self._local_last[1], **extra}

    def _safe(self, read: Callable[[], Any], fallback: Any) -> Any:
        try:
            return read()
        except EtcdError:
            return fallback
