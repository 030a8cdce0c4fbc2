"""Goodput under churn: elasticd against torchrun, side by side, through the same schedule of node kills and joins.

The job is bench/recovery.py's (3 node processes on 127.0.0.1, ``--min-nodes 2 --max-nodes 3``, one gloo worker each,
``examples/train.py --sleep 0.05``, a committed checkpoint every 10 steps). Once it trains steadily at 3 nodes, the
schedule runs for ``--minutes``: every ``--kill-every`` seconds one node gets SIGKILL (its launcher and its worker at
one moment), and ``--join-after`` seconds after each kill a new node starts. The victim is the live node that has
lived longest among those the system can lose (torchrun cannot lose the node hosting its c10d store; elasticd can
lose any, rank 0's included).

    goodput = sum over world sizes w of min(distinct steps at w x T(w), the seconds they took) / window wall time

where ``T(w)`` is the steady step time at world size ``w`` in the same run (the median interval between consecutive
steps at ``w``), and distinct steps count each step number once (steps redone after a restart from a checkpoint
count once): goodput <= 1 by construction. Beside it, the idle capacity: the share of the node-seconds the schedule
provided that were not spent training at that pace (bench/goodput_figures.py computes both from the raw step lines).
Every system gets the same restart budget (bench/recovery.py's ``MAX_RESTARTS``). Each system's step-versus-time line
through the schedule goes to one picture (``--png``, needs matplotlib: ``pip install 'elasticd[bench]'``).

    python bench/goodput.py [--minutes 10] [--kill-every 30] [--join-after 20] [--only SYSTEM ...] [--png PATH]

Before each system the benchmark waits (up to bench/recovery.py's ``QUIET_TIMEOUT_S``) until other processes use
under a quarter core, and records what they used then and over the window. The raw results (commit, machine,
versions, every step line's time, step and size, the schedule, the others' load) go to
``bench/results/goodput-<short commit>[-dirty].json`` unless ``--json`` says otherwise.
"""

from __future__ import annotations

import argparse
import itertools
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/goodput.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (
    BenchTimeout,
    code_revision,
    foreign_cores,
    foreign_cpu,
    interrupt_on_sigterm,
    preflight,
    report_header,
    results_path,
    snapshot_code,
    text_table,
    wait_for_quiet,
    write_results,
)
from bench.goodput_figures import Figures, of_run
from bench.recovery import (
    CHECKPOINT_EVERY_STEPS,
    MAX_NODES,
    MAX_RESTARTS,
    QUIET_TIMEOUT_S,
    SCRIPT_ARGS,
    STARTUP_TIMEOUT_S,
    SYSTEMS,
    TUNED_RDZV_CONF,
    Job,
    start_job,
    steps_at,
    wait_steady,
)

MINUTES, KILL_EVERY_S, JOIN_AFTER_S = 10.0, 30.0, 20.0
# Steps at 3 nodes before the schedule, so it starts from steady training (each ~0.06-0.1 s here).
BASELINE_STEPS = 40
# The target for hot recovery; cold recovery and torchrun are reported against it too.
TARGET_GOODPUT = 0.95


@dataclass
class Run:
    system: str
    # median at 3 nodes before the schedule, for reference: goodput uses each world size's step time in the window
    step_time_s: float | None = None
    window_s: float = 0.0
    steps_before: int = 0  # highest step when the schedule started
    steps_after: int = 0  # highest step when it ended
    note: str = ""
    # (seconds since the schedule started, step, world size) of every step line, and the schedule as it ran
    line: list[tuple[float, int, int]] = field(default_factory=list)
    kills: list[tuple[float, str]] = field(default_factory=list)
    joins: list[tuple[float, str]] = field(default_factory=list)
    # Cores' worth of CPU used by processes outside the benchmark before the job started and over the window.
    foreign_cores_before: float | None = None
    foreign_cores_during: float | None = None


