"""accelerate's config file through ``elasticd start``: the workers train as ``accelerate launch`` would have them.

The files are written in the format ``accelerate config`` writes; a plain accelerate script
(``scripts/precision_probe.py``) reports what its ``Accelerator`` made of its environment. ``HF_HOME`` points at the
test's directory, so accelerate's default file is the test's own (or absent), never the machine's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

PROBE = Path(__file__).parent / "scripts" / "precision_probe.py"
ELASTICD_START = (sys.executable, "-m", "elasticd", "start", "--nproc-per-node", "2", "--metrics-port", "0")

WIZARD_CPU_BF16 = """\
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: MULTI_CPU
downcast_bf16: 'no'
enable_cpu_affinity: false
machine_rank: 0
main_training_function: main
mixed_precision: bf16
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: true
"""


def fsdp2_config(mixed_precision: str = "no", fsdp: dict[str, object] | None = None) -> str:
    """``accelerate config``'s file for FSDP2 on this CPU host, each Linear its own shard unit; ``fsdp``: other
    ``fsdp_config`` values."""
    settings = {
        "fsdp_activation_checkpointing": "false",
        "fsdp_auto_wrap_policy": "SIZE_BASED_WRAP",
        "fsdp_min_num_params": 100,
        "fsdp_cpu_ram_efficient_loading": "false",
        "fsdp_offload_params": "false",
        "fsdp_reshard_after_forward": "true",
        "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        "fsdp_version": 2,
        **(fsdp or {}),
    }
    body = WIZARD_CPU_BF16.replace("distributed_type: MULTI_CPU", "distributed_type: FSDP")
    body = body.replace("mixed_precision: bf16", f"mixed_precision: '{mixed_precision}'")
    return body + "fsdp_config:\n" + "".join(f"  {k}: {v}\n" for k, v in settings.items())


def start(tmp_path: Path, *flags: str) -> tuple[subprocess.CompletedProcess[str], list[dict[str, Any]]]:
    out = tmp_path / "probe"
    out.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in {"OMP_NUM_THREADS", "ACCELERATE_MIXED_PRECISION"}}
    env.update(HF_HOME=str(tmp_path / "hf"), PYTHONUNBUFFERED="1")
    result = subprocess.run(
        [*ELASTICD_START, "--log-format", "json", "--run-id", "acc", *flags, str(PROBE), str(out)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
    )
    return result, [json.loads(p.read_text()) for p in sorted(out.glob("rank-*.json"))]


def events(stderr: str, name: str) -> list[dict[str, Any]]:
    found = [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]
    return [e for e in found if e.get("event") == name]


def test_a_bf16_config_file_makes_every_worker_train_in_bf16(tmp_path: Path) -> None:
    config = tmp_path / "accelerate.yaml"
    config.write_text(WIZARD_CPU_BF16)
    result, ranks = start(tmp_path, "--accelerate-config", str(config))
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(ranks) == 2, result.stderr[-3000:]
    for rank in ranks:
        assert rank["mixed_precision"] == "bf16" and rank["autocast_dtype"] == "torch.bfloat16", rank
        assert rank["num_processes"] == 2
    (used,) = events(result.stderr, "accelerate_config")
    assert used["path"] == str(config) and used["env"]["ACCELERATE_MIXED_PRECISION"] == "bf16"


def test_accelerate_s_default_file_is_read_when_no_file_is_named(tmp_path: Path) -> None:
    default = tmp_path / "hf" / "accelerate" / "default_config.yaml"
    default.parent.mkdir(parents=True)
    default.write_text(WIZARD_CPU_BF16)
    result, ranks = start(tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert [r["mixed_precision"] for r in ranks] == ["bf16", "bf16"]


def test_without_a_config_file_workers_run_in_full_precision_with_a_thread_count_said_once(tmp_path: Path) -> None:
    result, ranks = start(tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert [r["mixed_precision"] for r in ranks] == ["no", "no"]
    (threads,) = events(result.stderr, "worker_threads")
    assert [r["omp_num_threads"] for r in ranks] == [str(threads["omp_num_threads"])] * 2
    assert all(r["torch_threads"] == threads["omp_num_threads"] for r in ranks)
    assert "OMP_NUM_THREADS/MKL_NUM_THREADS unset" not in result.stderr  # accelerate's warning, from every worker
    assert "is deprecated" not in result.stderr  # torch's, for an old variable name


@pytest.mark.parametrize(
    ("setting", "needle"),
    [
        ("distributed_type: XLA", "distributed_type XLA"),
        ("compute_environment: AMAZON_SAGEMAKER", "compute_environment AMAZON_SAGEMAKER"),
        ("distributed_type: DEEPSPEED", "distributed_type DEEPSPEED"),
    ],
)
def test_a_config_elasticd_cannot_honour_is_one_line_and_exit_2(tmp_path: Path, setting: str, needle: str) -> None:
    key = setting.split(":")[0]
    config = tmp_path / "accelerate.yaml"
    config.write_text(
        "\n".join(line for line in WIZARD_CPU_BF16.splitlines() if not line.startswith(key)) + f"\n{setting}\n"
    )
    result, ranks = start(tmp_path, "--accelerate-config", str(config))
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"elasticd: error: --accelerate-config: {config}: ") and needle in line, line
    assert ranks == []


def test_a_named_config_file_that_is_missing_is_one_line_and_exit_2(tmp_path: Path) -> None:
    result, _ = start(tmp_path, "--accelerate-config", str(tmp_path / "nope.yaml"))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"elasticd: error: --accelerate-config: {tmp_path / 'nope.yaml'} does not exist or is not a file"
    ]


@pytest.mark.parametrize(
    ("fsdp", "needle"),
    [
        ({"fsdp_version": 1}, "fsdp_version 1: elasticd runs FSDP2 only; set fsdp_config.fsdp_version: 2"),
        ({"fsdp_state_dict_type": "LOCAL_STATE_DICT"}, "fsdp_state_dict_type LOCAL_STATE_DICT: its per-rank files"),
    ],
)
def test_an_fsdp_config_that_cannot_reshard_is_one_line_and_exit_2(
    tmp_path: Path, fsdp: dict[str, object], needle: str
) -> None:
    config = tmp_path / "accelerate.yaml"
    config.write_text(fsdp2_config(fsdp=fsdp))
    result, ranks = start(tmp_path, "--accelerate-config", str(config))
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"elasticd: error: --accelerate-config: {config}: ") and needle in line, line
    assert ranks == []
