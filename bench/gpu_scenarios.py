"""bench/gpu_check.py's one-GPU scenarios: each runs ``elasticd start`` nodes (bench/gpu_jobs.py) with the worker
library and an example script, and returns records, one per figure it reports, each with its ``problem`` (None: ok).

A verdict is about what happened (recovered in place, nothing committed lost, the guard caught the NaN, the run
finished), never about how fast: the figures are reported, and judged by whoever reads them.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from bench import recovery
from bench.common import BenchTimeout, wait_until
from bench.gpu_jobs import CheckJob, Target, job
from bench.recovery import Scenario
from bench.workloads import SMALL, Workload, mlp_parameters

Record = dict[str, Any]
# One job's start (imports, etcd, the first round) on a busy machine; a state's save and load scale it up.
START_TIMEOUT_S = 180.0
STEP_TIMEOUT_S = 120.0
SAVES = 2  # committed saves measured per checkpoint job; the first has no earlier write to wait for
CHECKPOINT_EVERY = 3
STATE_STEP_S = 0.05  # stand-in compute per step of the checkpoint jobs
NAN_STEP = 4
FAULT_STEP = 12  # the device error's step: after the step-10 commit of its job (checkpoint every 5)
REPO = Path(__file__).resolve().parent.parent


def _with(workload: Workload, target: Target, env: dict[str, str] | None = None) -> Workload:
    """``workload`` on ``target``: its group on gloo (the one GPU is shared: NCCL refuses two ranks on one GPU)."""
    extra_env = tuple({**target.env(), **(env or {})}.items())
    return replace(workload, script_args=(*workload.script_args, "--process-group-backend", "gloo"), env=extra_env)


# -- node loss and join in place ---------------------------------------------------------------------------------


def elastic(target: Target, workdir: Path) -> list[Record]:
    """bench/recovery.py's join (2 -> 3 nodes) and node loss (3 -> 2, kill -9 of a whole node) of its 7 kB job,
    the model on the device and the group on gloo; figures as that benchmark's (seconds to the first step at the new
    size, phase ends, steps redone)."""
    workload = _with(SMALL, target)
    with job(workdir, "elastic", target, workload) as j:
        samples = recovery.run_trial(j, 1, [Scenario.JOIN, Scenario.NODE_LOSS])
        joins_in_place = [e for e in j.events("reconfigured") if e.get("reason") == "join"]
    records = []
    for sample in samples:
        record = {**asdict(sample), "scenario": f"elastic_{sample.scenario}"}
        problem = None
        if sample.seconds is None:
            problem = sample.note or "did not recover"
        elif sample.scenario == Scenario.JOIN and not joins_in_place:
            problem = "the join was not made in place (no reconfigured event with reason join)"
        elif sample.scenario == Scenario.NODE_LOSS and sample.survivor_workers_restarted is not False:
            problem = "a survivor's worker was replaced: recovered cold, not in place"
        elif sample.scenario == Scenario.NODE_LOSS and sample.lost_steps is None:
            problem = "no in-place report (reconfigured) after the loss"
        records.append({**record, "problem": problem})
    return records


# -- asynchronous checkpoints at a real size ---------------------------------------------------------------------


def state_workload(state_mb: int, width: int, target: Target, asynchronous: bool) -> Workload:
    """examples/train.py's MLP at ``width`` units with as many layers as make ``state_mb`` of fp32 weights and AdamW
    moments (12 bytes a parameter), global batch 2, ``STATE_STEP_S`` of stand-in compute a step."""
    per_layer = width * width + width
    depth = max(1, round(state_mb * 2**20 / 12 / per_layer)) + 1
    args = ("--width", str(width), "--depth", str(depth), "--lr", "1e-4", "--global-batch", "2", "--micro-batch", "1")
    workload = Workload(
        f"state_{state_mb}mb",
        (*args, "--epochs", "1000", "--sleep", str(STATE_STEP_S)),
        mlp_parameters(width, depth),
        steady_steps=1,
        timeout_scale=1.0 + state_mb / 1024,
    )
    return _with(workload, target, env={"ELASTICD_ASYNC_CHECKPOINTS": "1" if asynchronous else "0"})


def _saves(j: CheckJob, count: int, timeout_s: float) -> tuple[list[float], list[float]]:
    """Per committed save, what training was blocked (s) and the time to its commit (s), from the daemons'
    ``elasticd_checkpoint_duration_seconds`` histograms, read as each save lands."""
    blocking: list[float] = []
    total: list[float] = []
    seen = {"count": 0.0, "blocking": 0.0, "total": 0.0}

    def landed() -> bool | None:
        now = {"count": 0.0, "blocking": 0.0, "total": 0.0}
        for node in j.launcher.live():
            m = j.metrics(node)
            now["count"] += m.get("elasticd_checkpoint_duration_seconds_count{phase=blocking}", 0.0)
            now["blocking"] += m.get("elasticd_checkpoint_duration_seconds_sum{phase=blocking}", 0.0)
            now["total"] += m.get("elasticd_checkpoint_duration_seconds_sum{phase=total}", 0.0)
        new = int(now["count"] - seen["count"])
        if new > 0:  # more than one between two reads: their mean, once each
            blocking.extend([(now["blocking"] - seen["blocking"]) / new] * new)
            total.extend([(now["total"] - seen["total"]) / new] * new)
            seen.update(now)
        return len(blocking) >= count or None

    wait_until(landed, timeout_s, f"{count} committed saves", poll_s=0.1)
    return blocking[:count], total[:count]


def _resume_at_two(j: CheckJob, timeout_s: float) -> Record:
    """A second node joins: the cold path checkpoints the join's step and restarts both workers from the newest
    commit at world size 2. The newest commit before the join (the daemon's gauge), the step the workers resumed
    from, their first step, and the seconds from the spawn to it."""
    committed = max(int(j.metrics(n).get("elasticd_checkpoint_last_step", 0)) for n in j.launcher.live())
    joiner = j.start_node()
    first = j.wait_steps(1, timeout_s, "the first step at world size 2", world_size=2)[0]
    resumed = sorted(int(e["step"]) for e in j.events("resumed") if recovery._stamp(e) > joiner.started_at)
    return {
        "world": [1, 2],
        "committed_step_before_join": committed,
        "resumed_steps": resumed,
        "first_step": first["step"],
        "seconds": round(float(first["t"]) - joiner.started_at, 3),
    }


def checkpoint(target: Target, workdir: Path, state_mb: int, width: int) -> list[Record]:
    """For a state of ``state_mb``, on one node: what a save blocks training for, asynchronous (the device -> host
    copy into pinned buffers, then a background write) against blocking (``ELASTICD_ASYNC_CHECKPOINTS=0``), ``SAVES``
    committed saves each; then a second node joins the asynchronous job, which resumes from the newest commit at
    world size 2 (one node trains while saving: no all-reduce of the whole state over gloo in every step)."""
    figures: dict[str, Any] = {}
    resume: Record = {}
    for asynchronous in (False, True):
        workload = state_workload(state_mb, width, target, asynchronous)
        scale = workload.timeout_scale
        mode = "async" if asynchronous else "sync"
        name = f"checkpoint-{state_mb}mb-{mode}"
        with job(
            workdir, name, target, workload, recovery="cold", nodes=(1, 2), checkpoint_every=CHECKPOINT_EVERY
        ) as j:
            j.start_node()
            j.wait_steps(1, START_TIMEOUT_S * scale, "a step at world size 1", world_size=1)
            blocking, total = _saves(j, SAVES, STEP_TIMEOUT_S * scale * (SAVES + 1))
            steps = [r["t"] for r in j.step_lines() if r.get("world_size") == 1]
            gaps = [b - a for a, b in itertools.pairwise(steps)]
            figures[mode] = {
                "blocking_s": [round(v, 4) for v in blocking],
                "total_s": [round(v, 4) for v in total],
                "median_step_s": round(statistics.median(gaps), 4) if gaps else None,
            }
            if asynchronous:
                resume = _resume_at_two(j, START_TIMEOUT_S * scale)
    sync_blocking = statistics.median(figures["sync"]["blocking_s"])
    first_async = figures["async"]["blocking_s"][0]
    record = {
        "scenario": f"checkpoint_{state_mb}mb",
        "state_mb": state_mb,
        "state_bytes": workload.state_bytes,
        "parameters": workload.parameters,
        **figures,
        "first_async_over_sync_blocking": round(first_async / sync_blocking, 4) if sync_blocking > 0 else None,
        "resume": resume,
    }
    problem = None
    resumed = resume.get("resumed_steps") or []
    if len(resumed) != 2 or len(set(resumed)) != 1:
        problem = f"expected both workers to resume from one step, got {resumed}"
    elif resumed[0] < resume["committed_step_before_join"]:
        problem = f"resumed from step {resumed[0]}, older than the committed {resume['committed_step_before_join']}"
    elif resume["first_step"] != resumed[0] + 1:
        problem = f"the first step at world size 2 was {resume['first_step']}, not {resumed[0] + 1}"
    return [{**record, "problem": problem}]


# -- bf16 from accelerate's config, a NaN on the device ----------------------------------------------------------

ACCELERATE_CONFIG = """\
compute_environment: LOCAL_MACHINE
distributed_type: {kind}
mixed_precision: bf16
num_machines: 1
num_processes: 1
use_cpu: {use_cpu}
"""


def _to_the_end(
    target: Target, workdir: Path, name: str, script: str, args: tuple[str, ...], env: dict[str, str]
) -> dict[str, Any]:
    """One node trains ``script`` to its end, bf16 from the accelerate config file; what it printed and logged."""
    config = workdir / "bf16.yaml"
    config.parent.mkdir(parents=True, exist_ok=True)
    cuda = target.device == "cuda"
    kind, use_cpu = ("MULTI_GPU", "false") if cuda else ("MULTI_CPU", "true")
    config.write_text(ACCELERATE_CONFIG.format(kind=kind, use_cpu=use_cpu))
    workload = Workload(name, args, 0, steady_steps=1, env=tuple({**target.env(), **env}.items()))
    with job(workdir, name, target, workload, script, nodes=(1, 1), accelerate_config=config) as j:
        node = j.start_node()

        def done() -> dict[str, Any] | None:
            j.launcher.refresh()
            ended = [r for r in node.out_records if r.get("event") == "done"]
            if not ended and node.proc.poll() is not None:
                raise BenchTimeout(f"{name}: the node exited with {node.proc.poll()}\n{node.tail(40)}")
            return ended[0] if ended else None

        end = wait_until(done, START_TIMEOUT_S + STEP_TIMEOUT_S, f"{name}: the run's end")
        config_env: dict[str, str] = next((e.get("env", {}) for e in j.events("accelerate_config")), {})
        steps = j.step_lines()
        times = [r["t"] for r in steps]
        return {
            "start": next((r for r in node.out_records if r.get("event") == "start"), {}),
            "mixed_precision": config_env.get("ACCELERATE_MIXED_PRECISION"),
            "guard": [{"step": e.get("step"), "action": e.get("action")} for e in j.events("nonfinite_step")],
            "final_step": end.get("step"),
            "final_loss": steps[-1].get("loss") if steps else None,
            "steps_per_s": round((len(times) - 1) / (times[-1] - times[0]), 3) if len(times) > 1 else None,
        }


def bf16_nan(target: Target, workdir: Path) -> list[Record]:
    """bf16 autocast from an accelerate config file (``--accelerate-config``) on one node, to the run's end:
    examples/train.py with a NaN injected into rank 0's batch of step ``NAN_STEP`` on the device (the guard's
    verdict), and examples/text_classification.py (a BERT-style model; its token ids cannot be made NaN)."""
    fault = {"ELASTICD_FAULT": f"nan@step={NAN_STEP},rank=0"}
    train = _to_the_end(target, workdir, "bf16-train", "train.py", ("--epochs", "1", "--dataset-size", "960"), fault)
    text_args = ("--epochs", "1", "--dataset-size", "480", "--eval-size", "48")
    text = _to_the_end(target, workdir, "bf16-text", "text_classification.py", text_args, {})
    records = []
    for name, result in (("bf16_nan_train", train), ("bf16_text_classification", text)):
        start = result.pop("start")
        record = {"scenario": name, **result, "device": start.get("device"), "autocast": start.get("mixed_precision")}
        problem = None
        if result["mixed_precision"] != "bf16":
            problem = f"the workers got mixed precision {result['mixed_precision']!r}, not the config file's bf16"
        elif start.get("mixed_precision") != "bf16":
            problem = f"accelerate trained in {start.get('mixed_precision')!r}, not bf16"
        elif not str(record["device"]).startswith(target.device):
            problem = f"the model trained on {record['device']}, not {target.device}"
        elif name == "bf16_nan_train" and not any(g["step"] == NAN_STEP for g in result["guard"]):
            problem = f"the guard did not report the NaN of step {NAN_STEP}: {result['guard']}"
        elif result["final_loss"] is None or not math.isfinite(result["final_loss"]):
            problem = f"the last step's loss is {result['final_loss']}"
        records.append({**record, "problem": problem})
    return records


# -- a device error in one worker --------------------------------------------------------------------------------


def device_error(target: Target, workdir: Path) -> list[Record]:
    """2 nodes train examples/train.py; before step ``FAULT_STEP`` rank 1 indexes out of bounds on its device (on a
    GPU a real CUDA error: a device-side assert, the process's CUDA context unusable after it). The fallback
    (docs/operations.md): the worker exits with its error (``worker_failed``), its peers re-form in place without
    it, and its daemon starts a new worker process (a fresh CUDA context) that joins in place. What happened, and the
    seconds from the fault (the end of the step before it) to the survivors' next step and to the whole group's."""
    fault = f"device_error@step={FAULT_STEP},rank=1,round=0"
    workload = _with(SMALL, target, env={"ELASTICD_FAULT": fault})
    with job(workdir, "device-error", target, workload, nodes=(1, 2), checkpoint_every=5) as j:
        j.start_nodes(2)
        before = j.wait_steps(
            1, START_TIMEOUT_S, f"step {FAULT_STEP - 1} at 2 nodes", world_size=2, step=FAULT_STEP - 1
        )
        failure = wait_until(lambda: j.events("worker_failed") or None, STEP_TIMEOUT_S, "worker_failed")[0]
        fault_at = float(before[0]["t"])  # the fault fires as step FAULT_STEP begins: its peers may see it first

        def whole_again() -> list[dict[str, Any]] | None:
            later = [r for r in j.step_lines(fault_at) if r.get("world_size") == 2]
            return later or None

        whole = wait_until(whole_again, STEP_TIMEOUT_S, "a step at world size 2 after the failure")[0]
        first = j.step_lines(fault_at)[0]
        changes = [e for e in j.events("reconfigured") if recovery._stamp(e) > fault_at and "node_id" in e]
        restarts = [e for e in j.events("restart") if recovery._stamp(e) > fault_at]
        errors = [line for n in j.launcher.nodes.values() for line in n.err_lines if "out of bounds" in line]
    victim = failure.get("node_id")
    shrunk = [e for e in changes if e.get("reason") == "failure" and e.get("node_id") != victim]
    rejoined = [e for e in changes if e.get("reason") == "join" and e.get("node_id") == victim]
    record = {
        "scenario": "device_error",
        "fault_step": FAULT_STEP,
        "worker_failed": {k: failure.get(k) for k in ("node_id", "rank", "exitcode", "signal")},
        "error": errors[0].strip()[-300:] if errors else None,
        "survivors": "in_place" if shrunk else "restarted",
        "survivors_lost_steps": shrunk[0].get("lost_steps") if shrunk else None,
        "restarts": sorted(f"{e.get('node_id')}:{e.get('reason')}" for e in restarts),
        "failed_worker": "replaced, joined in place" if rejoined else "replaced, cold round",
        "seconds_to_survivors_step": round(first["t"] - fault_at, 3),
        "seconds_to_whole_group_step": round(whole["t"] - fault_at, 3),
        "whole_group_step": whole["step"],
    }
    problem = None
    if failure.get("exitcode") in (None, 0) or failure.get("signal"):
        problem = f"the worker did not exit with its error: {record['worker_failed']}"
    elif not restarts or any(e.get("node_id") != victim for e in restarts):
        problem = f"expected a restart of the failed worker's node only: {record['restarts']}"
    return [{**record, "problem": problem}]


# -- the backend's own cycles at world size 1 --------------------------------------------------------------------


def backend_cycles(target: Target, workdir: Path, backend: str, cycles: int = 5) -> list[Record]:
    """bench/gpu_backend_cycles.py in a process of its own: form -> all-reduce -> retire, ``cycles`` times, through
    elasticd's ``groups_named(backend)`` (NCCL: abort and a new communicator on the GPU)."""
    script = REPO / "bench" / "gpu_backend_cycles.py"
    env = {**os.environ, **target.env(), "PYTHONPATH": target.python_path()}
    cmd = [sys.executable, str(script), "--backend", backend, "--device", target.device, "--cycles", str(cycles)]
    started = time.monotonic()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=STEP_TIMEOUT_S, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    record: Record = {"scenario": f"backend_cycles_{backend}", "seconds": round(time.monotonic() - started, 3)}
    if done.returncode != 0 or not lines:
        return [{**record, "problem": f"exit {done.returncode}: {(done.stderr or done.stdout)[-800:]}"}]
    result = json.loads(lines[-1])
    problem = None if result.get("ok") else result.get("problem", "a cycle failed")
    return [{**record, **result, "problem": problem}]
