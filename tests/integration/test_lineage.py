"""The checkpoint lineage on a real etcd: one commit point, a token that never repeats, a reader that loads only what
the lineage records; and a real stale writer (a node frozen mid-commit while the others move on) that can never
commit or be loaded."""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import psutil
import pytest

from elasticd.endpoints import parse_endpoints
from elasticd.etcd.client import EtcdClient
from elasticd.etcd.server import EmbeddedEtcd
from elasticd.keys import RunKeys
from elasticd.lineage import CheckpointRecord, Lineage, new_token, writer_id
from elasticd.worker.checkpoints import MANIFEST, Checkpoint, CheckpointStore
from tests.helpers import etcd_value
from tests.integration.cluster import Cluster, train_args, wait_until
from tests.integration.test_accelerate_config import fsdp2_config

pytestmark = pytest.mark.integration


def _write_checkpoint(store: CheckpointStore, step: int, payload: bytes = b"weights") -> None:
    partial = store.begin(step)
    (partial / "model.bin").write_bytes(payload + str(step).encode())


def test_a_replaced_token_cannot_commit_and_the_reader_takes_only_recorded_checkpoints(
    etcd_client: EtcdClient, tmp_path: Path
) -> None:
    keys = RunKeys("lin")
    lineage = Lineage(etcd_client, keys)
    old = lineage.begin(5)
    stale = CheckpointStore(tmp_path, "lin", token=old)
    _write_checkpoint(stale, 20)
    new = lineage.begin(6)  # a new group took over while the old one was writing
    assert new != old and lineage.token() == new

    assert stale.commit(20, {}, lambda record: lineage.commit(old, record)) is None
    assert not stale.partial_path(20).exists(), "a refused writer removes its own directory"
    assert lineage.records() == []

    current = CheckpointStore(tmp_path, "lin", token=new)
    _write_checkpoint(current, 10)
    committed = current.commit(10, {}, lambda record: lineage.commit(new, record))
    assert committed is not None and committed.path.name == "step-000000000010"
    (record,) = lineage.records()
    assert (record.step, record.dir, record.token) == (10, "step-000000000010", new)
    assert json.loads(etcd_value(etcd_client, keys.checkpoint_latest))["step"] == 10

    # A committed-looking directory that the lineage does not record (copied in by hand, say) is never loaded.
    rogue = tmp_path / "lin" / "step-000000000099"
    rogue.mkdir()
    (rogue / MANIFEST).write_text(json.dumps({"step": 99, "files": {}}))
    chosen = current.resolve(lineage.records(), on_bad=lambda cp, reason: None)
    assert chosen == Checkpoint(10, committed.path)
    assert current.latest_loadable(on_bad=lambda cp, reason: None) == Checkpoint(99, rogue)  # the disk alone would


def test_tokens_never_repeat_even_when_rounds_restart_from_zero(etcd_client: EtcdClient) -> None:
    lineage = Lineage(etcd_client, RunKeys("again"))
    tokens = {lineage.begin(0) for _ in range(20)}
    assert len(tokens) == 20
    assert len({writer_id(t) for t in tokens}) == 20
    assert new_token(0) != new_token(0)


def test_a_commit_that_crashed_between_record_and_rename_is_rolled_forward(
    etcd_client: EtcdClient, tmp_path: Path
) -> None:
    lineage = Lineage(etcd_client, RunKeys("crash"))
    token = lineage.begin(1)
    store = CheckpointStore(tmp_path, "crash", token=token)
    _write_checkpoint(store, 30)

    def record_then_crash(record: CheckpointRecord) -> bool:
        assert lineage.commit(token, record)
        raise SystemExit("killed after the commit point, before the rename")

    with pytest.raises(SystemExit):
        store.commit(30, {}, record_then_crash)
    assert store.partial_path(30).is_dir() and not (tmp_path / "crash" / "step-000000000030").exists()

    # A new group starts: its cleanup keeps the recorded directory, and the reader rolls the commit forward.
    reader = CheckpointStore(tmp_path, "crash", token=lineage.begin(2))
    reader.remove_partials(keep=frozenset(r.partial for r in lineage.records()))
    chosen = reader.resolve(lineage.records(), on_bad=lambda cp, reason: pytest.fail(reason))
    assert chosen is not None and chosen.step == 30 and reader.verify(chosen) is None


def test_a_fresh_lineage_adopts_the_newest_verified_checkpoint_on_disk(etcd_client: EtcdClient, tmp_path: Path) -> None:
    lineage = Lineage(etcd_client, RunKeys("fresh"))
    store = CheckpointStore(tmp_path, "fresh")
    for step in (10, 20):
        _write_checkpoint(store, step)
        store.commit(step, {})
    (tmp_path / "fresh" / "step-000000000020" / "model.bin").write_bytes(b"rot")  # the newest no longer verifies

    def adopt() -> CheckpointRecord | None:
        found = store.latest_loadable(on_bad=lambda cp, reason: None)
        return None if found is None else store.record_for(found, "adopted")

    lineage.begin(0, adopt)
    assert [(r.step, r.token) for r in lineage.records()] == [(10, "adopted")]
    lineage.begin(1, adopt)  # a lineage that records something adopts nothing more
    assert len(lineage.records()) == 1