def baseline_step_time(job: Job) -> float:
    """Median seconds between consecutive steps at 3 nodes, over BASELINE_STEPS steps after steady state."""
    wait_steady(job, MAX_NODES, since=0.0, timeout_s=STARTUP_TIMEOUT_S)
    since = time.time()
    deadline = since + STARTUP_TIMEOUT_S
    while len(steps_at(job, MAX_NODES, since)) < BASELINE_STEPS + 1:
        if time.time() > deadline:
            raise BenchTimeout(f"{job.system}: {BASELINE_STEPS} steps at 3 nodes")
        time.sleep(0.2)
        job.launcher.refresh()
    times = [float(r["t"]) for r in steps_at(job, MAX_NODES, since)]
    return statistics.median(b - a for a, b in itertools.pairwise(times))


def highest_step(job: Job, before: float) -> int:
    steps = [
        int(r["step"])
        for n in job.launcher.nodes.values()
        for r in n.out_records
        if r.get("event") == "step" and float(r.get("t", 0)) <= before
    ]
    return max(steps, default=0)


def pick_victim(job: Job) -> str | None:
    """The live node that has lived longest among those the system can lose."""
    live = [n for n in job.launcher.live() if job.killable(n.name)]
    return min(live, key=lambda n: n.started_at).name if live else None


def run_schedule(job: Job, minutes: float, kill_every_s: float, join_after_s: float) -> Run:
    run = Run(job.system)
    job.start_initial()
    for _ in range(MAX_NODES - len(job.launcher.live())):
        job.start_node()
    run.step_time_s = baseline_step_time(job)
    start = time.time()
    end = start + minutes * 60
    run.steps_before = highest_step(job, start)
    others = foreign_cpu()
    events: list[tuple[float, str]] = []
    k = 1
    while start + k * kill_every_s < end:
        events.append((start + k * kill_every_s, "kill"))
        if start + k * kill_every_s + join_after_s < end:
            events.append((start + k * kill_every_s + join_after_s, "join"))
        k += 1
    for at, what in sorted(events):
        time.sleep(max(at - time.time(), 0.0))
        job.launcher.refresh()
        if what == "kill":
            name = pick_victim(job)
            if name is None:
                run.note = "no node left to kill"
                continue
            run.kills.append((job.launcher.nodes[name].kill() - start, name))
        else:
            node = job.start_node()
            run.joins.append((node.started_at - start, node.name))
        print(f"[{job.system}] {what} at {at - start:.0f} s", file=sys.stderr)
    time.sleep(max(end - time.time(), 0.0))
    job.launcher.refresh()
    run.window_s = round(time.time() - start, 2)
    run.foreign_cores_during = round(foreign_cores(others, foreign_cpu(), run.window_s), 2)
    run.steps_after = highest_step(job, start + run.window_s)
    run.line = sorted(
        (round(float(r["t"]) - start, 3), int(r["step"]), int(r["world_size"]))
        for n in job.launcher.nodes.values()
        for r in n.out_records
        if r.get("event") == "step" and start <= float(r.get("t", 0)) <= start + run.window_s
    )
    return run


def figures(run: Run) -> Figures | None:
    """The run's goodput and idle capacity (None when it has no step line in the window)."""
    return of_run(asdict(run), MAX_NODES)


def run_system(system: str, workdir: Path, code: Path, args: argparse.Namespace) -> Run:
    trial_dir = workdir / system
    run_id = f"goodput-{system}-{uuid.uuid4().hex[:6]}"
    cores_before = round(wait_for_quiet(QUIET_TIMEOUT_S), 2)
    print(f"[{system}] starting", file=sys.stderr)
    with ExitStack() as stack:
        job = start_job(stack, system, trial_dir, run_id, code)
        try:
            run = run_schedule(job, args.minutes, args.kill_every, args.join_after)
        except BenchTimeout as exc:
            run = Run(system, note=f"not measured: {exc}")
    run.foreign_cores_before = cores_before
    return run


def render(runs: Sequence[Run]) -> str:
    body = []
    for r in runs:
        f = figures(r)
        goodput = "-" if f is None else f"{f.goodput:.1%}"
        steps = "-" if f is None else str(sum(f.distinct_steps.values()))
        step = "-" if f is None else " / ".join(f"{w}: {1000 * s:.0f}" for w, s in sorted(f.step_time_s.items()))
        idle = "-" if f is None else f"{f.idle_capacity:.1%} ({f.outside_group:.1%})"
        body.append([r.system, goodput, steps, step, idle, f"{r.window_s:.0f}", r.note])
    head = ["system", "goodput", "distinct steps", "step ms per size", "idle (outside group)", "window s", "note"]
    return text_table(head, body) + f"\ntarget for hot recovery: >= {TARGET_GOODPUT:.0%}"


