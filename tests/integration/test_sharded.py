"""Sharded jobs (accelerate's FSDP2, from an accelerate config file) through real faults, on real daemons and etcd.

The job is examples/train.py under ``distributed_type: FSDP`` with ``fsdp_version: 2``: on this CPU host the worker
library makes accelerate take its FSDP2 path over gloo (``elasticd/worker/fsdp.py``), so ``prepare`` shards with
``fully_shard`` and ``save_state`` writes DCP shards, one set of files per rank. Cold restart is the sharded path's
recovery: every change of membership resumes from the newest committed checkpoint, resharded to the new world size.

- 4 nodes lose one to kill -9 (4 -> 3, resharded), a node joins (3 -> 4): every sample of every epoch once, the LR
  schedule of an undisturbed run, and its final weights within 1e-5 relative (fp32) or its final loss within 2 %
  (bf16: a reduction at another world size rounds differently);
- a rank killed in the middle of a sharded save: that step is never loaded, the previous commit is, no partial stays.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from elasticd.etcd.server import EmbeddedEtcd
from tests.integration.cluster import Cluster, kill_nodes, leftover_processes, read_json_lines, train_args, wait_until
from tests.integration.test_accelerate_config import fsdp2_config
from tests.integration.test_worker_library import effective_ids, expected_lr

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

STEPS, STEPS_PER_EPOCH, DATASET, GLOBAL_BATCH = 100, 10, 480, 48
REL_TOL = 1e-5
LOSS_TOL = 0.02


def _config(tmp_path: Path, mixed_precision: str) -> Path:
    config = tmp_path / "fsdp2.yaml"
    config.write_text(fsdp2_config(mixed_precision))
    return config


def _cluster(workdir: Path, etcd: str, config: Path, run_id: str, *, disturb: bool, recovery: str) -> Cluster:
    return Cluster(
        etcd,
        workdir,
        run_id=run_id,
        min_nodes=2 if disturb else 4,
        max_nodes=4,
        # the disturbed run steps slower: long enough for a restart at 3 and a joiner's start (~10 s here each)
        script_args=(
            *train_args(STEPS, 0.1 if disturb else 0.0),
            "--save-final",
            str(workdir / "final.pt"),
            "--record-ids",
            str(workdir / "ids.jsonl"),
        ),
        # every checkpoint kept: the test reads which world size wrote the ones the restarts loaded
        # mirrors at every step whatever the default: the in-place checks expect no step redone (K - 1 = 0)
        extra=(
            *("--accelerate-config", str(config), "--keep-checkpoints", "20"),
            *("--recovery", recovery, "--shard-mirror-every", "1"),
        ),
        env={"HF_HOME": str(workdir / "hf")},  # accelerate's default file is the test's (absent), never the host's
    )


def _run(
    etcd: str, workdir: Path, config: Path, *, disturb: bool, precision: str = "no", recovery: str = "hot"
) -> tuple[dict[str, torch.Tensor], list[dict]]:
    workdir.mkdir()
    names = ["sh-a", "sh-b", "sh-c", "sh-d"]
    run_id = "disturbed" if disturb else "undisturbed"
    with _cluster(workdir, etcd, config, run_id, disturb=disturb, recovery=recovery) as c:
        for name in names:
            c.start(name)
        c.wait_step(lambda s: s["world_size"] == 4 and s["step"] >= 12, timeout_s=150, what="4 workers, step 12")
        alive, lost = list(names), ""
        if disturb:
            ranks = {n: c.nodes[n].events("rendezvous_done")[-1]["group_rank"] for n in names}
            lost = next(n for n, r in ranks.items() if r == 1)
            c.nodes[lost].kill()  # 4 -> 3: in place from the mirrors (hot), or from the newest commit (cold)
            alive.remove(lost)
            at3 = c.wait_step(lambda s: s["world_size"] == 3, timeout_s=120, what="3 workers after the kill")
            c.start("sh-joiner")  # 3 -> 4
            alive.append("sh-joiner")
            c.wait_step(lambda s: s["world_size"] == 4 and s["t"] > at3["t"], timeout_s=150, what="4 again")
        for name in alive:
            assert c.nodes[name].wait(300) == 0, c.diagnostics()
        wait_until(lambda: not leftover_processes(list(c.nodes)), 15, "worker processes to exit")
        steps = c.all_steps()
        _check_the_run(
            c, steps, workdir / "ids.jsonl", disturb=disturb, precision=precision, recovery=recovery, lost=lost
        )
    return torch.load(workdir / "final.pt"), steps


def _check_the_run(
    c: Cluster, steps: list[dict], record: Path, *, disturb: bool, precision: str, recovery: str, lost: str
) -> None:
    for s in steps:
        assert s["lr"] == pytest.approx(expected_lr(s["step"]), rel=1e-9)
    ids = effective_ids(record)
    assert sorted(ids) == list(range(1, STEPS + 1)), "a step is missing"
    assert {step: len(trained) for step, trained in ids.items() if len(trained) != GLOBAL_BATCH} == {}
    for epoch in range(STEPS // STEPS_PER_EPOCH):
        seen = [i for s in range(epoch * STEPS_PER_EPOCH + 1, (epoch + 1) * STEPS_PER_EPOCH + 1) for i in ids[s]]
        assert sorted(seen) == list(range(DATASET)), f"epoch {epoch}: samples skipped or repeated"
    events = [e for n in c.nodes.values() for e in n.events()]
    sharded = [e for e in events if e["event"] == "fsdp_on_cpu"]
    assert sharded and {e["mixed_precision"] for e in sharded} == {precision}, "the job did not shard as configured"
    assert not [e for e in events if e["event"] == "hot_recovery_unsupported"]
    if disturb:
        assert {s["world_size"] for s in steps} == {3, 4}
    if disturb and recovery == "hot":
        _check_in_place(events, lost)
    elif disturb:
        resumed = [e for e in events if e["event"] == "resumed"]
        # the restart at 3 loaded a checkpoint that 4 ranks wrote, and the one at 4 one that 3 wrote
        written_by = {_manifest(Path(e["path"]))["world_size"] for e in resumed}
        assert written_by == {3, 4}, resumed


def _check_in_place(events: list[dict], lost: str) -> None:
    """The loss and the join took the sharded hot path: no worker of a surviving node restarted, nothing was loaded
    from disk after the start, the lost node's shards came from its peer's mirror with at most K = 1 step redone."""
    assert not [e for e in events if e["event"] in ("hot_fallback", "worker_failed") and e.get("node_id") != lost]
    assert not [e for e in events if e["event"] == "resumed"], "a worker loaded a checkpoint"
    reconfigured = [e for e in events if e["event"] == "reconfigured" and "lost_nodes" in e and e["rank"] == 0]
    assert [(e["reason"], e["world_size"]) for e in reconfigured] == [("failure", 3), ("join", 4)], reconfigured
    # K = 1: the step the loss interrupted, or the one before when the kill cut the newest generation's transfer
    assert all(e["lost_steps"] <= 1 for e in reconfigured), reconfigured
    # a survivor's failed step stopped its backward pass at the next collective (cutoff.py), FSDP2 reset after it:
    # no backward pass of a failed step ran to its end (one may have been cut, or the failure came before or after it)
    failed = [e for e in events if e["event"] == "step_failed"]
    assert failed and not [e for e in failed if e["backward_uncut"]], failed


def _manifest(path: Path) -> dict:
    return json.loads((path / "elasticd.json").read_text())


def _last_epoch_loss(steps: list[dict]) -> float:
    """The mean loss of the last epoch's steps, each step's last attempt (the same samples in both runs)."""
    last = {s["step"]: s["loss"] for s in steps if s["step"] > STEPS - STEPS_PER_EPOCH}
    assert len(last) == STEPS_PER_EPOCH, sorted(last)
    return sum(last.values()) / len(last)


def test_fsdp2_loses_a_node_and_gains_one_and_ends_with_an_undisturbed_run_s_weights(
    etcd: EmbeddedEtcd, tmp_path: Path
) -> None:
    config = _config(tmp_path, "no")
    reference, _ = _run(etcd.endpoint, tmp_path / "undisturbed", config, disturb=False)
    disturbed, _ = _run(etcd.endpoint, tmp_path / "disturbed", config, disturb=True)
    assert reference.keys() == disturbed.keys() and reference
    worst = max(
        ((disturbed[k] - ref).abs().max() / ref.abs().max().clamp(min=1e-12)).item() for k, ref in reference.items()
    )
    print(f"FSDP2 fp32, kill and join in place against undisturbed: largest relative difference {worst:.3e}")
    assert worst <= REL_TOL


def test_fsdp2_in_bf16_loses_a_node_and_gains_one_and_ends_at_an_undisturbed_run_s_loss(
    etcd: EmbeddedEtcd, tmp_path: Path
) -> None:
    # cold (--recovery cold): the restarts reshard a checkpoint written at another size
    config = _config(tmp_path, "bf16")
    _, reference = _run(etcd.endpoint, tmp_path / "undisturbed", config, disturb=False, precision="bf16")
    _, disturbed = _run(etcd.endpoint, tmp_path / "disturbed", config, disturb=True, precision="bf16", recovery="cold")
    ref, dis = _last_epoch_loss(reference), _last_epoch_loss(disturbed)
    print(f"FSDP2 bf16, kill and join against undisturbed: last epoch's mean loss {dis:.6f} against {ref:.6f}")
    assert dis == pytest.approx(ref, rel=LOSS_TOL)


def test_a_rank_killed_mid_sharded_save_leaves_nothing_that_is_ever_loaded(etcd: EmbeddedEtcd, tmp_path: Path) -> None:
    # Rank 1 kills itself (SIGKILL) with its shards of step 20 written and rank 0's not yet sealed: the save of step
    # 20 never commits; the restart loads step 10, removes the partial, and the run ends committed at 50, the
    # newest 3 kept (--keep-checkpoints' default).
    config = _config(tmp_path, "no")
    with Cluster(
        etcd.endpoint,
        tmp_path,
        run_id="shardkill",
        nproc_per_node=2,
        script_args=train_args(50, 0.0),
        extra=("--accelerate-config", str(config)),
        env={"HF_HOME": str(tmp_path / "hf"), "ELASTICD_FAULT": "kill@checkpoint=20,rank=1,round=0"},
    ) as c:
        node = c.start("sk-a")
        assert node.wait(180) == 0, node.tail()
        failed = node.events("worker_failed")
        assert [e["rank"] for e in failed if e["signal"] == "SIGKILL"] == [1], node.tail()
        assert {e["step"] for e in node.events("resumed")} == {10}, node.tail()  # both ranks, once
        run_dir = c.checkpoint_dir / "shardkill"
        assert sorted(p.name for p in run_dir.iterdir()) == [f"step-0000000000{n}" for n in (30, 40, 50)]
        newest = _manifest(run_dir / "step-000000000050")
        shards = sorted(f for f in newest["files"] if f.endswith(".distcp"))
        assert shards == [f"{d}/__{r}_0.distcp" for d in ("optimizer_0", "pytorch_model_fsdp_0") for r in (0, 1)]
        assert not list(run_dir.rglob("*.done*")), "a rank's marker outlived its commit"
        lines = list(read_json_lines(node.out))
        assert [e["step"] for e in lines if e.get("event") == "done"] == [50]


def test_a_torn_shard_in_the_newest_checkpoint_falls_back_to_the_one_before_resharded(tmp_path: Path) -> None:
    # One rank's DCP shard of the newest commit cut in half (a torn write its manifest entry catches): the restart,
    # at 3 processes where 2 wrote it, says so and loads the commit before it, resharded, and trains to the end.
    from tests.integration.test_daemon_run import EXAMPLE, elasticd

    config = _config(tmp_path, "no")
    args = ["start", "--metrics-port", "0", "--log-format", "json", "--run-id", "torn", "--checkpoint-every-steps"]
    args += ["10", "--accelerate-config", str(config)]
    first = elasticd(*args, "--nproc-per-node", "2", str(EXAMPLE), *train_args(20, 0.0), cwd=tmp_path, timeout_s=150)
    assert first.returncode == 0, first.stderr[-3000:]
    shard = tmp_path / "checkpoints" / "torn" / "step-000000000020" / "pytorch_model_fsdp_0" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    second = elasticd(*args, "--nproc-per-node", "3", str(EXAMPLE), *train_args(30, 0.0), cwd=tmp_path, timeout_s=150)
    assert second.returncode == 0, second.stderr[-3000:]
    events = [json.loads(line) for line in second.stderr.splitlines() if line.startswith("{")]
    unusable = [e for e in events if e.get("event") == "checkpoint_unusable"]
    assert unusable and "pytorch_model_fsdp_0/__1_0.distcp" in unusable[0]["reason"], unusable
    assert {e["step"] for e in events if e.get("event") == "resumed"} == {10}
    done = [json.loads(line) for line in second.stdout.splitlines() if '"done"' in line]
    assert [e["step"] for e in done] == [30]


def test_two_adjacent_nodes_lost_at_once_reload_the_checkpoint_in_place(etcd: EmbeddedEtcd, tmp_path: Path) -> None:
    # Ring order by rank, 0 -> 1 -> 2 -> 3 -> 0: rank 1's shards are mirrored on rank 2. With both killed together no
    # member holds rank 1's: the survivors re-form at 2 in the same processes and load the newest committed
    # checkpoint (step 10, DCP resharded from 4 ranks to 2), redo the steps since, and finish; every sample once.
    config = _config(tmp_path, "no")
    names = ["ad-a", "ad-b", "ad-c", "ad-d"]
    with _cluster(tmp_path, etcd.endpoint, config, "adjacent", disturb=True, recovery="hot") as c:
        for name in names:
            c.start(name)
        c.wait_step(lambda s: s["world_size"] == 4 and s["step"] >= 14, timeout_s=150, what="4 workers, step 14")
        ranks = {n: c.nodes[n].events("rendezvous_done")[-1]["group_rank"] for n in names}
        lost = sorted(names, key=lambda n: ranks[n])[1:3]
        survivors = [n for n in names if n not in lost]
        pids = {n: c.nodes[n].worker_pids() for n in survivors}
        kill_nodes(*(c.nodes[name] for name in lost))
        c.wait_step(lambda s: s["world_size"] == 2, timeout_s=120, what="2 workers after the kills")
        assert {n: c.nodes[n].worker_pids() for n in survivors} == pids, "a survivor's workers were restarted"
        for name in survivors:
            assert c.nodes[name].wait(300) == 0, c.diagnostics()
        events = [e for n in survivors for e in c.nodes[n].events()]
        assert not [e for e in events if e["event"] in ("hot_fallback", "worker_failed")], c.diagnostics()
        reloaded = [e for e in events if e["event"] == "reloaded_in_place"]
        assert {e["step"] for e in reloaded} == {10} and len(reloaded) == 2, reloaded
        reconfigured = [e for e in events if e["event"] == "reconfigured" and "lost_nodes" in e and e["rank"] == 0]
        assert [(e["world_size"], sorted(e["lost_nodes"])) for e in reconfigured] == [(2, sorted(lost))]
        assert reconfigured[0]["lost_steps"] >= 4  # steps 11-14 at least, redone from the checkpoint
        assert {s["world_size"] for s in c.all_steps()} == {4, 2}
        ids = effective_ids(tmp_path / "ids.jsonl")
        assert sorted(ids) == list(range(1, STEPS + 1))
        for epoch in range(STEPS // STEPS_PER_EPOCH):
            seen = [i for s in range(epoch * STEPS_PER_EPOCH + 1, (epoch + 1) * STEPS_PER_EPOCH + 1) for i in ids[s]]
            assert sorted(seen) == list(range(DATASET)), f"epoch {epoch}: samples skipped or repeated"


@pytest.mark.parametrize("fault", ["kill", "fail"])
def test_a_heal_broken_on_a_member_costs_an_epoch_and_the_commit_is_reloaded_in_place(
    etcd: EmbeddedEtcd, tmp_path: Path, fault: str
) -> None:
    # The node of rank 3 is killed (4 -> 3 from the mirrors); in that heal, as the rows are about to move, rank 1
    # kills itself (kill@heal=1,rank=1) or its heal raises and it lives on (fail@heal=1,rank=1). Every member learns
    # the heal broke (gloo's reset, or the epoch's notice), bids again, and the next epoch (at 2, or at 3 with rank 1
    # in it) cannot trust what the broken heal half moved: its members load the newest commit in place, in the same
    # processes. Without the retry the break is a hot_fallback and every worker restarts cold; without the members'
    # "broken" flag the "fail" epoch at 3 would take their live shards, of the 4-rank layout, as the 3-rank ones.
    config = _config(tmp_path, "no")
    names = ["hk-a", "hk-b", "hk-c", "hk-d"]
    cluster = _cluster(tmp_path, etcd.endpoint, config, "healbreak", disturb=True, recovery="hot")
    cluster.env["ELASTICD_FAULT"] = f"{fault}@heal=1,rank=1"
    with cluster as c:
        for name in names:
            c.start(name)
        c.wait_step(lambda s: s["world_size"] == 4 and s["step"] >= 14, timeout_s=150, what="4 workers, step 14")
        ranks = {n: c.nodes[n].events("rendezvous_done")[-1]["group_rank"] for n in names}
        by_rank = sorted(names, key=lambda n: ranks[n])
        killed, broken = by_rank[3], by_rank[1]
        survivors = [by_rank[0], by_rank[2]] if fault == "kill" else by_rank[:3]
        world = len(survivors)
        pids = {n: c.nodes[n].worker_pids() for n in survivors}
        c.nodes[killed].kill()
        c.wait_step(lambda s: s["world_size"] == world, timeout_s=120, what=f"{world} workers after the broken heal")
        assert {n: c.nodes[n].worker_pids() for n in survivors} == pids, "a survivor's workers were restarted"
        # the run trains to its end: the node whose worker died in the heal may bring one back as a joiner meanwhile
        # (not stopped here: a drain while a joiner is being admitted once stalled the group 2 minutes, a known gap)
        for name in survivors:
            assert c.nodes[name].wait(300) == 0, c.diagnostics()
        events = [e for n in survivors for e in c.nodes[n].events()]
        assert not [e for e in events if e["event"] in ("hot_fallback", "worker_failed")], c.diagnostics()
        regrouped = [e for e in events if e["event"] == "regrouped" and e["heal_attempts"] == 2]
        assert len(regrouped) == world and {e["world_size"] for e in regrouped} == {world}, regrouped
        reloaded = [e for e in events if e["event"] == "reloaded_in_place"]
        assert len(reloaded) == world and {e["step"] for e in reloaded} == {10}, reloaded
        reconfigured = [e for e in events if e["event"] == "reconfigured" and "lost_nodes" in e and e["rank"] == 0]
        lost = sorted([killed, broken] if fault == "kill" else [killed])
        assert (reconfigured[0]["world_size"], sorted(reconfigured[0]["lost_nodes"])) == (world, lost), reconfigured
        ids = effective_ids(tmp_path / "ids.jsonl")
        last = max(ids)
        assert sorted(ids) == list(range(1, last + 1)), "a step is missing"
        for epoch in range(last // STEPS_PER_EPOCH):
            seen = [i for s in range(epoch * STEPS_PER_EPOCH + 1, (epoch + 1) * STEPS_PER_EPOCH + 1) for i in ids[s]]
            assert sorted(seen) == list(range(DATASET)), f"epoch {epoch}: samples skipped or repeated"
