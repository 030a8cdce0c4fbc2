"""bench/gpu_check.py's multi-GPU scenario: hot recovery on NCCL across 2+ GPUs, node loss and warm join.

**The multi-rank NCCL path (elasticd/worker/hot/backend.py's shrink and new communicator, the hook's polling, the
heal on the GPU) was written from torch's code and NCCL's documents on machines without a GPU: it is unverified
until this runs on a machine with 2+ GPUs.** NCCL refuses two ranks of one communicator on one GPU, so it needs 2
GPUs and uses 3 when it has them; with ``gloo`` it runs 3 CPU workers (how this part was tested).

Each worker is tests/integration/scripts/hot_worker.py (one process per GPU, ``cuda:LOCAL_RANK``). This process plays
the daemons, as tests/integration/test_hot_core.py does: it hosts the store, kills a worker, decides the next
membership from the survivors' announcements. Its decisions keep the survivors in their old order and name the one
with the most committed steps as the heal source, so that a node loss is a pure shrink: when every survivor says it
can shrink in place, the decision lets them (``ncclCommShrink``), else they form a new communicator. Each trial
reports which one ran. (The one-GPU scenarios of bench/gpu_check.py drive ``elasticd start`` itself.)

- ``node_loss``: ``n`` workers train; the one of rank ``victim`` gets SIGKILL. From the kill to every survivor's
  failed step (``detected_s``) and to the last survivor's first completed step at ``n - 1`` (``recovered_s``).
- ``hang``: the same, the victim SIGSTOPped instead and declared dead at once: its peers wait inside a collective
  that never completes, and the failure notice must release them (NCCL: ``ncclCommAbort`` under a running kernel).
- ``join``: ``n - 1`` workers train; a warm joiner (imported and prepared) announces itself and is admitted at a
  step boundary. The members' stall (admitting boundary to their first step at ``n``), the joiner's announcement to
  its first step.

Both check that the workers end with the same weights and that no committed step was lost or repeated.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from bench.common import text_table
from elasticd.worker.hot.backend import worker_env
from elasticd.worker.hot.heal import order_by_progress

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "tests" / "integration" / "scripts" / "hot_worker.py"
# One scenario's whole run (spawn, imports, 20-odd steps, the change, exit); the box may be busy.
SCENARIO_TIMEOUT_S = 120.0
# A trial is not started with less than this left before the check's deadline (s).
TRIAL_MIN_S = 45.0
STEADY_STEPS = 5  # committed steps every worker has before the change
STEP_SLEEP_MS = "10"


class CannotRun(Exception):
    """This machine cannot run the check (the message says why, in one line)."""


def slots_for(backend: str) -> int:
    """How many workers the scenarios use: 3, or as many GPUs as there are (at least 2) on NCCL."""
    if backend == "gloo":
        return 3
    if not dist.is_nccl_available() or torch.version.cuda is None:
        raise CannotRun(f"this torch ({torch.__version__}) is a CPU build without NCCL: install a CUDA build of torch")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < 2:
        raise CannotRun(
            f"{gpus} GPU(s) visible: the nccl check needs 2 (NCCL refuses two ranks of one communicator on one GPU)"
        )
    return min(3, gpus)


class Conductor:
    """The daemons' part for one scenario: the store, the workers, membership decisions after a failure."""

    def __init__(self, out: Path, backend: str, extra: tuple[str, ...] = ()) -> None:
        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        self.backend = backend
        self.extra = extra  # more worker options, for every worker
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.members: list[str] = []
        self.epoch = 0
        self.decisions: list[dict[str, Any]] = []
        self.declared_dead: set[str] = set()  # stopped, not exited: what the daemons' verdict says of them

    def start(self, worker_id: str, slot: int, *args: str) -> None:
        env = {**os.environ, **worker_env(os.environ)}
        env.update(OMP_NUM_THREADS="1", LOCAL_RANK=str(slot), PYTHONUNBUFFERED="1")
        cmd = [sys.executable, str(SCRIPT), "--id", worker_id, "--port", str(self.store.port), "--out", str(self.out)]
        with (self.out / f"{worker_id}.log").open("wb") as log:
            self.procs[worker_id] = subprocess.Popen(
                [*cmd, "--backend", self.backend, *self.extra, *args],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def start_group(self, ids: list[str], *args: str) -> None:
        self.members = list(ids)
        for rank, worker_id in enumerate(ids):
            self.start(
                worker_id, rank, "--rank", str(rank), "--world", str(len(ids)), "--members", ",".join(ids), *args
            )

    def progress(self, worker_id: str) -> int:
        key = f"hot/progress/{worker_id}"
        return int(json.loads(self.store.get(key))["step"]) if self.store.check([key]) else 0

    def kill(self, worker_id: str) -> float:
        killed_at = time.monotonic()
        os.killpg(self.procs[worker_id].pid, signal.SIGKILL)
        return killed_at

    def stop(self, worker_id: str) -> float:
        """SIGSTOP: a hung rank sends nothing and its peers' collectives just wait; the daemons convict it."""
        stopped_at = time.monotonic()
        os.killpg(self.procs[worker_id].pid, signal.SIGSTOP)
        self.declared_dead.add(worker_id)
        return stopped_at

    def serve(self, until: Callable[[], bool] = lambda: False) -> None:
        deadline = time.monotonic() + SCENARIO_TIMEOUT_S
        while time.monotonic() < deadline:
            if until():
                return
            self._admissions()
            self._failures()
            if all(p.poll() is not None or w in self.declared_dead for w, p in self.procs.items()):
                return
            if any(p.poll() not in (None, 0, -signal.SIGKILL) for p in self.procs.values()):
                raise RuntimeError(f"a worker failed: {self.exit_codes()}\n{self.logs()}")
            time.sleep(0.005)
        raise RuntimeError(f"the scenario did not finish in {SCENARIO_TIMEOUT_S:.0f}s\n{self.logs()}")

    def _admissions(self) -> None:
        key = f"hot/e{self.epoch}/admit"
        if self.store.check([key]):
            admit = json.loads(self.store.get(key))
            self.members = sorted(admit["ranks"], key=admit["ranks"].get)
            self.epoch += 1

    def _failures(self) -> None:
        alive = {m for m in self.members if self.procs[m].poll() is None and m not in self.declared_dead}
        dead = [m for m in self.members if m not in alive]
        notice = f"hot/e{self.epoch}/notice"
        if dead and not self.store.check([notice]):
            self.store.set(notice, f"{', '.join(dead)} died")  # the daemons' liveness verdict
        announced = {}
        for member in self.members:
            key = f"hot/e{self.epoch}/ann/{member}"
            if self.store.check([key]):
                announced[member] = json.loads(self.store.get(key))
        if not announced or not alive <= set(announced):
            return  # a live member has not seen the failure yet: wait for it, never for a timer
        order = sorted(announced, key=lambda m: announced[m]["rank"])  # the old order: a node loss is a pure shrink
        source = order.index(order_by_progress({m: announced[m]["step"] for m in order})[0])
        decision: dict[str, Any] = {"ranks": {m: r for r, m in enumerate(order)}, "world": len(order), "source": source}
        if all(a["can_shrink"] for a in announced.values()):
            decision["previous"] = [announced[m]["rank"] for m in order]
        self.store.set(f"hot/e{self.epoch}/decision", json.dumps(decision))
        self.decisions.append({**decision, "announced": announced})
        self.members = order
        self.epoch += 1

    def result(self, worker_id: str) -> dict[str, Any]:
        path = self.out / f"{worker_id}.json"
        if not path.exists():
            raise RuntimeError(f"{worker_id} left no result\n{self.logs()}")
        return dict(json.loads(path.read_text()))

    def weights(self, worker_id: str) -> dict[str, torch.Tensor]:
        return dict(torch.load(self.out / f"{worker_id}.pt", map_location="cpu"))

    def exit_codes(self) -> dict[str, int | None]:
        return {w: p.poll() for w, p in self.procs.items()}

    def logs(self) -> str:
        parts = []
        for worker_id in self.procs:
            text = (self.out / f"{worker_id}.log").read_text(errors="replace")
            parts.append(f"--- {worker_id} (exit {self.procs[worker_id].poll()}) ---\n{text[-2500:]}")
        return "\n".join(parts)

    def close(self) -> None:
        for process in self.procs.values():
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=30)


