"""A sharded save's parts: each rank claims, fsyncs and hashes its own files; rank 0 seals with what they reported;
a checkpoint of per-rank files names the one world size it loads at. And the FSDP settings elasticd refuses."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from elasticd.accelerate_env import precheck
from elasticd.errors import ConfigError
from elasticd.layout import done_marker
from elasticd.worker.checkpoints import (
    CheckpointStore,
    cannot_reshard,
    own_files,
    per_rank_world,
    read_parts,
    write_part,
)

# what accelerate's save_state writes at 2 ranks under FSDP2 (SHARDED_STATE_DICT, DCP), as seen on this host
SHARDED_SAVE = [
    "pytorch_model_fsdp_0/__0_0.distcp",
    "pytorch_model_fsdp_0/__1_0.distcp",
    "pytorch_model_fsdp_0/.metadata",
    "optimizer_0/__0_0.distcp",
    "optimizer_0/__1_0.distcp",
    "optimizer_0/.metadata",
    "random_states_0.pkl",
    "random_states_1.pkl",
    "scheduler.bin",
]


def _write(directory: Path, names: list[str]) -> None:
    for name in names:
        path = directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(name.encode())


def test_each_rank_claims_its_shards_and_rng_and_nothing_shared(tmp_path: Path) -> None:
    # custom_checkpoint_1.pkl: rank 0's second registered object, not rank 1's
    extra = ["pytorch_model_fsdp_0_rank1.bin", "random_states_10.pkl", "custom_checkpoint_1.pkl"]
    _write(tmp_path, [*SHARDED_SAVE, *extra])
    names = {rank: [str(p.relative_to(tmp_path)) for p in own_files(tmp_path, rank)] for rank in (0, 1)}
    assert names[0] == ["optimizer_0/__0_0.distcp", "pytorch_model_fsdp_0/__0_0.distcp", "random_states_0.pkl"]
    assert names[1] == [
        "optimizer_0/__1_0.distcp",
        "pytorch_model_fsdp_0/__1_0.distcp",
        "pytorch_model_fsdp_0_rank1.bin",
        "random_states_1.pkl",
    ]


def test_rank_zero_seals_with_the_hashes_the_ranks_reported_and_hashes_only_the_rest(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, "run")
    partial = store.begin(20)
    _write(partial, SHARDED_SAVE)
    for rank in (0, 1):
        write_part(partial, rank)
    assert json.loads((partial / done_marker(1)).read_text())["optimizer_0/__1_0.distcp"] == {
        "size": len(b"optimizer_0/__1_0.distcp"),
        "sha256": hashlib.sha256(b"optimizer_0/__1_0.distcp").hexdigest(),
    }
    parts = read_parts(partial, 2)
    assert not list(partial.glob(".rank-*")), "the markers are not part of the checkpoint"
    # what a rank reported is what the manifest says, even where rank 0 would hash the file differently now
    parts["pytorch_model_fsdp_0/__1_0.distcp"] = {"size": 1, "sha256": "reported"}
    record = store.publish(store.seal(20, {"world_size": 2}, parts), None)
    assert record is not None
    files = record.path.joinpath("elasticd.json").read_text()
    manifest = json.loads(files)["files"]
    assert sorted(manifest) == sorted(SHARDED_SAVE)
    assert manifest["pytorch_model_fsdp_0/__1_0.distcp"] == {"size": 1, "sha256": "reported"}
    assert manifest["scheduler.bin"]["sha256"] == hashlib.sha256(b"scheduler.bin").hexdigest()


def test_a_missing_part_is_an_error_and_leaves_the_markers_there(tmp_path: Path) -> None:
    _write(tmp_path, SHARDED_SAVE)
    write_part(tmp_path, 0)
    with pytest.raises(FileNotFoundError):
        read_parts(tmp_path, 2)
    assert (tmp_path / done_marker(0)).exists()


def test_per_rank_model_files_name_the_world_size_they_load_at_and_dcp_shards_none(tmp_path: Path) -> None:
    _write(tmp_path, SHARDED_SAVE)
    assert per_rank_world(tmp_path) is None
    _write(tmp_path, [f"pytorch_model_fsdp_0_rank{r}.bin" for r in range(3)] + ["optimizer_0_rank2.bin"])
    assert per_rank_world(tmp_path) == 3
    assert cannot_reshard(tmp_path, 3) is None
    refusal = cannot_reshard(tmp_path, 4)
    assert refusal is not None and "loads at 3 processes only, this run has 4" in refusal


FSDP_HEAD = "compute_environment: LOCAL_MACHINE\ndistributed_type: FSDP\nuse_cpu: true\nfsdp_config:\n"


@pytest.mark.parametrize(
    ("fsdp", "needle"),
    [
        ("  fsdp_version: 1\n", "fsdp_version 1: elasticd runs FSDP2 only; set fsdp_config.fsdp_version: 2"),
        ("  fsdp_state_dict_type: FULL_STATE_DICT\n", "fsdp_version 1: elasticd runs FSDP2 only"),  # 1: the default
        ("  fsdp_version: 2\n  fsdp_state_dict_type: LOCAL_STATE_DICT\n", "LOCAL_STATE_DICT: its per-rank files"),
    ],
)
def test_fsdp1_and_a_state_dict_that_cannot_reshard_are_refused_before_torch_loads(
    tmp_path: Path, fsdp: str, needle: str
) -> None:
    config = tmp_path / "fsdp.yaml"
    config.write_text(FSDP_HEAD + fsdp)
    with pytest.raises(ConfigError) as refused:
        precheck(config)
    assert needle in str(refused.value) and str(config) in str(refused.value)


@pytest.mark.parametrize("state_dict", ["SHARDED_STATE_DICT", "FULL_STATE_DICT"])
def test_an_fsdp2_config_that_reshards_passes(tmp_path: Path, state_dict: str) -> None:
    config = tmp_path / "fsdp.yaml"
    config.write_text(FSDP_HEAD + f"  fsdp_version: 2\n  fsdp_state_dict_type: {state_dict}\n")
    precheck(config)
