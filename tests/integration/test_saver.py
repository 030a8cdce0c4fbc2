"""``CheckpointSaver`` with real gloo ranks under ``torchrun``: blocking and background saves write the same files as
``save_state`` and reload to the saved state; a background save blocks for less time; a rank 0 killed mid-write leaves
the previous checkpoint as the latest loadable one; a refused fence commits nothing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from elasticd.worker.checkpoints import MANIFEST, CheckpointStore
from elasticd.worker.saver import SEALED, WRITTEN
from tests.helpers import kill_tree

pytestmark = pytest.mark.integration

REPO_ROOT = Path(__file__).resolve().parents[2]
# Two ranks importing torch and accelerate on a shared 2-core machine: a run normally takes ~15 s.
RUN_TIMEOUT_S = 240
# How long the crash test waits for rank 0's writer to reach its slowed write (s).
SLOW_WRITE_TIMEOUT_S = 180
# What the worker script's patched writer sleeps for once it reaches the slowed write (s): it is killed long before.
SLOW_WRITE_SLEEP_S = 600

WORKER = textwrap.dedent(
    """
    import copy, json, os, sys, threading, time
    import torch
    from accelerate import Accelerator
    from elasticd.worker.checkpoints import CheckpointStore
    from elasticd.worker.saver import CheckpointFailedError, CheckpointSaver

    mode, root = sys.argv[1], sys.argv[2]
    accelerator = Accelerator(cpu=True)  # on a CPU-only host, accelerate ignores WORLD_SIZE without cpu=True
    sharded = mode == "sharded"
    if sharded:  # accelerate's FSDP2 path on gloo, as elasticd.attach takes it (ACCELERATE_USE_FSDP and FSDP_*)
        from elasticd.worker.fsdp import take_fsdp_path
        assert take_fsdp_path(accelerator)
    rank = accelerator.process_index
    (open(os.path.join(root, f"pid-{rank}"), "w")).write(str(os.getpid()))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)])  # 4.2M parameters
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.9**step)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)

    def emit(**fields):
        # one write per line: both ranks share this file, and print() writes the newline separately
        sys.stdout.write(json.dumps({"rank": rank, **fields}) + chr(10))
        sys.stdout.flush()

    def train(steps=1):
        for _ in range(steps):
            accelerator.backward(model(torch.randn(8, 1024)).pow(2).mean())
            optimizer.step(); scheduler.step(); optimizer.zero_grad()

    def local(x):  # this rank's shards, as plain tensors
        if isinstance(x, dict):
            return {k: local(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(local(v) for v in x)
        return x.to_local().clone() if hasattr(x, "to_local") else copy.deepcopy(x)

    def state():
        if sharded:
            from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
            weights, moments = get_model_state_dict(model), get_optimizer_state_dict(model, optimizer)
        else:
            weights, moments = accelerator.unwrap_model(model).state_dict(), optimizer.state_dict()
        return {
            "model": local(dict(weights)),
            "optimizer": local(moments),
            "scheduler": copy.deepcopy(scheduler.state_dict()),
            "rng": torch.get_rng_state(),
        }

    def same(a, b):
        if isinstance(a, torch.Tensor):
            return isinstance(b, torch.Tensor) and torch.equal(a, b)
        if isinstance(a, dict):
            return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        if isinstance(a, (list, tuple)):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        return a == b

    store = CheckpointStore(root, "run", keep=10)
    def fence(record):
        if record.step >= 3:
            raise RuntimeError(f"etcd unreachable at step {record.step}")
        return False

    def on_event(name, fields):
        emit(event=name, **fields)
        if mode == "handover" and name == "checkpoint_written" and rank == 1:
            time.sleep(float(os.environ["SLOW_WRITE_SLEEP_S"]))  # rank 1's marker never comes, as a lost rank's

    saver = CheckpointSaver(
        accelerator,
        store,
        fence=fence if mode == "fenced" else None,
        on_event=on_event,
        commit_timeout_s=60 if mode == "handover" else 300,
    )
    train()
    if mode in ("roundtrip", "sharded"):
        expected = {}
        for step, asynchronous in ((1, False), (2, False), (3, True), (4, True)):
            saver.save(step, {"world_size": accelerator.num_processes}, asynchronous=asynchronous)
            expected[step] = state()
            train(3)  # while the background write runs: the snapshot must not see these updates
        saver.wait(everyone=True)
        for cp in store.committed():
            saver.load(cp)
            emit(loaded=cp.step, equal=same(state(), expected[cp.step]))
    elif mode == "fenced":
        saver.save(1, {}, asynchronous=False)
        saver.save(2, {}, asynchronous=True)
        try:
            saver.save(3, {}, asynchronous=False)
        except CheckpointFailedError as exc:
            emit(raised=exc.error)
        saver.save(4, {}, asynchronous=True)  # a failure in the background is only reported
        saver.wait(everyone=True)
    elif mode == "crash":
        saver.save(1, {}, asynchronous=True)
        saver.wait(everyone=True)
        if rank == 0:
            torch.save(state(), os.path.join(root, "expected-1.pt"))
        accelerator.wait_for_everyone()
        import accelerate.checkpointing
        real_save = accelerate.checkpointing.save

        def slow_save(obj, f, **kwargs):
            real_save(obj, f, **kwargs)
            if threading.current_thread() is not threading.main_thread():
                emit(slow_write=os.path.basename(str(f)))
                time.sleep(float(os.environ["SLOW_WRITE_SLEEP_S"]))

        accelerate.checkpointing.save = slow_save
        saver.save(2, {}, asynchronous=True)
        emit(snapshot_returned=2)
        train(100_000)  # until rank 0 is killed
    elif mode == "handover":  # the group re-forms in place while rank 0 waits for rank 1's marker
        saver.save(1, {}, asynchronous=True)
        time.sleep(2.0)  # rank 0's writer is waiting for the marker by now
        started = time.monotonic()
        saver.regroup()
        if rank == 1:
            os._exit(0)  # its writer sleeps on: nothing to wait for
        saver.wait()
        emit(waited_s=time.monotonic() - started)
    elif mode == "load":  # one plain process, after the crash
        cp = store.latest_loadable(lambda cp, reason: emit(bad=cp.step, reason=reason))
        saver.load(cp)
        emit(loaded=cp.step, equal=same(state(), torch.load(os.path.join(root, f"expected-{cp.step}.pt"))))
    saver.close()
    """
)


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Processes a test starts (each in its own session); any still running are killed afterwards."""
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for process in started:
        kill_tree(process)


def start(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]], mode: str, ranks: int = 2, env_extra: dict | None = None
) -> Path:
    """Start the worker script in ``mode`` (under torchrun when ``ranks`` > 1); its output file."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    output = tmp_path / f"{mode}.out"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    # One intra-op thread per rank: the machine has 2 cores shared with other test runs.
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT), SLOW_WRITE_SLEEP_S=str(SLOW_WRITE_SLEEP_S))
    env.update(env_extra or {})
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"] if ranks > 1 else []
    command = [sys.executable, *launcher, str(script), mode, str(tmp_path / "ckpt")]
    (tmp_path / "ckpt").mkdir(exist_ok=True)
    with output.open("wb") as sink:
        processes.append(
            subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        )
    return output


def lines(output: Path) -> list[dict[str, Any]]:
    """The JSON lines the worker script printed (torchrun's own log lines skipped)."""
    return [json.loads(line) for line in output.read_text().splitlines() if line.startswith("{")]


def finish(process: subprocess.Popen[bytes], output: Path) -> list[dict[str, Any]]:
    assert process.wait(timeout=RUN_TIMEOUT_S) == 0, output.read_text()[-4000:]
    return lines(output)


def run_mode(tmp_path: Path, processes: list[subprocess.Popen[bytes]], mode: str) -> list[dict[str, Any]]:
    """Run the worker script in ``mode`` on two ranks to a successful end; what it printed."""
    output = start(tmp_path, processes, mode)
    return finish(processes[-1], output)


def store(tmp_path: Path) -> CheckpointStore:
    return CheckpointStore(tmp_path / "ckpt", "run")


@pytest.mark.timeout(2 * RUN_TIMEOUT_S)
def test_blocking_and_background_saves_write_save_state_files_that_reload_to_the_saved_state(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    records = run_mode(tmp_path, processes, "roundtrip")
    loaded = sorted((r["rank"], r["loaded"], r["equal"]) for r in records if "loaded" in r)
    assert loaded == [(rank, step, True) for rank in (0, 1) for step in (1, 2, 3, 4)]
    committed = {r["step"]: r for r in records if r.get("event") == "checkpoint_committed"}
    assert sorted(committed) == [1, 2, 3, 4] and all(r["rank"] == 0 for r in committed.values())
    assert not [r for r in records if r.get("event") == "checkpoint_failed"]

    checkpoints = store(tmp_path).committed()
    names = [sorted(p.name for p in cp.path.iterdir()) for cp in checkpoints]
    expected = [MANIFEST, "model.safetensors", "optimizer.bin", "random_states_0.pkl", "random_states_1.pkl"]
    assert names == [sorted([*expected, "scheduler.bin"])] * 4  # no markers left, same files either way
    assert [store(tmp_path).verify(cp) for cp in checkpoints] == [None] * 4
    assert not list((tmp_path / "ckpt" / "run").glob("*.partial"))

    sync_blocking = [committed[s]["blocking_s"] for s in (1, 2)]
    async_blocking = [committed[s]["blocking_s"] for s in (3, 4)]
    assert min(async_blocking) < min(sync_blocking), (async_blocking, sync_blocking)
    assert all(committed[s]["total_s"] >= committed[s]["blocking_s"] for s in (3, 4))


# What an accelerate config with FSDP2 and sharded state dicts gives a worker (elasticd/accelerate_env.py)
FSDP2 = {
    "ACCELERATE_USE_FSDP": "true",
    "FSDP_VERSION": "2",
    "FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT",
    "FSDP_AUTO_WRAP_POLICY": "SIZE_BASED_WRAP",
    "FSDP_MIN_NUM_PARAMS": "100000",
    "ACCELERATE_USE_CPU": "true",
}


@pytest.mark.timeout(2 * RUN_TIMEOUT_S)
def test_sharded_background_saves_stage_the_shards_and_reload_to_the_state_of_their_step(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    # accelerate's FSDP2: blocking saves are save_state's DCP files; background ones stage each rank's shards and
    # write them through DCP while the next steps train, into the same layout, reloading to the snapshot's state
    output = start(tmp_path, processes, "sharded", env_extra=FSDP2)
    records = finish(processes[-1], output)
    loaded = sorted((r["rank"], r["loaded"], r["equal"]) for r in records if "loaded" in r)
    assert loaded == [(rank, step, True) for rank in (0, 1) for step in (1, 2, 3, 4)]
    committed = {r["step"]: r for r in records if r.get("event") == "checkpoint_committed"}
    assert sorted(committed) == [1, 2, 3, 4]
    assert [committed[s]["asynchronous"] for s in (1, 2, 3, 4)] == [False, False, True, True]
    checkpoints = store(tmp_path).committed()
    names = [sorted(str(p.relative_to(cp.path)) for p in cp.path.rglob("*") if p.is_file()) for cp in checkpoints]
    shards = [
        f"{d}/{f}"
        for d in ("optimizer_0", "pytorch_model_fsdp_0")
        for f in (".metadata", "__0_0.distcp", "__1_0.distcp")
    ]
    expected = sorted([MANIFEST, *shards, "random_states_0.pkl", "random_states_1.pkl", "scheduler.bin"])
    assert names == [expected] * 4  # the same files either way, no markers left
    assert [store(tmp_path).verify(cp) for cp in checkpoints] == [None] * 4
    sync_blocking = [committed[s]["blocking_s"] for s in (1, 2)]
    async_blocking = [committed[s]["blocking_s"] for s in (3, 4)]
    assert min(async_blocking) < min(sync_blocking), (async_blocking, sync_blocking)


@pytest.mark.timeout(2 * RUN_TIMEOUT_S)
def test_refused_fence_commits_nothing_and_a_failing_fence_is_reported_without_hanging_other_ranks(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    records = run_mode(tmp_path, processes, "fenced")
    events = sorted(
        (r["event"], r["step"], r["rank"]) for r in records if r.get("event", WRITTEN) not in (WRITTEN, SEALED)
    )
    assert events == [
        ("checkpoint_failed", 3, 0),
        ("checkpoint_failed", 4, 0),
        ("checkpoint_fenced", 1, 0),
        ("checkpoint_fenced", 2, 0),
    ]
    # a failed blocking save raises on every rank (they agree on it), naming the cause where it happened
    raised = sorted((r["rank"], r["raised"]) for r in records if "raised" in r)
    assert [rank for rank, _ in raised] == [0, 1] and "etcd unreachable at step 3" in raised[0][1], raised
    assert store(tmp_path).committed() == []
    # the fence failed after it was asked: the record may exist, so each dir is kept (removed at the next start)
    partials = sorted(p.name for p in (tmp_path / "ckpt" / "run").glob("*.partial"))
    assert partials == ["step-000000000003.local.partial", "step-000000000004.local.partial"]


@pytest.mark.timeout(3 * RUN_TIMEOUT_S + SLOW_WRITE_TIMEOUT_S)
def test_rank0_killed_during_background_write_leaves_previous_checkpoint_latest_and_loadable(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    output = start(tmp_path, processes, "crash")
    deadline = time.monotonic() + SLOW_WRITE_TIMEOUT_S
    while not any(r.get("slow_write") == "model.safetensors" and r["rank"] == 0 for r in lines(output)):
        assert processes[0].poll() is None, output.read_text()[-4000:]
        assert time.monotonic() < deadline, f"rank 0 never reached the slowed write:\n{output.read_text()[-4000:]}"
        time.sleep(0.2)
    os.kill(int((tmp_path / "ckpt" / "pid-0").read_text()), signal.SIGKILL)
    assert processes[0].wait(timeout=RUN_TIMEOUT_S) != 0  # torchrun saw its rank 0 die

    checkpoints = store(tmp_path)
    partial = checkpoints.partial_path(2)
    assert (partial / "model.safetensors").is_file() and not (partial / MANIFEST).exists()
    bad: list[tuple[int, str]] = []
    latest = checkpoints.latest_loadable(lambda cp, reason: bad.append((cp.step, reason)))
    assert latest is not None and latest.step == 1 and bad == []

    load_output = start(tmp_path, processes, "load", ranks=1)
    records = finish(processes[1], load_output)
    assert [(r["loaded"], r["equal"]) for r in records if "loaded" in r] == [(1, True)]


@pytest.mark.timeout(2 * RUN_TIMEOUT_S)
def test_a_write_handed_over_while_rank0_waits_for_a_lost_ranks_marker_is_abandoned_at_once(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    records = run_mode(tmp_path, processes, "handover")
    [waited] = [r["waited_s"] for r in records if "waited_s" in r]
    assert waited < 10, records  # not the 60 s commit timeout
    abandoned = [r for r in records if r.get("event") == "checkpoint_abandoned"]
    assert [(r["rank"], r["step"], r["committer"]) for r in abandoned] == [(0, 1, True)], records
    assert not [r for r in records if r.get("event") in ("checkpoint_failed", "checkpoint_committed")]
    assert not list((tmp_path / "ckpt" / "run").glob("*.partial")) and store(tmp_path).committed() == []
