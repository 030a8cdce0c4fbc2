"""accelerate's ``parallelism_config`` sizes fix one world size; an elastic run has many. A replicate size above 1
under FSDP is HSDP, which elasticd runs with the nodes as replicas (``worker/hybrid.py``); each size the file sets is
said at start, never silently, and the workers get none of them (accelerate would refuse any other world)."""

from __future__ import annotations

from pathlib import Path

import pytest

from elasticd.accelerate_env import worker_environment

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]  # accelerate's launch checks probe a port

CONFIG = """\
compute_environment: LOCAL_MACHINE
distributed_type: FSDP
fsdp_config:
  fsdp_version: 2
  fsdp_state_dict_type: SHARDED_STATE_DICT
mixed_precision: 'no'
num_machines: 1
num_processes: 2
parallelism_config:
  parallelism_config_dp_replicate_size: 2
  parallelism_config_dp_shard_size: 2
  parallelism_config_tp_size: 1
use_cpu: true
"""


def test_a_hybrid_shard_config_is_named_at_start_and_its_sizes_never_reach_the_workers(tmp_path: Path) -> None:
    path = tmp_path / "hsdp.yaml"
    path.write_text(CONFIG)
    found = worker_environment(path, nproc_per_node=2, max_nodes=3, has_gpu=False)
    notes = [line for line in found.overridden if line.startswith("parallelism_config")]
    assert notes == [
        "parallelism_config dp_replicate_size 2: HSDP with the nodes as replicas, as many as nodes in the round",
        "parallelism_config dp_shard_size 2: each node shards across its own workers (2, --nproc-per-node)",
    ]
    assert found.env["ELASTICD_HYBRID_SHARD"] == "1"
    assert not [k for k in found.env if "PARALLELISM" in k]
    plain = tmp_path / "fsdp.yaml"
    plain.write_text(CONFIG.split("parallelism_config:")[0] + "use_cpu: true\n")
    assert not [
        x
        for x in worker_environment(plain, nproc_per_node=2, max_nodes=3, has_gpu=False).overridden
        if "parallelism" in x
    ]
