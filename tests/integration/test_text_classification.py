"""examples/text_classification.py (a transformers classifier, bf16 from accelerate's config file) elastically: three
nodes, one killed (the others re-form in place), a new one joins; every step once, the run resumes and finishes,
and the model it trained classifies held-out sentences."""

from __future__ import annotations

from pathlib import Path

import pytest

from elasticd.etcd.server import EmbeddedEtcd
from tests.integration.cluster import ROOT, Cluster, read_json_lines
from tests.integration.test_accelerate_config import WIZARD_CPU_BF16
from tests.integration.test_worker_library import effective_ids

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

EXAMPLE = ROOT / "examples" / "text_classification.py"
STEPS, GLOBAL_BATCH = 120, 48  # 3 epochs of 1920 sentences in global batches of 48


def test_the_text_classifier_trains_through_a_node_loss_and_a_join(etcd: EmbeddedEtcd, tmp_path: Path) -> None:
    config = tmp_path / "accelerate.yaml"
    config.write_text(WIZARD_CPU_BF16)
    model_dir = tmp_path / "trained"
    record = tmp_path / "ids.jsonl"
    args = (
        "--epochs", "3", "--dataset-size", "1920", "--sleep", "0.1", "--save-pretrained", str(model_dir),
        "--record-ids", str(record),
    )  # fmt: skip
    with Cluster(
        etcd.endpoint,
        tmp_path,
        run_id="text",
        min_nodes=2,
        max_nodes=3,
        script=EXAMPLE,
        script_args=args,
        extra=("--accelerate-config", str(config)),
    ) as c:
        for name in ("tc-a", "tc-b", "tc-c"):
            c.start(name)
        c.wait_step(lambda s: s["world_size"] == 3 and s["step"] >= 10, timeout_s=150, what="3 workers at step 10")
        # not rank 0's node: its step lines are the run's record (a killed rank 0 may print a step the others redo)
        ranks = {n: c.nodes[n].events("rendezvous_done")[-1]["group_rank"] for n in ("tc-a", "tc-b", "tc-c")}
        victim = next(n for n, r in ranks.items() if r == 1)
        c.nodes[victim].kill()
        c.wait_step(lambda s: s["world_size"] == 2, timeout_s=60, what="2 workers after the kill")
        c.start("tc-d")
        c.wait_step(lambda s: s["world_size"] == 3 and s["step"] > 20, timeout_s=120, what="3 workers after the join")
        for name in sorted({"tc-a", "tc-b", "tc-c", "tc-d"} - {victim}):
            assert c.nodes[name].wait(200) == 0, c.diagnostics()

        steps = c.all_steps()
        assert sorted(s["step"] for s in steps) == list(range(1, STEPS + 1)), c.changes()
        assert {s["world_size"] for s in steps} == {2, 3}
        # the global batch holds at 2 and 3: the sentences the ranks recorded for each step, not the step line's own
        # arithmetic (1920 sentences in batches of 48: no step is padded)
        trained = effective_ids(record)
        assert sorted(trained) == list(range(1, STEPS + 1))
        assert {step: len(ids) for step, ids in trained.items() if len(ids) != GLOBAL_BATCH} == {}
        lines = [line for n in c.nodes.values() for line in read_json_lines(n.out)]
        assert {e["mixed_precision"] for e in lines if e.get("event") == "start"} == {"bf16"}
        (done,) = [e for e in lines if e.get("event") == "done"]
        assert done["step"] == STEPS and done["accuracy"] >= 0.9, done
        assert (model_dir / "model.safetensors").is_file() and (model_dir / "tokenizer.json").is_file()
        committed = sorted((c.checkpoint_dir / "text").glob("step-*"))
        assert committed and (committed[-1] / "model.safetensors").is_file()  # save_state's safetensors


def test_the_text_classifier_trains_sharded_with_the_fsdp2_example_config(etcd: EmbeddedEtcd, tmp_path: Path) -> None:
    # examples/fsdp2.yaml as the README gives it: FSDP2 in bf16, one shard unit per BertLayer, DCP checkpoints
    model_dir = tmp_path / "trained"
    args = ("--epochs", "1", "--dataset-size", "1920", "--save-pretrained", str(model_dir))
    with Cluster(
        etcd.endpoint,
        tmp_path,
        run_id="sharded-text",
        nproc_per_node=2,
        script=EXAMPLE,
        script_args=args,
        extra=("--accelerate-config", str(ROOT / "examples" / "fsdp2.yaml")),
        env={"HF_HOME": str(tmp_path / "hf")},
    ) as c:
        node = c.start("st-a")
        assert node.wait(240) == 0, node.tail()
        (sharded,) = node.events("fsdp_on_cpu")
        assert sharded["mixed_precision"] == "bf16"
        lines = list(read_json_lines(node.out))
        (done,) = [e for e in lines if e.get("event") == "done"]
        assert done["step"] == 40 and done["accuracy"] >= 0.9, done
        assert (model_dir / "model.safetensors").is_file()
        committed = sorted((c.checkpoint_dir / "sharded-text").glob("step-*"))
        shards = sorted(p.name for p in (committed[-1] / "pytorch_model_fsdp_0").iterdir())
        assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp"]