# -- a real stale writer ----------------------------------------------------------------------------------------


def _stopped_daemon(cluster: Cluster) -> str | None:
    for name, node in cluster.nodes.items():
        try:
            if psutil.Process(node.proc.pid).status() == psutil.STATUS_STOPPED:
                return name
        except psutil.NoSuchProcess:
            continue
    return None


@pytest.mark.timeout(420)
@pytest.mark.parametrize("model", ["replicated", "sharded"])
def test_a_node_frozen_mid_commit_is_fenced_off_and_nothing_it_wrote_is_ever_loaded(
    etcd: EmbeddedEtcd, tmp_path: Path, model: str
) -> None:
    # Rank 0 of the first round freezes its whole node (daemon and worker, SIGSTOP) with the checkpoint of step 20
    # on disk, just before asking the fence. The others find the hang, evict the frozen node, form a new round
    # (a new token) and commit newer checkpoints. Then the frozen node is thawed: its commit must be refused.
    # Sharded (accelerate's FSDP2): the frozen writer holds every rank's reported shards of step 20, sealed.
    sharded: tuple[str, ...] = ()
    if model == "sharded":
        config = tmp_path / "fsdp2.yaml"
        config.write_text(fsdp2_config())
        sharded = ("--accelerate-config", str(config))
    keys = RunKeys("stale")
    client = EtcdClient.connect(parse_endpoints(etcd.endpoint), connect_timeout_s=30)
    with Cluster(
        etcd.endpoint,
        tmp_path,
        run_id="stale",
        min_nodes=2,
        max_nodes=3,
        script_args=train_args(100, 0.05),
        # the first round waits for all three nodes, so that round 0 is the one with the frozen writer (it closes
        # as soon as the third is in, at max_nodes; the long last call only matters on a loaded machine)
        extra=("--rdzv-conf", "last_call_timeout=20", *sharded),
        env={"ELASTICD_FAULT": "freeze@commit=20,rank=0,round=0", "HF_HOME": str(tmp_path / "hf")},
    ) as cluster:
        try:
            for name in ("a", "b", "c"):
                cluster.start(name)
            frozen = wait_until(lambda: _stopped_daemon(cluster), 180, "a node frozen mid-commit")
            node = cluster.nodes[frozen]
            first = node.wait_event("rendezvous_done")
            assert first["nodes"] == 3, f"round 0 formed without all three nodes: {first}"
            stale_token = str(node.wait_event("lineage_token")["token"])
            stale_partial = tmp_path / "checkpoints" / "stale" / f"step-000000000020.{writer_id(stale_token)}.partial"

            def newer_commit() -> bool:
                return any(r.step >= 30 and r.token != stale_token for r in Lineage(client, keys).records())

            wait_until(newer_commit, 240, "the other nodes committing newer checkpoints in a new round")
            daemon = psutil.Process(node.proc.pid)
            # the worker first, its daemon once the commit was refused: thawed at once, the daemon (evicted from the
            # round meanwhile) may stop its worker before it asks the fence (seen in the suite), leaving the fence
            # untried
            for process in daemon.children(recursive=True):
                process.send_signal(signal.SIGCONT)

            def fenced() -> bool:
                return any(e.get("step") == 20 for e in node.events("checkpoint_fenced"))

            wait_until(fenced, 120, f"{frozen}: its commit of step 20 refused")
            daemon.send_signal(signal.SIGCONT)
            for other in cluster.nodes.values():
                assert other.wait(240) == 0, cluster.diagnostics()
        except AssertionError:
            raise AssertionError(cluster.diagnostics()) from None

    records = Lineage(client, keys).records()
    client.close()
    # the frozen group committed step 10 before it froze; nothing from its frozen commit on
    assert records and not [r for r in records if r.token == stale_token and r.step >= 20], [
        (r.step, r.token) for r in records
    ]
    revisions = sorted((rev, json.loads(value)["step"]) for _k, value, rev in _lineage_raw(etcd.endpoint, keys))
    steps_in_commit_order = [step for _rev, step in revisions]
    assert steps_in_commit_order == sorted(set(steps_in_commit_order)), "recorded steps must only grow"
    store = CheckpointStore(tmp_path / "checkpoints", "stale")
    kept = [r for r in records if (store.dir / r.dir).exists()]
    assert kept, "no recorded checkpoint is left on disk"
    for record in kept:
        checkpoint = Checkpoint(record.step, store.dir / record.dir)
        assert store.resolve([record], on_bad=lambda cp, reason: pytest.fail(f"{cp.path}: {reason}")) == checkpoint
    assert not stale_partial.exists(), "the stale writer's directory must be gone"
    if model == "sharded":  # what was committed is DCP shards, every rank's listed in one manifest
        files = json.loads((store.dir / kept[-1].dir / MANIFEST).read_text())["files"]
        world = json.loads((store.dir / kept[-1].dir / MANIFEST).read_text())["world_size"]
        shards = {f for f in files if f.startswith("pytorch_model_fsdp_0/__")}
        assert shards == {f"pytorch_model_fsdp_0/__{r}_0.distcp" for r in range(world)}, sorted(files)
    recorded_dirs = {str(store.dir / r.dir) for r in records}
    for name, each in cluster.nodes.items():
        for resumed in each.events("resumed"):
            assert resumed["path"] in recorded_dirs, (
                f"{name} loaded {resumed['path']}, which the lineage never recorded"
            )


