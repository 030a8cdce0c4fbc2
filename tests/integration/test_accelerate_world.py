"""Under elasticd on a host without GPUs, accelerate sees the workers' whole world whether or not the script builds
``Accelerator(cpu=True)``.

accelerate counts torchrun's ``WORLD_SIZE`` on a CPU only when told to use the CPU (its ``state.py``,
``_prepare_backend``); a bare ``Accelerator()`` under plain torchrun therefore makes every rank a world of one, and
all of them write the same checkpoint directory. The daemon tells accelerate (``ACCELERATE_USE_CPU``, in the workers'
environment), so both scripts train as one world of 2: ranks 0 and 1, one checkpoint per step holding both ranks'
files. ``scripts/world_probe.py`` reports what its ``Accelerator`` saw.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from elasticd.layout import MANIFEST, checkpoint_name

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

PROBE = Path(__file__).parent / "scripts" / "world_probe.py"
STEPS = 4  # the probe's 16 samples in global batches of 4


@pytest.mark.parametrize("how", ["cpu", "default"])
def test_workers_see_a_world_of_two_with_and_without_cpu_true(tmp_path: Path, how: str) -> None:
    out = tmp_path / "probe"
    out.mkdir()
    # nothing of the caller's may tell accelerate to use the CPU: the daemon has to; no accelerate config file either
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}
    env.update(HF_HOME=str(tmp_path / "hf"), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    result = subprocess.run(
        [
            sys.executable, "-m", "elasticd", "start", "--nproc-per-node", "2", "--metrics-port", "0",
            "--log-format", "json", "--run-id", "world", "--checkpoint-every-steps", "1",
            "--keep-checkpoints", str(STEPS), str(PROBE), str(out), how,
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = {int(p.stem.removeprefix("rank-")): json.loads(p.read_text()) for p in out.glob("rank-*.json")}
    assert sorted(ranks) == [0, 1], result.stderr[-3000:]
    for rank, seen in ranks.items():
        assert seen == {
            "num_processes": 2,
            "process_index": rank,
            "distributed_type": "DistributedType.MULTI_CPU",
            "steps": STEPS,
        }, (rank, seen)
    # one checkpoint per step, written by the world of two together: both ranks' RNG states in each, none alone
    run_dir = tmp_path / "checkpoints" / "world"
    assert sorted(p.name for p in run_dir.iterdir()) == [checkpoint_name(s) for s in range(1, STEPS + 1)]
    for step in range(1, STEPS + 1):
        manifest = json.loads((run_dir / checkpoint_name(step) / MANIFEST).read_text())
        assert manifest["world_size"] == 2, manifest
        assert {"random_states_0.pkl", "random_states_1.pkl"} <= set(manifest["files"]), manifest["files"]
