"""The demo's scenario: a job on N local nodes loses one to kill -9, gains one, trains to its end.

Every moment it reports is read from what the job wrote (:mod:`elasticd.demo.journal`) or recorded in etcd (the
lineage's committed checkpoints), never assumed: "recovered" is the first step line at the smaller world size,
"joined" the first at the full size again. Each wait has a timeout; a demo that does not see what it waits for says
which and where the nodes' logs are, and fails (exit 1).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any, Protocol, TypeVar

from elasticd.demo.journal import Journal, Step, change_figures
from elasticd.demo.nodes import LocalNodes
from elasticd.etcd.client import EtcdError
from elasticd.lineage import ADOPTED, Lineage

T = TypeVar("T")

POLL_S = 0.2
LINEAGE_EVERY_S = 1.0
FIRST_STEP_TIMEOUT_S = 180.0  # a cold 2-core box imports torch N times at once
CHANGE_TIMEOUT_S = 180.0
# After a change's first step, how long the daemons may take to log how they made it (s): a beat interval and more
SETTLE_S = 5.0
JOIN_AFTER_STEPS = 20  # the joiner starts this many steps after the recovery


class DemoFailed(Exception):
    """What the demo waited for did not happen."""


@dataclass(frozen=True, slots=True)
class Moment:
    t: float  # unix seconds
    kind: str
    text: str
    fields: dict[str, Any] = field(default_factory=dict)

    def as_json(self, start: float) -> dict[str, Any]:
        return {"event": self.kind, "t": round(self.t, 3), "since_start_s": round(self.t - start, 2),
                "message": self.text, **self.fields}  # fmt: skip


class View(Protocol):
    def moment(self, moment: Moment) -> None: ...
    def refresh(self, demo: Demo) -> None: ...


@dataclass
class Demo:
    """What the view shows: the job's progress, its nodes, what happened, what the demo does now."""

    nodes: LocalNodes
    lineage: Lineage
    total_steps: int
    initial_nodes: int
    kill_at: int
    view: View
    journal: Journal = field(default_factory=Journal)
    start: float = field(default_factory=time.time)
    now_doing: str = "starting the nodes"
    moments: list[Moment] = field(default_factory=list)
    changes: list[dict[str, Any]] = field(default_factory=list)
    committed: list[int] = field(default_factory=list)
    finished_already: str | None = None
    _lineage_read: float = 0.0

    # -- the scenario ----------------------------------------------------------------------------------------------

    def play(self) -> dict[str, Any]:
        """Run the scenario; returns the summary. Raises :class:`DemoFailed` when a wait times out."""
        names = [f"node-{i}" for i in range(1, self.initial_nodes + 1)]
        for name in names:
            self._start(name)
        self.note("started", f"started {len(names)} nodes: {', '.join(names)}", nodes=names)
        first = self._wait(lambda: self.journal.first_step_at(self.initial_nodes, 0.0), FIRST_STEP_TIMEOUT_S,
                           f"the first step at world size {self.initial_nodes}")  # fmt: skip
        if first is None:  # the run had finished already: every node exited 0 without a step
            return self.summary()
        self.note("training", f"training at world size {first.world_size}", step=first.step)

        self.now_doing = f"training until step {self.kill_at}, then kill -9 of node-2"
        self._wait(lambda: self._reached(self.kill_at), CHANGE_TIMEOUT_S, f"step {self.kill_at}")
        victim = self.nodes.nodes["node-2"]
        at = time.time()
        victim.kill()
        self.note("node_killed", "node-2 killed: SIGKILL to its daemon and its worker at once", node="node-2",
                  step=self._last_step())  # fmt: skip
        self.now_doing = f"waiting for the others to train at world size {self.initial_nodes - 1}"
        recovered = self._change("node_lost", "node-2", at, self.initial_nodes - 1)

        joiner = f"node-{self.initial_nodes + 1}"
        self.now_doing = f"training {JOIN_AFTER_STEPS} steps at the smaller size, then starting {joiner}"
        self._wait(lambda: self._reached(recovered.step + JOIN_AFTER_STEPS), CHANGE_TIMEOUT_S,
                   f"step {recovered.step + JOIN_AFTER_STEPS}")  # fmt: skip
        at = time.time()
        self._start(joiner)
        self.note("node_started", f"{joiner} started: a new node joins the running job", node=joiner,
                  step=self._last_step())  # fmt: skip
        self.now_doing = f"{joiner} imports and prepares, then is admitted at a step boundary"
        self._change("node_joined", joiner, at, self.initial_nodes)

        self.now_doing = "training to the end"
        self._wait(lambda: not self.nodes.running() or None, self._time_to_finish(), "every node to exit")
        return self.summary()

    def _change(self, kind: str, node: str, at: float, world_size: int) -> Step:
        """Wait for the first step at ``world_size`` after ``at``; note the change and its figures."""
        first = self._wait(lambda: self.journal.first_step_at(world_size, at), CHANGE_TIMEOUT_S,
                           f"a step at world size {world_size} after {node} {kind.split('_')[1]}")  # fmt: skip
        assert first is not None
        figures = change_figures(self.journal.steps, at, first)
        # judged on the nodes that trained through the change: a joiner's own daemon may restart its workers while
        # it comes in, and that is no restart of the running job
        survivors = [n.name for n in self.nodes.nodes.values() if n.name != node and not n.killed]

        def seen(event: str, until: float = math.inf) -> bool:
            return any(self._within(e, at, until) for _, e in self.journal.named(event, survivors))

        # a daemon logs ``reconfigured`` when it reads its workers' beat, which may come after their first step: a
        # restart is logged before it, so wait a little for either before calling the change one or the other
        settle = time.monotonic() + SETTLE_S
        while not seen("reconfigured") and not seen("restart", first.t) and time.monotonic() < settle:
            time.sleep(POLL_S)
            self._look()
        kept = seen("reconfigured") and not seen("restart", first.t)
        before = world_size + (1 if kind == "node_lost" else -1)
        if kind == "node_lost":
            what = f"re-formed {'in place' if kept else 'by a restart from the last checkpoint'} without {node}"
            since = "the kill"
        else:
            what = f"{node} admitted {'in place' if kept else 'by a restart from the last checkpoint'}"
            since = "it started (its imports included)"
        text = (f"{what}: world size {before} -> {world_size}, first step {figures.first_step_s:.2f} s after {since}; "
                f"training stopped {figures.stopped_s:.2f} s in all; {figures.redone} steps redone")  # fmt: skip
        change = {"change": kind, "node": node, "at": round(at, 3), "world_size": [before, world_size],
                  "in_place": kept, **asdict(figures)}  # fmt: skip
        self.changes.append(change)
        self.note("recovered" if kind == "node_lost" else "joined", text, **change)
        return first

    # -- waiting, and what is seen meanwhile ---------------------------------------------------------------------

    def _wait(self, found: Callable[[], T | None], timeout_s: float, what: str) -> T | None:
        deadline = time.monotonic() + timeout_s
        while True:
            self._look()
            value = found()
            if value is not None:
                return value
            if not self.nodes.running():
                if self.finished_already is not None:
                    return None
                raise DemoFailed(f"every node exited before {what}")
            failed = [n for n in self.nodes.nodes.values() if not n.killed and n.proc.poll() not in (None, 0)]
            if failed:
                codes = ", ".join(f"{n.name} exited {n.proc.returncode}" for n in failed)
                raise DemoFailed(f"{codes} while waiting for {what}")
            if time.monotonic() > deadline:
                raise DemoFailed(f"no {what} within {timeout_s:.0f} s")
            time.sleep(POLL_S)

    def _look(self) -> None:
        self.journal.read()
        for _, event in self.journal.named("run_already_finished"):
            if self.finished_already is None:
                self.finished_already = str(event.get("message", "the run had already finished"))
                self.note("already_finished", self.finished_already, step=event.get("step"))
        if time.monotonic() - self._lineage_read >= LINEAGE_EVERY_S:
            self._lineage_read = time.monotonic()
            self._read_lineage()
        self.view.refresh(self)

    def _read_lineage(self) -> None:
        try:
            records = self.lineage.records()
        except EtcdError:  # etcd busy: the next look reads it
            return
        for record in sorted(records, key=lambda r: r.step):
            if record.token == ADOPTED:
                continue  # found on disk by a new lineage (a run started again), not committed by this one
            if not self.committed or record.step > self.committed[-1]:
                self.committed.append(record.step)
                self.note("checkpoint_committed", f"checkpoint committed at step {record.step}", step=record.step)

    def _reached(self, step: int) -> bool | None:
        last = self.journal.last
        return True if last is not None and last.step >= step else None

    def _last_step(self) -> int | None:
        last = self.journal.last
        return None if last is None else last.step

    def _within(self, event: dict[str, Any], since: float, until: float) -> bool:
        stamp = event.get("timestamp")
        if not isinstance(stamp, str):
            return False
        return since < datetime.fromisoformat(stamp).timestamp() <= until

    def _time_to_finish(self) -> float:
        rate = self.steps_per_s()
        left = self.total_steps - (self._last_step() or 0)
        return 120.0 + (3 * left / rate if rate else 600.0)

    def steps_per_s(self, window: int = 20) -> float:
        recent = self.journal.steps[-window:]
        if len(recent) < 2 or recent[-1].t <= recent[0].t:
            return 0.0
        return (recent[-1].step - recent[0].step) / (recent[-1].t - recent[0].t)

    def _start(self, name: str) -> None:
        node = self.nodes.start(name)
        self.journal.follow(name, node.out, node.err)

    def note(self, kind: str, text: str, **fields: Any) -> None:
        moment = Moment(time.time(), kind, text, fields)
        self.moments.append(moment)
        self.view.moment(moment)

    # -- the end -------------------------------------------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        self.journal.read()
        self._read_lineage()
        last = self.journal.last
        codes = {n.name: ("killed" if n.killed else n.proc.poll()) for n in self.nodes.nodes.values()}
        return {
            "event": "summary",
            "finished_already": self.finished_already,
            "last_step": None if last is None else last.step,
            "total_steps": self.total_steps,
            "wall_s": round(time.time() - self.start, 1),
            "changes": self.changes,
            "checkpoints_committed": self.committed,
            "exit_codes": codes,
            "logs": str(self.nodes.logs),
        }
