"""``elasticd status --watch``: the run as a live terminal view, redrawn every second until Ctrl-C.

Each frame is a snapshot (``status_snapshot.py``: the node registry and ``checkpoint/latest``, two etcd reads) drawn
with rich: the run's health, round and membership epoch, world size, step and step rate, loss, goodput and the newest
checkpoint with its age; one row per node; and the latest restarts and re-formations with their reason (each
daemon keeps its last few in its record, ``NodeRegistry.note``), plus the nodes whose record vanished while
watching. The step rate is measured here, over the frames of the last :data:`RATE_WINDOW_S` seconds.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from elasticd.errors import EXIT_OK
from elasticd.status_snapshot import dash

REFRESH_S = 1.0
RATE_WINDOW_S = 10.0
RECENT_SHOWN = 6
_SLEEP_SLICES = 10


@dataclass
class Watch:
    """What the view remembers between frames: steps over time (for the rate) and the nodes seen."""

    steps: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=64))
    seen: dict[str, float] = field(default_factory=dict)  # node id -> last time its record was there
    gone: list[dict[str, Any]] = field(default_factory=list)  # nodes whose record vanished, as recent events

    def observe(self, status: dict[str, Any], now: float) -> None:
        if isinstance(status.get("step"), int):
            self.steps.append((now, status["step"]))
        present = {str(n.get("node_id")) for n in status["nodes"]}
        for node in sorted(set(self.seen) - present):
            self.gone.append({"at": now, "node": node, "kind": "gone", "reason": "its record expired"})
            del self.seen[node]
        self.seen.update({node: now for node in present})

    def rate(self, now: float) -> float | None:
        recent = [(t, s) for t, s in self.steps if now - t <= RATE_WINDOW_S]
        if len(recent) < 2 or recent[-1][0] <= recent[0][0]:
            return None
        return (recent[-1][1] - recent[0][1]) / (recent[-1][0] - recent[0][0])


def view(status: dict[str, Any], watch: Watch, now: float) -> Group:
    """One frame of the view (a rich renderable)."""
    nodes = status["nodes"]
    ckpt = status.get("checkpoint") or {}
    ckpt_text = "-"
    if isinstance(ckpt.get("step"), int):
        age = now - float(ckpt.get("committed_at", now))
        ckpt_text = f"step {ckpt['step']} ({_age(age)} ago)"
    rate = watch.rate(now)
    losses = [n["loss"] for n in nodes if isinstance(n.get("loss"), int | float)]
    goodputs = [n["goodput"] for n in nodes if isinstance(n.get("goodput"), int | float)]
    header = Text.assemble(
        ("run ", "dim"),
        (str(status["run_id"]), "bold"),
        ("  health ", "dim"),
        (str(status["health"]), _health_style(str(status["health"]))),
        ("  round ", "dim"),
        dash(status.get("round")),
        ("  epoch ", "dim"),
        dash(status.get("epoch")),
        ("  world size ", "dim"),
        dash(status.get("world_size")),
        ("  step ", "dim"),
        (dash(status.get("step")), "bold"),
        ("  rate ", "dim"),
        "-" if rate is None else f"{rate:.2f} steps/s",
        ("  loss ", "dim"),
        "-" if not losses else f"{losses[0]:.4g}",
        ("  goodput ", "dim"),
        "-" if not goodputs else f"{100 * min(goodputs):.1f} %",
        ("  checkpoint ", "dim"),
        ckpt_text,
    )
    table = Table("node", "state", "round", "epoch", "workers", "last step", "step s", "loss", "updated", "health")
    for n in nodes:
        table.add_row(
            str(n.get("node_id")),
            str(n.get("state")),
            dash(n.get("round")),
            dash(n.get("epoch")),
            dash(n.get("workers")),
            dash(n.get("last_step")),
            _number(n.get("step_s"), "{:.3f}"),
            _number(n.get("loss"), "{:.4g}"),
            f"{n.get('age_s', 0)}s ago",
            Text(str(n.get("health")), style=_health_style(str(n.get("health")))),
        )
    parts: list[Any] = [header, table if nodes else Text("no node is registered for this run", style="yellow")]
    recent = _recent(nodes, watch)
    if recent:
        parts.append(Text("recent changes", style="dim"))
        parts.extend(Text(line) for line in recent)
    parts.append(Text(f"refreshed every {REFRESH_S:g} s; Ctrl-C to leave", style="dim"))
    return Group(*parts)


def run_watch(
    collect: Callable[[], dict[str, Any]],
    console: Console | None = None,
    *,
    clock: Callable[[], float] = time.time,
    sleep: Callable[[float], None] = time.sleep,
    frames: int | None = None,
) -> int:
    """Redraw until Ctrl-C (or ``frames`` frames, for tests); exit 0.

    Ctrl-C only asks the loop to stop: it ends after the frame being drawn, never inside an etcd call (a
    KeyboardInterrupt raised in gRPC's client code could leave the process unable to exit). A second Ctrl-C leaves
    at once."""
    stop = _StopOnInterrupt()
    watch = Watch()
    console = console or Console()
    drawn = 0
    live = Live(console=console, auto_refresh=False, transient=False)
    with stop, contextlib.suppress(KeyboardInterrupt), live:
        while not stop.requested and (frames is None or drawn < frames):
            status, now = collect(), clock()
            watch.observe(status, now)
            live.update(view(status, watch, now), refresh=True)
            drawn += 1
            for _ in range(_SLEEP_SLICES):  # short slices: a Ctrl-C is seen within a tenth of a second
                if stop.requested:
                    break
                sleep(REFRESH_S / _SLEEP_SLICES)
    return EXIT_OK


class _StopOnInterrupt:
    """While entered (on the main thread): the first SIGINT sets ``requested``, the second raises KeyboardInterrupt."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None

    def _handle(self, _signum: int, _frame: Any) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __enter__(self) -> _StopOnInterrupt:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


def _recent(nodes: list[dict[str, Any]], watch: Watch) -> list[str]:
    events = [{**e, "node": str(n.get("node_id"))} for n in nodes for e in n.get("recent") or [] if isinstance(e, dict)]
    events += watch.gone
    events.sort(key=lambda e: float(e.get("at", 0)))
    lines = []
    for e in events[-RECENT_SHOWN:]:
        stamp = time.strftime("%H:%M:%S", time.localtime(float(e.get("at", 0))))
        what = {"restart": "restarted its workers", "reformed": "re-formed in place", "fallback": "fell back to cold"}
        text = f"{stamp}  {e['node']}  {what.get(str(e.get('kind')), str(e.get('kind')))}"
        if e.get("reason"):
            text += f" ({e['reason']})"
        if e.get("lost_nodes"):
            text += f": lost {', '.join(map(str, e['lost_nodes']))}"
        if isinstance(e.get("seconds"), int | float):
            text += f" in {e['seconds']:.2f} s"
        lines.append(text)
    return lines


def _age(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _health_style(health: str) -> str:
    return {"ok": "green", "done": "green", "degraded": "red", "failed": "red", "stale": "red"}.get(health, "yellow")


def _number(value: object, fmt: str) -> str:
    return fmt.format(value) if isinstance(value, int | float) and not isinstance(value, bool) else "-"