def _lineage_raw(endpoint: str, keys: RunKeys) -> list[tuple[str, bytes, int]]:
    client = EtcdClient.connect(parse_endpoints(endpoint), connect_timeout_s=30)
    try:
        return client.get_prefix(keys.lineage_checkpoints_prefix)
    finally:
        client.close()


@pytest.mark.timeout(360)
def test_etcd_that_comes_back_empty_is_detected_and_the_run_keys_are_re_established(
    etcd: EmbeddedEtcd, tmp_path: Path
) -> None:
    # etcd loses its data (restarted on an empty data dir, as after a lost volume) while two nodes train. The
    # daemons must notice, form a new round that re-establishes registry, token and lineage (adopting the newest
    # verified checkpoint on disk), commit again, and let a new node in.
    keys = RunKeys("wiped")
    # Rounds before the join (round 0, round 0 again in the emptied etcd, and round 1 when the second node is back:
    # a restart there is quick, a warm start) train at 0.15 s a step, so that the run outlasts the third node's
    # start (130 steps after the commit of step 20: ~20 s); a round after those trains at full speed to the end.
    with Cluster(
        etcd.endpoint,
        tmp_path,
        run_id="wiped",
        min_nodes=2,
        max_nodes=3,
        script_args=train_args(150, 0.05),
        env={"ELASTICD_FAULT": "slow@round=0,seconds=0.1;slow@round=1,seconds=0.1"},
    ) as cluster:
        try:
            cluster.start("a"), cluster.start("b")
            client = EtcdClient.connect(parse_endpoints(etcd.endpoint), connect_timeout_s=30)
            wait_until(lambda: Lineage(client, keys).records(), 180, "a first recorded checkpoint")
            client.close()
            etcd.stop()
            shutil.rmtree(etcd.data_dir)
            etcd.start()
            # the first daemon to see its keys gone says so; the other may restart first because its worker's peer
            # went away with that restart (seen in a suite run), and re-establishes the keys all the same
            lost = wait_until(
                lambda: [e for n in ("a", "b") for e in cluster.nodes[n].events("lineage_lost")], 60, "lineage_lost"
            )
            assert all(e["current"] is None and "etcd lost" in str(e["cause"]) for e in lost), lost
            client = EtcdClient.connect(parse_endpoints(etcd.endpoint), connect_timeout_s=30)
            adopted = wait_until(
                lambda: [r for r in Lineage(client, keys).records() if r.token == "adopted"], 120, "lineage adopted"
            )

            def committed_again() -> bool:
                return any(r.step > adopted[0].step for r in Lineage(client, keys).records())

            wait_until(committed_again, 120, "a checkpoint committed after the data loss")
            joiner = cluster.start("c")

            def joined() -> bool:  # in place (the default), or through a new round
                in_place = [e for e in joiner.events("reconfigured") if e.get("world_size") == 3]
                return bool(in_place or [e for e in joiner.events("rendezvous_done") if e["nodes"] == 3])

            wait_until(joined, 120, "the new node in the group")
            client.close()
            for node in cluster.nodes.values():
                assert node.wait(240) == 0
        except AssertionError:
            raise AssertionError(cluster.diagnostics()) from None


def test_commits_land_in_step_order_and_a_retried_commit_is_taken_once(etcd_client: EtcdClient, tmp_path: Path) -> None:
    """What a commit that waited out an etcd outage meets: a newer checkpoint already the latest (refused: an older
    step never replaces it), or its own first attempt applied with the answer lost (taken, once)."""
    keys = RunKeys("order")
    lineage = Lineage(etcd_client, keys)
    token = lineage.begin(1)
    store = CheckpointStore(tmp_path, "order", token=token)
    for step in (10, 20):
        _write_checkpoint(store, step)
    older, newer = store.seal(10, {}), store.seal(20, {})
    assert lineage.commit(token, newer)
    assert not lineage.commit(token, older)  # superseded
    assert lineage.commit(token, newer)  # the same record again: a retry whose first answer was lost
    assert [r.step for r in lineage.records()] == [20]
    assert json.loads(etcd_value(etcd_client, keys.checkpoint_latest))["step"] == 20
