"""The Markdown tables of docs/benchmarks.md, one renderer per kind of raw results file (bench/report.py finds the
marked blocks, reads their files and calls these).

Every renderer takes the JSON a benchmark wrote and returns Markdown whose first line names the commit the figures
were measured on, the machine, and what a ``*`` means; figures come from the file only. A constant the benchmark
assumed rather than measured (gloo's collective timeout in the hang benchmark) is shown as assumed and never
divided by a measurement.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from bench import goodput_figures
from bench.common import QUIET_CORES
from bench.recovery import TARGET_JOIN_S, join_verdict, plain_join_verdict
from bench.recovery_sharded import notes as in_place_notes
from bench.shard_mirror import label as mirror_label
from bench.workloads import Workload, mlp_parameters

_RECOVERY_SYSTEMS = ("elasticd", "elasticd-cold", "torchrun", "torchrun-tuned")
_RECOVERY_LABELS = {
    "join": "join (2 -> 3 nodes)",
    "node_loss": "node loss (kill -9, 3 -> 2)",
    "node_loss_rank0": "node loss, rank-0 node",
    "node_vanish": "vanished node (SIGSTOP)",
    "hang": "hung worker (SIGSTOP of one worker, --hang-timeout auto)",
    "node_isolated": "node cut off (data and control links, 3 -> 2)",
    "node_loss_etcd_leader": "node loss (kill -9, 3 -> 2) with etcd's leader (3-member etcd, 1 s election timeout)",
    "join_large": "join (2 -> 3 nodes), 1.2 GB state",
    "node_loss_large": "node loss (kill -9, 3 -> 2), 1.2 GB state",
}
_JOIN_SCENARIOS = ("join", "join_large")
_LARGE_SCENARIOS = ("join_large", "node_loss_large")
_CONTENDED = f"*: other processes used more than {QUIET_CORES:g} cores around that sample"
_OTHERS = f"`*`: more than {QUIET_CORES:g}"


# -- shared pieces -------------------------------------------------------------------------------------------


def provenance(results: dict[str, Any]) -> str:
    """'Measured on commit abc1234, 2 CPUs, Python 3.11.7, torch 2.13.0+cpu': what every table starts with."""
    code = results.get("code") or {}
    text = f"Measured on commit {code.get('commit') or 'unknown'}"
    if code.get("uncommitted_changes"):
        text += " plus uncommitted changes to elasticd/ or examples/"
    elif code.get("from_file_name"):
        text += " (named by the results file's name: the file predates recording the commit)"
    machine = results.get("machine") or {}
    parts = [
        f"{machine['cpus']} CPUs" if machine.get("cpus") else "",
        f"Python {machine['python']}" if machine.get("python") else "",
        f"torch {machine['torch']}" if machine.get("torch") else "",
    ]
    return ", ".join([text, *(p for p in parts if p)])


def _row(cells: Sequence[object]) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _table(head: Sequence[str], body: Sequence[Sequence[object]]) -> list[str]:
    return [_row(head), "|" + "---|" * len(head), *(_row(r) for r in body)]


def _num(value: Any, digits: int = 2) -> str:
    if not isinstance(value, int | float):
        return "-"
    return "inf" if math.isinf(value) else f"{value:.{digits}f}"


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return "did not recover" if math.isinf(value) else f"{value:.2f}"


def _ratio(value: float | None) -> str:
    if value is None:
        return "-"
    return "inf" if math.isinf(value) else f"{value:.1f}x"


def _contended(row: dict[str, Any]) -> bool | None:
    """Whether others used more than QUIET_CORES around ``row``; None when the file did not record it."""
    seen = [row.get("foreign_cores_before"), row.get("foreign_cores_during")]
    values = [v for v in seen if isinstance(v, int | float)]
    return max(values) > QUIET_CORES if values else None


def _others(row: dict[str, Any]) -> str:
    before, during = row.get("foreign_cores_before"), row.get("foreign_cores_during")
    if before is None and during is None:
        return "not recorded"
    return f"{_num(before)} / {_num(during)}" + ("*" if _contended(row) else "")


def _samples(values: Sequence[float | None], contended: Sequence[bool] | None = None, digits: int = 2) -> str:
    marks = contended or [False] * len(values)
    text = ["x" if v is None else _num(v, digits) for v in values]
    return ", ".join(t + ("*" if c else "") for t, c in zip(text, marks, strict=True))


def _percent(fraction: float) -> str:
    return f"{100 * fraction:+.2f} %"


def _spread(fractions: Sequence[float]) -> str:
    return f"{100 * min(fractions):+.2f}..{100 * max(fractions):+.2f} %" if fractions else "-"


# -- bench/recovery.py ---------------------------------------------------------------------------------------


def recovery_table(results: dict[str, Any]) -> str:
    """Per scenario, each system's median and samples (seconds until training runs at the new size), the ratio of
    tuned torchrun to elasticd, the targets; then the join's pause (in total, and the longest) and the median phase
    ends. A join is judged on its pause in total (bench/recovery.py's ``join_verdict``), in files written before
    that rule too."""
    systems = [s for s in _RECOVERY_SYSTEMS if any(s in row for row in results["summary"])]
    config = results.get("config", {})
    # a sharded job recovered in place (shard mirrors), judged on issue 26's targets; before, cold restarts only
    sharded = config.get("sharded")
    in_place = bool(sharded and sharded.get("in_place"))
    # another script's job (bench/recovery.py --job): judged on issue 27's targets, as the file judged them
    script_job = bool(set(config.get("workloads") or {}) & {"plain", "trainer"})
    # elasticd's cold restart over its hot path: a column of its own where the file has it (files since issue 26)
    cold = any(row.get("ratio_cold_over_elasticd") is not None for row in results["summary"])
    scenarios = [row["scenario"] for row in results["summary"]]
    cold_ratio = " cold / elasticd: elasticd --recovery cold over hot;" if cold else ""
    lines = [
        f"{provenance(results)}; {config.get('trials')} trial(s) per system,"
        f" {results.get('duration_s', 0) / 60:.0f} min; {_recovery_setup(config, scenarios)}; seconds from the fault"
        " (a join: the joiner's spawn) to the first step at the new size; tuned / elasticd: torchrun with elasticd's"
        f" rendezvous timings over elasticd hot;{cold_ratio}"
        f" {_CONTENDED}; x: did not recover within the timeout.",
        "",
    ]
    large = sorted(
        {s for row in results["summary"] if row["scenario"] in _LARGE_SCENARIOS for s in systems if s in row}
    )
    if large and in_place:
        lines[0] += (
            f" The 1.2 GB rows (the sharded job at ~100M parameters) ran {', '.join(large)}: issue 26 compares"
            " elasticd in place with the same job's cold restart."
        )
    elif large:
        lines[0] += (
            f" The 1.2 GB rows ran {', '.join(large)} only: each restart of the cold path or torchrun re-imports torch"
            " and loads 1.2 GB, which would take 3 trials of every system past ~12 min."
        )
    body = []
    for row in results["summary"]:
        cells = [_RECOVERY_LABELS.get(row["scenario"], row["scenario"])]
        for system in systems:
            data = row.get(system)
            if data:
                samples = _samples(data.get("samples_s", []), data.get("contended"))
                cells.append(f"**{_seconds(data['median_s'])}** ({samples})")
            else:
                cells.append("n/a")
        if script_job and row["scenario"] == "join":
            target = plain_join_verdict(row)  # a join is judged on its pause in total, in files before that rule too
        elif in_place or script_job:  # issue 26's or 27's targets, as the file judged them
            target = str(row.get("target", ""))
        elif sharded:  # before shard mirrors a sharded job restarted cold in every system: no target applied
            target = "n/a (sharded: cold restarts)"
        else:
            target = _recovery_target(row)
        ratios = [_ratio(row.get("ratio_tuned_over_elasticd"))]
        ratios += [_ratio(row.get("ratio_cold_over_elasticd"))] if cold else []
        body.append([*cells, *ratios, target])
    head = ["scenario", *(f"{s} median s (samples)" for s in systems), "tuned / elasticd"]
    head += ["cold / elasticd", "target"] if cold else ["target"]
    lines += _table(head, body)
    lines += in_place_notes(results["summary"], systems, lambda scenario: _RECOVERY_LABELS.get(scenario, scenario))
    lines += _join_pauses(results, systems)
    phases = []
    for row in results["summary"]:
        for system in systems:
            if data := row.get(system):
                parts = ", ".join(f"{k} {v:.2f}" for k, v in data.get("phase_medians_s", {}).items())
                phases.append(f"- {_RECOVERY_LABELS.get(row['scenario'], row['scenario'])}, {system}: {parts}")
    if phases:
        lines += [
            "",
            "Median phase ends, seconds after the fault (or the join's start); for a join also `stall_total` (the"
            " running group's pause in total: every step's excess over a typical one, summed), `stall` (the longest"
            " single pause between two steps, less a typical step) and `ready_to_step` (the joiner's workers imported"
            " and prepared -> their first step in the group); for a loss also `step_interval` (the median interval"
            " of the 3 steps after the first at the new size), `beyond_step` (from the later of the fault and the end"
            " of a step the survivors still completed after it, to the first step's end at the new size, less one"
            " such interval: what the survivors stood still beyond the step they redo, by which issue 24 judges the"
            " 1.2 GB node loss and its ratio to tuned torchrun) and, where they completed one, `completed_after_fault`"
            " (the fault -> that step's end), all in seconds:",
            "",
            *phases,
        ]
    return "\n".join(lines) + "\n"


def _recovery_setup(config: dict[str, Any], scenarios: Sequence[str] = ()) -> str:
    """What the job was: the network and backend, the state a change in place broadcasts, the restart budget."""
    backend = config.get("backend", "gloo (CPU), one worker per node, 127.0.0.1")
    workloads = config.get("workloads")
    sharded = config.get("sharded") or {}
    if sharded and workloads and sharded.get("in_place"):
        # the sharded jobs the rows ran: the 3.2M-parameter one, and the ~100M one for the large scenarios
        ran = {"sharded_large" if sc in _LARGE_SCENARIOS else "sharded" for sc in scenarios}
        workloads = {name: w for name, w in workloads.items() if name in ran}
    elif sharded and workloads:  # --sharded before shard mirrors: every row ran the sharded job
        workloads = {"sharded": workloads["sharded"]}
    if workloads:
        state = "; ".join(
            f"{name} job: `{' '.join(w['script_args'])}`, {w['parameters']:,} parameters,"
            f" {_bytes(w['state_bytes'])} of fp32 weights and AdamW moments"
            for name, w in workloads.items()
        )
        if config.get("sharded"):
            state += (
                ", sharded by accelerate's FSDP2 path over gloo in every system's workers"
                f" ({', '.join(f'{k}={v}' for k, v in config['sharded']['env'].items())}), DCP checkpoints"
            )
        if sharded.get("in_place"):
            state += (
                "; elasticd hot recovers it in place from shard mirrors in peers' memory"
                f" (--shard-mirror-every {sharded.get('shard_mirror_every')}), elasticd-cold restarts it"
            )
    else:  # every file before the large state trained examples/train.py's default model (width 32, depth 1)
        old = Workload("small", tuple(config.get("script_args", [])), mlp_parameters(32, 1), steady_steps=10)
        state = f"`{' '.join(old.script_args)}`: {old.parameters:,} parameters, {_bytes(old.state_bytes)} of fp32"
        state += " weights and AdamW moments"
    budget = config.get("max_restarts")
    restarts = f"--max-restarts {budget} for every system" if budget is not None else "restart budget not recorded"
    # --netns: the hosts are namespaces of one machine (bench/hosts.py)
    where = f"one machine ({config['network']})" if "network" in config else "one host"
    etcd = ""
    if config.get("etcd_profile") == "default":
        etcd = "; elasticd's etcd at etcd's own timing (100 ms heartbeat, 1 s election timeout: 2 s shortest lease)"
    elif config.get("etcd_profile") == "fast":
        etcd = "; elasticd's etcd with the embedded etcd's fast elections (25 ms heartbeat, 250 ms election timeout)"
    return f"3 node processes on {where}, {backend}; {state}; {restarts}{etcd}"


def _bytes(n: int) -> str:
    if n >= 1e8:
        return f"{n / 1e9:.1f} GB"
    return f"{n / 1e6:.0f} MB" if n >= 1e6 else f"{n / 1e3:.0f} kB"


def _recovery_target(row: dict[str, Any]) -> str:
    """A join's verdict by today's rule (its pause in total) where the file has the figures; the file's otherwise."""
    if row["scenario"] == "join":
        return join_verdict(row.get("elasticd", {}).get("phase_medians_s", {})) or row.get("target", "")
    return str(row.get("target", ""))


def _join_pauses(results: dict[str, Any], systems: Sequence[str]) -> list[str]:
    """Per join scenario and system: the running group's pause in total (the figure judged), the longest single
    pause (secondary) and ready -> step, medians with every trial's sample."""
    body = []
    for scenario in _JOIN_SCENARIOS:
        for system in systems:
            mine = [
                s["milestones"]
                for s in results.get("samples", [])
                if s["scenario"] == scenario and s["system"] == system and "stall_total" in s.get("milestones", {})
            ]
            if not mine:
                continue
            cells: list[object] = [_RECOVERY_LABELS[scenario], system]
            for key in ("stall_total", "stall", "ready_to_step"):
                values = [m.get(key) for m in mine]
                known = [v for v in values if v is not None]
                median = statistics.median(known) if known else None
                text, samples = _seconds(median), ", ".join(_num(v) for v in values)  # "-": not recorded
                cells.append(f"**{text}** ({samples})" if key == "stall_total" else f"{text} ({samples})")
            body.append(cells)
    if not body:
        return []
    head = ["join", "system", "pause in total s (samples)", "longest single pause s, secondary", "ready -> step s"]
    return [
        "",
        "The running group's pause while a node joined, in total (every step's excess over the median of the up to 20"
        " steps before, summed from the spawn to the first step at 3 nodes; the 7 kB job's target,"
        f" <= {TARGET_JOIN_S:g} s, is on this figure) and the longest single pause (secondary), medians over the"
        " trials (every trial in brackets; -: not recorded):",
        "",
        *_table(head, body),
    ]


# -- bench/goodput.py ----------------------------------------------------------------------------------------


def goodput_table(results: dict[str, Any]) -> str:
    """Per system: goodput against each world size's own step time in the same run (<= 100 %), the idle capacity
    beside it, distinct steps, those step times, the window, kills, joins and the restart budget. Computed from the
    raw step lines by bench/goodput_figures.py, so a file written under the older rule (every step at the 3-node step
    time measured before the schedule) is re-rendered by today's; the figure the file stored is not shown."""
    config = results.get("config", {})
    start_nodes = config.get("start_nodes", 3)  # every schedule so far starts at --max-nodes 3
    lines = [
        f"{provenance(results)}; {config.get('minutes')} min window, a kill every {config.get('kill_every_s')} s, a"
        f" join {config.get('join_after_s')} s after each kill, {start_nodes} nodes at the start; 127.0.0.1, gloo"
        f" on CPU, `{' '.join(config.get('script_args', []))}`; {_restart_budget(config)}. goodput: distinct steps"
        " at each world size x that size's median step time in this run (capped by the seconds those steps took)"
        " / the window; idle capacity: the share of the node-seconds present (3, one fewer from a kill to the next"
        " join) not spent training at that pace, of it outside the group: nodes present but not in the group that"
        f" trained (a joiner starting, a stopped job); others: cores other processes used before the run / over the"
        f" window ({_OTHERS}).",
        "",
    ]
    head = [
        "system",
        "goodput",
        "idle capacity (outside the group)",
        "distinct steps",
        "step ms per world size",
        "window s",
        "kills",
        "joins",
        "others",
        "note",
    ]
    body = []
    for run in results["runs"]:
        figures = goodput_figures.of_run(run, start_nodes)
        if figures is None:
            cells: list[object] = ["-", "-", 0, "-"]
        else:
            cells = [
                f"**{100 * figures.goodput:.1f} %**",
                f"{100 * figures.idle_capacity:.1f} % ({100 * figures.outside_group:.1f} %)",
                sum(figures.distinct_steps.values()),
                ", ".join(f"{w} nodes {1000 * t:.0f}" for w, t in sorted(figures.step_time_s.items(), reverse=True)),
            ]
        body.append(
            [
                run.get("system"),
                *cells,
                _num(run.get("window_s"), 0),
                len(run.get("kills", [])),
                len(run.get("joins", [])),
                _others(run),
                run.get("note", ""),
            ]
        )
    return "\n".join(lines + _table(head, body)) + "\n"


def _restart_budget(config: dict[str, Any]) -> str:
    if (budget := config.get("max_restarts")) is not None:
        return f"--max-restarts {budget} for every system"
    # what bench/recovery.py passed before the shared budget (the file did not record it)
    return "unequal restart budgets: torchrun `--max-restarts 10`, elasticd its default 20 (not recorded in the file)"


# -- bench/checkpoint.py -------------------------------------------------------------------------------------


def checkpoint_table(results: dict[str, Any]) -> str:
    """Per ranks setting, a blocking and an asynchronous save: how long the loop was blocked (median and every
    save), the time to the commit, the step after the save, and asynchronous over blocking against the target."""
    config = results.get("config") or results  # files before the config key kept these at the top
    rows = results["results"]
    model = config.get("model", "linear-stack")
    if model == "text-classifier":
        model += f" ({config.get('model_size', 'tiny')})"
    if config.get("sharded"):
        model += " sharded with accelerate's FSDP2 (DCP files, one set per rank)"
    per_rank = all(row.get("bytes_per_rank") for row in rows)
    target = config.get("target_ratio", 0.10)
    first = rows[0]
    lines = [
        f"{provenance(results)}; model {model}, {first['parameters'] / 1e6:.1f}M parameters,"
        f" {first['checkpoint_bytes'] / 1e6:.0f} MB per checkpoint; median of {config.get('repeats')} saves of each"
        f" kind (every save in brackets); target: asynchronous / blocking <= {100 * target:.0f} %; others: cores"
        f" other processes used before / during that ranks setting ({_OTHERS}).",
        "",
    ]
    head = [
        "ranks",
        "save",
        "blocked s (samples)",
        "to commit s",
        "step after the save s",
        "async / blocking",
        "others",
        *(["MB each rank wrote"] if per_rank else []),
    ]
    body = []
    for row in rows:
        for kind, label in (("blocking", "blocking"), ("background", "asynchronous")):
            blocked = _samples([s["blocking_s"] for s in row[f"{kind}_samples"]], digits=3)
            ratio = ""
            if kind == "background":
                verdict = "met" if row["ratio"] <= target else "MISSED"
                ratio = f"**{100 * row['ratio']:.1f} %** ({verdict})"
            cells = [row["ranks"], label, f"**{_num(row[f'{kind}_blocking_s'], 3)}** ({blocked})"]
            cells += [_num(row[f"{kind}_total_s"], 3), _num(row[f"{kind}_step_s"], 3), ratio, _others(row)]
            if per_rank:
                cells.append(" / ".join(f"{b / 1e6:.0f}" for b in row["bytes_per_rank"]))
            body.append(cells)
    return "\n".join(lines + _table(head, body)) + "\n"


# -- bench/step_overhead.py ----------------------------------------------------------------------------------


def step_overhead_table(results: dict[str, Any]) -> str:
    """Per compute kind and ranks: the baseline's and elasticd's median steps and the overhead against the 1 %
    target; then, where the hot loop ran, the hot path against the cold loop and the baseline (target 2 %)."""
    settings = results.get("settings", {})
    rows = results["results"]
    lines = [
        f"{provenance(results)}; {settings.get('blocks')} rounds of one {settings.get('steps')}-step block per loop"
        f" after {settings.get('warmup')} warm-up steps; overhead: of the median step; rounds: of each round's block"
        " medians (the machine's noise); means: of the medians of block means; others: cores other processes used"
        f" before / during the run ({_OTHERS}).",
        "",
    ]
    target = settings.get("target", 0.01)
    head = ["compute", "ranks", "parameters", "baseline ms", "elasticd ms", f"overhead (target {100 * target:.0f} %)"]
    head += ["µs/step", "rounds", "means", "others"]
    body = []
    for row in rows:
        cells = [row["compute"], row["ranks"], f"{row['parameters'] / 1e6:.2f}M"]
        cells += [_num(1e3 * row["baseline_median_s"]), _num(1e3 * row["elasticd_median_s"])]
        cells += [f"**{_percent(row['overhead'])}**", _num(row["overhead_us"], 0), _spread(row["pair_overheads"])]
        body.append([*cells, _percent(row["mean_overhead"]), _others(row)])
    lines += _table(head, body)
    hot_rows = [row for row in rows if "hot_vs_cold" in row]
    if hot_rows:
        hot_target = settings.get("hot_target", 0.02)
        lines += [
            "",
            "With hot recovery armed (the comm hook, the failed-step guard, the watch thread, the probe listener), the"
            f" hot loop against the cold elasticd loop (the hot path's own cost) and the baseline; target"
            f" {100 * hot_target:.0f} %:",
            "",
        ]
        head = ["compute", "ranks", "baseline ms", "cold ms", "hot ms", "hot / cold", "rounds", "means"]
        head += ["hot / baseline", "rounds", "means"]
        body = []
        for row in hot_rows:
            cold, base = row["hot_vs_cold"], row["hot_vs_baseline"]
            cells = [row["compute"], row["ranks"], _num(1e3 * row["baseline_median_s"])]
            cells += [_num(1e3 * row["elasticd_median_s"]), _num(1e3 * row["hot_median_s"])]
            for c in (cold, base):
                cells += [f"**{_percent(c['overhead'])}**", _spread(c["pair_overheads"]), _percent(c["mean_overhead"])]
            body.append(cells)
        lines += _table(head, body)
        lines += ["", "CPU the hot path's threads used on rank 0 over the measured rounds, µs per hot step:", ""]
        lines += [f"- {row['compute']}, {row['ranks']} ranks: {_hot_threads(row)}" for row in hot_rows]
    return "\n".join(lines) + "\n"


def _hot_threads(row: dict[str, Any]) -> str:
    # the hook's deadline watcher, the etcd watch (and pyetcd's Python thread behind it), the probe listener
    threads = {k: v for k, v in row.get("thread_cpu_s", {}).items() if k.startswith(("elasticd-hot-", "pyetcd"))}
    steps = sum(len(block) for block in row["samples"]["hot"])
    used = ", ".join(f"{name.rsplit('_', 1)[0]} {1e6 * cpu / steps:.0f}" for name, cpu in sorted(threads.items()))
    return used or "none seen (the kernel counts 10 ms ticks)"


# -- bench/hang.py -------------------------------------------------------------------------------------------


def hang_table(results: dict[str, Any]) -> str:
    """Hang -> detection, -> restart decided, -> first step for the fixed and learned timeouts, what torchrun did
    in its watch (its timeout shown as assumed), the false-hang runs, and the median phase ends."""
    config, summary = results.get("config", {}), results["summary"]
    labels = {
        "fixed": f"elasticd, --hang-timeout {config.get('fixed_timeout_s', 2):g}",
        "auto": "elasticd, --hang-timeout auto",
    }
    lines = [
        f"{provenance(results)}; {config.get('trials')} trial(s) of each elasticd scenario, torchrun once; seconds"
        " after the hang start (rank 0's step line for the last step both ranks completed); median (every counted"
        f" trial in brackets); {_CONTENDED.replace('sample', 'trial')}; x: none within the timeout.",
        "",
    ]
    head = ["system", "hang -> detection s", "-> restart decided s", "-> first step s", "timeout in force s"]
    body: list[list[object]] = []
    for scenario in ("fixed", "auto"):
        if (r := summary.get(scenario)) is None:
            continue
        marks = r.get("contended")
        detect = f"**{_num(r['detect_median_s'])}** ({_samples(r['detect_samples_s'], marks)})"
        first = f"**{_num(r['first_step_median_s'])}** ({_samples(r['first_step_samples_s'], marks)})"
        timeouts = ", ".join(_num(v) for v in r.get("timeout_s", []))
        body.append([labels[scenario], detect, _num(r.get("restart_decided_median_s")), first, timeouts])
    if (t := summary.get("torchrun")) is not None:
        watched = f"none within the {_num(t.get('watched_s'), 0)} s watched"
        bound = t.get("assumed_bound_s", config.get("assumed_gloo_timeout_s"))
        timeout = f"no hang detection; gloo's collective timeout, {_num(bound, 0)} s (assumed, not measured)"
        body.append(["torchrun --standalone", watched, "-", watched, timeout])
    lines += _table(head, body)
    notes = []
    if (a := summary.get("auto")) is not None and "target" in a:
        notes.append(
            "Targets for auto: " + ", ".join(f"{k}: {'met' if ok else 'MISSED'}" for k, ok in a["target"].items())
        )
    if t is not None and t.get("note"):
        notes.append(f"torchrun: {t['note']}" + "".join(f"; `{x}`" for x in t.get("reactions", [])))
    lines += ["", *(f"- {n}." for n in notes)] if notes else []
    if (f := summary.get("false_hang")) is not None:
        lines += ["", *_false_hang(f, config)]
    phases = [
        f"- {labels[s]}: " + ", ".join(f"{k} {v:.2f}" for k, v in summary[s].get("phase_medians_s", {}).items())
        for s in ("fixed", "auto")
        if s in summary
    ]
    if phases:
        lines += ["", "Median phase ends, seconds after the hang start:", "", *phases]
    return "\n".join(lines) + "\n"


def _false_hang(f: dict[str, Any], config: dict[str, Any]) -> list[str]:
    every = config.get("false_hang_checkpoint_every_steps")
    lines = [
        f"False hangs: `--hang-timeout auto`, no hang, `{config.get('jitter_fault', 'jitter')}` on every rank, a"
        f" checkpoint every {every} steps; one row per run:",
        "",
    ]
    head = ["run", "steps", "step intervals s (min / median / max, max/min)", "learned timeout s (min..max)"]
    head += ["hang_detected", "hang_cleared", "hang_diagnosed", "restarts", "completed"]
    body = []
    for i, stats in enumerate(f["step_s"]):
        learned = f["auto_timeout_s"][i]

        def pick(key: str, i: int = i) -> object:
            values = f.get(key) or []
            return values[i] if i < len(values) else "-"

        intervals = (
            f"{_num(stats.get('min'))} / {_num(stats.get('median'))} / {_num(stats.get('max'))},"
            f" {_num(stats.get('max_over_min'), 1)}x"
            if stats
            else "-"
        )
        span = f"{_num(learned.get('min'))}..{_num(learned.get('max'))}" if learned else "-"
        counts = [pick(k) for k in ("hang_detected", "hang_cleared", "hang_diagnosed", "restarts", "completed")]
        body.append([i + 1, pick("steps"), intervals, span, *counts])
    acted, suspected = f.get("target_none_acted_on"), f.get("target_none_suspected")
    return [
        *lines,
        *_table(head, body),
        "",
        f"No false hang acted on: {'met' if acted else 'MISSED'}; no false suspicion either:"
        f" {'met' if suspected else 'MISSED'}.",
    ]


def _share(fraction: float | None) -> str:
    return "-" if fraction is None else f"{100 * fraction:.0f} %"


# -- bench/shard_mirror.py -----------------------------------------------------------------------------------


def shard_mirror_table(results: dict[str, Any]) -> str:
    """Per configuration (no mirrors, then every K steps): the median and mean step, the overhead of both against
    the baseline (the mean's judged against the target: it carries what only every K-th step pays), each round's
    overhead of block means, and rank 0's mirror figures per generation."""
    config, rows = results["config"], results["summary"]
    target = config.get("target", 0.05)
    state, ranks = int(config["state_bytes"]), int(config["ranks"])
    lines = [
        f"{provenance(results)}; {ranks} gloo ranks on one host, one per node; examples/train.py's MLP at width"
        f" {config['width']} and depth {config['depth']}: {config['parameters']:,} parameters, {_bytes(state)} of"
        f" fp32 weights and AdamW moments ({_bytes(state // ranks)} a rank), FSDP2 (each Linear a unit, then the"
        f" root), a global batch of {config['global_batch']} in micro-batches of {config['micro_batch']};"
        f" {config['blocks']} rounds of one {config['steps']}-step block per configuration in rotating order, each"
        f" block after an unmeasured lead-in step, warm-up steps first: {config['warmup']}. A step: wall time between"
        " the ends of consecutive steps on rank 0, the mirror's copy and any send overlapping it included; overhead:"
        f" of the mean step (judged, target {100 * target:.0f} %) and of the median; rounds: each round's overhead of"
        " block means (the machine's noise); per generation, rank 0: time in `offer` (blocking), `offer` to the"
        f" exchange's end (total), bytes sent; others: cores other processes used before / during the run"
        f" ({_OTHERS}): {_others(results)}.",
        "",
    ]
    head = ["configuration", "median step s", "mean step s", f"overhead, mean (target {100 * target:.0f} %)"]
    head += ["overhead, median", "rounds", "generations", "blocking s / generation", "total s / generation"]
    head += ["MB sent / generation"]
    body = []
    for row in rows:
        every = row["every"]
        verdict = "met" if row["overhead_mean"] <= target else "MISSED"
        mean = "-" if every == 0 else f"**{_percent(row['overhead_mean'])}** ({verdict})"
        median = "-" if every == 0 else _percent(row["overhead_median"])
        sent = row.get("bytes_per_generation")
        cells = [mirror_label(every), _num(row["median_s"], 3), _num(row["mean_s"], 3), mean, median]
        cells += ["-" if every == 0 else _spread(row["round_overheads"]), row["generations"]]
        cells += [_num(row.get("blocking_s_per_generation"), 3), _num(row.get("total_s_per_generation"), 3)]
        body.append([*cells, "-" if sent is None else _num(sent / 1e6, 1)])
    return "\n".join(lines + _table(head, body)) + "\n"