@contextlib.contextmanager
def conducted(out: Path, backend: str, extra: tuple[str, ...]) -> Iterator[Conductor]:
    c = Conductor(out, backend, extra)
    try:
        yield c
    finally:
        c.close()


def first(result: dict[str, Any], name: str, after: float = 0.0) -> dict[str, Any]:
    found = [e for e in result["events"] if e["event"] == name and e["t"] >= after]
    if not found:
        raise RuntimeError(f"{result['id']} has no {name!r} event after {after}")
    return dict(found[0])


def weights_spread(weights: list[dict[str, torch.Tensor]]) -> float:
    """The largest absolute difference of any parameter between the workers (0.0: identical)."""
    spread = 0.0
    for other in weights[1:]:
        for name, tensor in weights[0].items():
            spread = max(spread, float((other[name].float() - tensor.float()).abs().max()))
    return spread


def steps_contiguous(result: dict[str, Any]) -> bool:
    """Committed steps count up by one, except where the heal moved a member to the source's count."""
    steps = [s["step"] for s in result["steps"]]
    healed = {e["step"] for e in result["events"] if e["event"] == "healed"}
    return all(b == a + 1 or (b - 1) in healed for a, b in itertools.pairwise(steps))


def median_step_ms(result: dict[str, Any], world: int) -> float | None:
    times = [s["t"] for s in result["steps"] if s["world"] == world]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    return statistics.median(gaps) * 1000 if gaps else None


