"""HSDP under elasticd (accelerate's hybrid shard: ``parallelism_config_dp_replicate_size`` above 1): each node shards
the model across its own two workers and the nodes are replicas (``elasticd/worker/hybrid.py``), on real daemons.

Two nodes of two workers; one is killed (4 -> 2 workers: one replica left), another joins (back to 2 replicas).
The run ends with the weights of an undisturbed hybrid run (fp32, within 1e-5 relative), every sample of every epoch
once, the LR schedule of an undisturbed run. Without the replicas' all-reduce (``ReplicaReduce``) each node trains
on its own samples only and the weights end 83 % apart.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from elasticd.etcd.server import EmbeddedEtcd
from tests.integration.cluster import Cluster, leftover_processes, train_args, wait_until
from tests.integration.test_accelerate_config import fsdp2_config
from tests.integration.test_worker_library import effective_ids, expected_lr

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

STEPS, STEPS_PER_EPOCH, DATASET = 60, 10, 480
REL_TOL = 1e-5
HYBRID = "parallelism_config:\n  parallelism_config_dp_replicate_size: 2\n  parallelism_config_dp_shard_size: 2\n"


def _run(etcd: str, workdir: Path, *, disturb: bool, recovery: str = "hot") -> dict[str, torch.Tensor]:
    workdir.mkdir()
    config = workdir / "hsdp.yaml"
    config.write_text(fsdp2_config("no") + HYBRID)
    with Cluster(
        etcd,
        workdir,
        run_id="hsdp-disturbed" if disturb else "hsdp",
        min_nodes=1 if disturb else 2,
        max_nodes=2,
        nproc_per_node=2,
        script_args=(
            *train_args(STEPS, 0.25 if disturb else 0.0),  # long enough for a joiner to start under load
            *("--save-final", str(workdir / "final.pt"), "--record-ids", str(workdir / "ids.jsonl")),
        ),
        extra=("--accelerate-config", str(config), "--keep-checkpoints", "20", "--recovery", recovery),
        env={"HF_HOME": str(workdir / "hf")},
    ) as c:
        names = ["hy-a", "hy-b"]
        for name in names:
            c.start(name)
        c.wait_step(lambda s: s["world_size"] == 4 and s["step"] >= 12, timeout_s=150, what="4 workers, step 12")
        if disturb:
            pids = c.nodes["hy-a"].worker_pids()
            c.nodes["hy-b"].kill()
            names.remove("hy-b")
            at2 = c.wait_step(lambda s: s["world_size"] == 2, timeout_s=120, what="one node left")
            if recovery == "hot":
                assert c.nodes["hy-a"].worker_pids() == pids, "the surviving node's workers were restarted"
            c.start("hy-c")
            names.append("hy-c")
            c.wait_step(lambda s: s["world_size"] == 4 and s["t"] > at2["t"], timeout_s=150, what="two nodes again")
        for name in names:
            assert c.nodes[name].wait(300) == 0, c.diagnostics()
        wait_until(lambda: not leftover_processes(list(c.nodes)), 15, "worker processes to exit")
        events = [e for n in c.nodes.values() for e in n.events()]
        hybrid = [e for e in events if e["event"] == "hybrid_shard"]
        assert hybrid and {e["per_node"] for e in hybrid} == {2}, "the job did not shard inside the nodes"
        steps = c.all_steps()
        if disturb and recovery == "hot":  # in place: the survivor's processes, nothing from disk, no step redone
            assert not [e for e in events if e["event"] in ("hot_fallback", "worker_failed", "resumed")]
            reconfigured = [e for e in events if e["event"] == "reconfigured" and "lost_nodes" in e and e["rank"] == 0]
            assert [(e["reason"], e["world_size"]) for e in reconfigured] == [("failure", 2), ("join", 4)]
            assert all(e["lost_steps"] <= 1 for e in reconfigured), reconfigured
            # the survivor kept its shards (nothing moved); the joiner's workers took theirs from it
            assert reconfigured[0]["heal_bytes"] == 0, reconfigured
            joined = c.nodes["hy-c"].events("regrouped")
            assert len(joined) == 2 and all(e["heal_bytes"] > 0 for e in joined), joined
        else:
            assert {e["nodes"] for e in hybrid} == ({1, 2} if disturb else {2})
    for s in steps:
        assert s["lr"] == pytest.approx(expected_lr(s["step"]), rel=1e-9)
    ids = effective_ids(workdir / "ids.jsonl")
    assert sorted(ids) == list(range(1, STEPS + 1)), "a step is missing"
    for epoch in range(STEPS // STEPS_PER_EPOCH):
        seen = [i for s in range(epoch * STEPS_PER_EPOCH + 1, (epoch + 1) * STEPS_PER_EPOCH + 1) for i in ids[s]]
        assert sorted(seen) == list(range(DATASET)), f"epoch {epoch}: samples skipped or repeated"
    return torch.load(workdir / "final.pt")


@pytest.mark.parametrize("recovery", ["hot", "cold"])
def test_hsdp_loses_a_node_and_gains_one_and_ends_with_an_undisturbed_run_s_weights(
    etcd: EmbeddedEtcd, tmp_path: Path, recovery: str
) -> None:
    reference = _run(etcd.endpoint, tmp_path / "undisturbed", disturb=False)
    disturbed = _run(etcd.endpoint, tmp_path / "disturbed", disturb=True, recovery=recovery)
    assert reference.keys() == disturbed.keys() and reference
    worst = max(
        ((disturbed[k] - ref).abs().max() / ref.abs().max().clamp(min=1e-12)).item() for k, ref in reference.items()
    )
    print(f"HSDP fp32 ({recovery}), kill and join against undisturbed: largest relative difference {worst:.3e}")
    assert worst <= REL_TOL