def draw(runs: Sequence[Run], png: Path) -> bool:
    """Each system's step-versus-time line through the schedule, kills and joins marked; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench/goodput.py: no matplotlib, no picture (pip install 'elasticd[bench]')", file=sys.stderr)
        return False
    fig, ax = plt.subplots(figsize=(10, 5))
    for r in runs:
        if (f := figures(r)) is not None:
            label = f"{r.system} ({f.goodput:.0%})"
            ax.plot([t for t, _, _ in r.line], [s - r.steps_before for _, s, _ in r.line], label=label, lw=1.2)
    first = next((r for r in runs if r.kills), None)
    if first is not None:
        for t, _ in first.kills:
            ax.axvline(t, color="red", alpha=0.25, lw=1)
        for t, _ in first.joins:
            ax.axvline(t, color="green", alpha=0.25, lw=1)
    ax.set_xlabel("seconds since the schedule started (red: node killed, green: node joins)")
    ax.set_ylabel("optimizer steps since the start")
    ax.set_title("Training progress through node kills and joins")
    ax.legend(loc="upper left")
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return True


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=MINUTES, help=f"schedule length (default {MINUTES:g})")
    p.add_argument("--kill-every", type=float, default=KILL_EVERY_S, help="seconds between kills (default 30)")
    p.add_argument("--join-after", type=float, default=JOIN_AFTER_S, help="a join this long after each kill (20)")
    p.add_argument(
        "--only",
        nargs="+",
        choices=SYSTEMS,
        help="run these systems only (default: elasticd hot and cold, tuned torchrun)",
    )
    p.add_argument("--png", type=Path, default=Path("docs/goodput.png"), help="the picture (default docs/goodput.png)")
    p.add_argument("--json", type=Path, help="raw results (default: bench/results/goodput-<commit>.json)")
    p.add_argument("--logs", type=Path, help="keep every node's stdout/stderr here")
    args = p.parse_args(argv)
    if not 0.5 <= args.minutes <= 120:
        p.error("--minutes must be between 0.5 and 120")
    if not 5 <= args.kill_every <= 3600 or not 0 < args.join_after < args.kill_every:
        p.error("--kill-every must be 5..3600 s and --join-after between 0 and --kill-every")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    systems = list(args.only or ("elasticd", "elasticd-cold", "torchrun-tuned"))
    workdir = args.logs or Path(tempfile.mkdtemp(prefix="elasticd-bench-goodput-"))
    workdir.mkdir(parents=True, exist_ok=True)
    revision = code_revision()
    code = snapshot_code(workdir / "code")
    problem = preflight(code, [a for a in SCRIPT_ARGS if a.startswith("--")], ["--checkpoint-every-steps"], "goodput")
    if problem is not None:
        print(f"bench/goodput.py: {problem}", file=sys.stderr)
        return 2
    interrupt_on_sigterm()
    started = time.time()
    try:
        runs = [run_system(system, workdir, code, args) for system in systems]
    except KeyboardInterrupt:
        print(f"interrupted; node logs: {workdir}", file=sys.stderr)
        return 130
    print(render(runs))
    drawn = draw(runs, args.png)
    out = args.json or results_path("goodput", revision)
    report = {
        **report_header("goodput.py", argv, revision),
        "config": {
            "minutes": args.minutes,
            "kill_every_s": args.kill_every,
            "join_after_s": args.join_after,
            "script_args": list(SCRIPT_ARGS),
            "checkpoint_every_steps": CHECKPOINT_EVERY_STEPS,
            "baseline_steps": BASELINE_STEPS,
            "start_nodes": MAX_NODES,
            "max_restarts": MAX_RESTARTS,
            "torchrun_tuned_rdzv_conf": TUNED_RDZV_CONF,
            "png": str(args.png) if drawn else None,
        },
        "duration_s": round(time.time() - started, 1),
        "runs": [asdict(r) for r in runs],
    }
    write_results(out, report)
    if args.logs is None and all(r.line for r in runs):
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        print(f"node logs: {workdir}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