def node_loss(
    out: Path, backend: str, n: int, victim: int, extra: tuple[str, ...] = (), hang: bool = False
) -> dict[str, Any]:
    """``hang``: the victim is SIGSTOPped instead (its peers wait inside a collective: the communicator must be
    aborted under them) and declared dead at once, as the daemons' watchdog would after its timeout."""
    ids = [f"w{i}" for i in range(n)]
    with conducted(out, backend, extra) as c:
        c.start_group(ids, "--steps", "8", "--after", "15", "--expect-changes", "1", "--step-sleep-ms", STEP_SLEEP_MS)
        c.serve(until=lambda: all(c.progress(w) >= STEADY_STEPS for w in ids))
        killed_at = c.stop(ids[victim]) if hang else c.kill(ids[victim])
        c.serve()
        survivors = [w for w in ids if w != ids[victim]]
        gone = None if hang else -signal.SIGKILL  # a stopped victim is killed on the way out
        expected = {w: (gone if w == ids[victim] else 0) for w in ids}
        if c.exit_codes() != expected:
            raise RuntimeError(f"exit codes {c.exit_codes()}, expected {expected}\n{c.logs()}")
        results = {w: c.result(w) for w in survivors}
        reformed = [first(r, "reformed", killed_at) for r in results.values()]
        healed = [first(r, "healed", killed_at) for r in results.values()]
        (decision,) = c.decisions
        most = max(a["step"] for a in decision["announced"].values())
        return {
            "world": [n, n - 1],
            "victim_rank": victim,
            "detected_s": max(first(r, "failed", killed_at)["t"] for r in results.values()) - killed_at,
            "recovered_s": max(first(r, "first_step", killed_at)["t"] for r in results.values()) - killed_at,
            "reform_s": max(e["seconds"] for e in reformed),
            "heal_s": max(e["seconds"] for e in healed),
            "method": sorted({e["method"] for e in reformed}),
            "shrink_offered": "previous" in decision,
            "lost_steps": sum(most - e["step"] for e in healed),  # 0: every survivor continued from the most advanced
            "steps_contiguous": all(steps_contiguous(r) for r in results.values()),
            "step_ms_before": median_step_ms(results[survivors[0]], n),
            "step_ms_after": median_step_ms(results[survivors[0]], n - 1),
            "weights_spread": weights_spread([c.weights(w) for w in survivors]),
        }


