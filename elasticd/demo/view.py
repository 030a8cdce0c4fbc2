"""How the demo shows itself: a live view on a terminal, JSON lines anywhere else.

:class:`LiveView` redraws (rich) a progress bar with the world size, the loss and the step rate, one line per node,
what the demo does now, and every moment so far; at the end a summary table: each change with when it happened,
how long training stopped, the steps redone, and the checkpoints committed. :class:`JsonView` prints each moment and
the summary as one JSON object per line, for scripts and CI logs.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

from rich.console import Console, Group
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

if TYPE_CHECKING:
    from elasticd.demo.story import Demo, Moment

REFRESH_PER_S = 4
SHOWN_MOMENTS = 12


class JsonView:
    def __init__(self, start: float) -> None:
        self.start = start

    def moment(self, moment: Moment) -> None:
        print(json.dumps(moment.as_json(self.start)), flush=True)

    def refresh(self, demo: Demo) -> None:
        pass

    def summary(self, summary: dict[str, Any]) -> None:
        print(json.dumps(summary), flush=True)

    def close(self) -> None:
        pass


class LiveView:
    def __init__(self, console: Console, title: str) -> None:
        self.console = console
        self.title = title
        self._live = Live(Text(title), console=console, refresh_per_second=REFRESH_PER_S, transient=False)
        self._live.start()
        self._demo: Demo | None = None

    def moment(self, moment: Moment) -> None:
        if self._demo is not None:
            self._live.update(self._frame(self._demo))

    def refresh(self, demo: Demo) -> None:
        self._demo = demo
        self._live.update(self._frame(demo))

    def close(self) -> None:
        self._live.stop()

    def summary(self, summary: dict[str, Any]) -> None:
        self.close()
        self.console.print(summary_table(summary))

    def _frame(self, demo: Demo) -> Group:
        last = demo.journal.last
        step = 0 if last is None else last.step
        rate = demo.steps_per_s()
        bar = Table.grid(padding=(0, 1))
        bar.add_row(
            Text(f"step {step}/{demo.total_steps}", style="bold"),
            ProgressBar(total=demo.total_steps, completed=step, width=36),
            Text(f"world size {'-' if last is None else last.world_size}", style="bold cyan"),
            Text(f"loss {'-' if last is None or last.loss is None else f'{last.loss:.4g}'}"),
            Text(f"{rate:.1f} steps/s" if rate else ""),
        )
        nodes = Text.assemble(("nodes  ", "dim"))
        for node in demo.nodes.nodes.values():
            state, style = _node_state(node.killed, node.proc.poll())
            nodes.append(f"{node.name} ", style="bold")
            nodes.append(f"{state}   ", style=style)
        moments = Table.grid(padding=(0, 2))
        for m in demo.moments[-SHOWN_MOMENTS:]:
            moments.add_row(Text(f"+{m.t - demo.start:5.1f} s", style="dim"), Text(m.text, style=_style(m.kind)))
        return Group(
            Text(self.title, style="bold"),
            bar,
            nodes,
            Text.assemble(("now  ", "dim"), demo.now_doing),
            Text("what happened", style="dim"),
            moments,
        )


def _node_state(killed: bool, code: int | None) -> tuple[str, str]:
    if killed:
        return "killed (kill -9)", "red"
    if code is None:
        return "running", "green"
    return f"exited {code}", "dim" if code == 0 else "red"


def _style(kind: str) -> str:
    return {"node_killed": "red", "recovered": "green", "joined": "green", "node_started": "cyan"}.get(kind, "")


def summary_table(summary: dict[str, Any]) -> Group:
    """The closing summary, for a terminal."""
    if summary.get("finished_already"):
        return Group(Text(str(summary["finished_already"]), style="yellow"))
    changes = Table("change", "when", "world size", "how", "first step after", "training stopped", "steps redone",
                    title="what elasticd did")  # fmt: skip
    for c in summary["changes"]:
        changes.add_row(
            f"{c['node']} {'killed' if c['change'] == 'node_lost' else 'joined'}",
            time.strftime("%H:%M:%S", time.localtime(c["at"])),
            " -> ".join(str(n) for n in c["world_size"]),
            "in place" if c["in_place"] else "restart",
            f"{c['first_step_s']:.2f} s",
            f"{c['stopped_s']:.2f} s",
            str(c["redone"]),
        )
    committed = summary["checkpoints_committed"]
    lines = [
        Text(f"trained to step {summary['last_step']} of {summary['total_steps']} in {summary['wall_s']} s"),
        Text(f"checkpoints committed: {len(committed)} (steps {', '.join(map(str, committed)) or '-'})"),
        Text("training stopped: every step interval around the change less the usual step time, summed", style="dim"),
        Text(f"the nodes' logs: {summary['logs']}", style="dim"),
    ]
    return Group(changes, *lines)
