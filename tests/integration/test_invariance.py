"""Invariance: the same deterministic job, undisturbed on 4 workers or taken through kill → 3 → join → 4, ends with
the same parameters (within 1e-5 relative: only the order of floating-point sums differs between world sizes)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.integration.cluster import Cluster, train_args

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

STEPS = 80
REL_TOL = 1e-5
SLOW_UNTIL_JOIN = "slow@round=0,seconds=0.28;slow@round=1,seconds=0.28"


def final_weights(etcd: str, workdir: Path, disturb: bool) -> dict[str, torch.Tensor]:
    workdir.mkdir()
    out = workdir / "final.pt"
    names = [f"iv-{'d' if disturb else 'u'}{i}" for i in range(4)]
    with Cluster(
        etcd,
        workdir,
        run_id="disturbed" if disturb else "undisturbed",
        min_nodes=3,
        max_nodes=4,
        script_args=(*train_args(STEPS, 0.02), "--save-final", str(out)),
        # The disturbed run trains slowly (0.3 s a step) until the join, so that a node joins while three workers
        # train: round 0 (4 workers, killed at step 13+) and round 1 (3 workers). Round 2, after the join, needs no
        # wait for anything and trains at full speed. A sleep changes no arithmetic.
        env={"ELASTICD_FAULT": SLOW_UNTIL_JOIN} if disturb else None,
    ) as c:
        for name in names:
            c.start(name)
        c.wait_step(lambda s: s["world_size"] == 4 and s["step"] >= 3, what="4 workers")
        alive = list(names)
        if disturb:
            c.wait_step(lambda s: s["step"] >= 13, what="step 13")
            c.nodes[names[1]].kill()  # 4 -> 3, losing the steps since the checkpoint of step 10
            alive.remove(names[1])
            c.wait_step(lambda s: s["world_size"] == 3, timeout_s=60, what="3 workers")
            c.start("iv-joiner")  # 3 -> 4
            alive.append("iv-joiner")
            c.wait_step(lambda s: s["world_size"] == 4 and s["step"] > 13, timeout_s=90, what="4 workers again")
        for name in alive:
            assert c.nodes[name].wait(240) == 0, c.diagnostics()
        sizes = {s["world_size"] for s in c.all_steps()}
        assert sizes == ({3, 4} if disturb else {4})
    return torch.load(out)


def test_disturbed_run_ends_with_the_parameters_of_the_undisturbed_one(etcd, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    reference = final_weights(etcd.endpoint, tmp_path / "undisturbed", disturb=False)
    disturbed = final_weights(etcd.endpoint, tmp_path / "disturbed", disturb=True)
    assert reference.keys() == disturbed.keys()
    worst = 0.0
    for name, ref in reference.items():
        rel = ((disturbed[name] - ref).abs().max() / ref.abs().max().clamp(min=1e-12)).item()
        worst = max(worst, rel)
    print(f"largest relative parameter difference: {worst:.3e}")
    assert worst <= REL_TOL