def join(out: Path, backend: str, n: int, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    members = [f"w{i}" for i in range(n - 1)]
    common = ("--after", "15", "--expect-changes", "1", "--step-sleep-ms", STEP_SLEEP_MS)
    with conducted(out, backend, extra) as c:
        c.start_group(members, "--steps", "10", "--expect-joiner", "--join-cap", "2000", *common)
        c.start("j", n - 1, "--joiner", "--steps", "0", *common)
        c.serve(
            until=lambda: c.store.check(["hot/join/prepared/j"]) and all(c.progress(w) >= STEADY_STEPS for w in members)
        )
        c.store.set("hot/join/go", "1")
        c.serve()
        if c.exit_codes() != {w: 0 for w in [*members, "j"]}:
            raise RuntimeError(f"exit codes {c.exit_codes()}\n{c.logs()}")
        results = {w: c.result(w) for w in [*members, "j"]}
        stalls = []
        for w in members:
            admitting = first(results[w], "admitting")
            stalls.append(first(results[w], "first_step", admitting["t"])["t"] - admitting["t"])
        joiner = results["j"]
        healed = first(joiner, "healed")
        return {
            "world": [n - 1, n],
            "members_stall_s": max(stalls),
            "joiner_announced_to_first_step_s": first(joiner, "first_step")["t"] - first(joiner, "announced")["t"],
            "reform_s": max(first(r, "reformed")["seconds"] for r in results.values()),
            "heal_s": healed["seconds"],
            "heal_payload_bytes": healed["payload"],
            "joiner_first_step": joiner["steps"][0]["step"] if joiner["steps"] else None,
            "joiner_healed_to_step": healed["step"],
            "steps_contiguous": all(steps_contiguous(r) for r in results.values()),
            "step_ms_before": median_step_ms(results[members[0]], n - 1),
            "step_ms_after": median_step_ms(results[members[0]], n),
            "weights_spread": weights_spread([c.weights(w) for w in results]),
        }


def verdict(scenario: str, sample: dict[str, Any]) -> str | None:
    """What is wrong with a sample, or None."""
    if not sample["steps_contiguous"]:
        return "a committed step was lost or repeated"
    if sample["weights_spread"] > 1e-5:
        return f"the workers' weights differ by {sample['weights_spread']:.2e}"
    if scenario in ("node_loss", "hang") and sample["lost_steps"]:
        return f"{sample['lost_steps']} committed steps lost"
    if scenario == "join" and sample["joiner_first_step"] != sample["joiner_healed_to_step"] + 1:
        return "the joiner did not continue from the members' step count"
    return None


def summary(samples: dict[str, list[dict[str, Any]]]) -> str:
    figures = {
        "node_loss": ["detected_s", "recovered_s", "reform_s", "heal_s", "step_ms_before", "step_ms_after"],
        "hang": ["detected_s", "recovered_s", "reform_s", "heal_s", "step_ms_after"],
        "join": ["members_stall_s", "joiner_announced_to_first_step_s", "reform_s", "heal_s", "step_ms_after"],
    }
    rows = []
    for scenario, keys in figures.items():
        good = [s for s in samples.get(scenario, []) if "error" not in s]
        for key in keys:
            values = [s[key] for s in good if s.get(key) is not None]
            shown = [f"{v:.3f}" for v in values]
            median = f"{statistics.median(values):.3f}" if values else "-"
            rows.append([scenario, key, median, " ".join(shown)])
        methods = sorted({m for s in good for m in s.get("method", [])})
        if methods:
            rows.append([scenario, "method", "", ", ".join(methods)])
    return text_table(["scenario", "figure", "median", "samples"], rows)


def run(backend: str, logs: Path, *, trials: int, victim: int, poll: bool, deadline: float) -> dict[str, Any]:
    """Every trial of both scenarios that fits before ``deadline`` (monotonic s), on ``backend``; raises
    :class:`CannotRun` when this machine cannot. The record: workers, GPUs and every sample, each with its
    ``problem`` when it failed."""
    n = slots_for(backend)
    if not 0 <= victim < n:
        raise CannotRun(f"--victim {victim} is not a rank of {n} workers")
    extra = ("--poll",) if poll else ()
    samples: dict[str, list[dict[str, Any]]] = {"node_loss": [], "hang": [], "join": []}
    for trial in range(trials):
        for scenario in samples:
            if time.monotonic() > deadline - TRIAL_MIN_S:
                print(f"    {scenario} trial {trial + 1}: skipped, out of time")
                continue
            out = logs / f"{scenario}-{trial + 1}"
            try:
                if scenario == "join":
                    sample = join(out, backend, n, extra)
                else:
                    sample = node_loss(out, backend, n, victim, extra, hang=scenario == "hang")
                problem = verdict(scenario, sample)
            except RuntimeError as exc:
                sample, problem = {"error": str(exc)}, str(exc).splitlines()[0]
                print(str(exc)[-6000:], file=sys.stderr)
            if problem is not None:
                sample["problem"] = problem
            samples[scenario].append(sample)
            shown = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in sample.items() if k != "error"}
            print(f"    {scenario} trial {trial + 1}: {'FAILED: ' + problem if problem else 'ok'} {shown}")
    print(summary(samples))
    return {"backend": backend, "workers": n, "poll": poll, "samples": samples}
