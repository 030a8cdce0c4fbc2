"""A background checkpoint write in flight when the group re-forms in place ends committed, fenced or abandoned:
never lost silently, never leaving its ``.partial`` directory, and the training goes on in place.

Real ``elasticd start`` nodes (3, one worker each, ``--recovery hot``) train ``scripts/heavy_checkpoint_train.py``:
examples/train.py with a 256 MB object registered for checkpointing, so rank 0's background writer takes seconds
over each checkpoint. The test waits until a write is in flight for real (the other ranks' markers are in the
partial directory, rank 0's is not: rank 0 is still writing), then kills a node with SIGKILL. The survivors re-form
in place, with a new fencing token, while the write goes on.

- ``writer-survives``: the node of group rank 2 dies; rank 0's writer is handed over and must end as the old
  group's write (committed, or refused by the fence, or abandoned), its directory gone either way.
- ``writer-lost``: rank 0's node dies mid-write; its directory (the other ranks' files in it) is left by a writer
  that no longer exists, and the new group's rank 0 removes it once every member's earlier write has ended.

A blocking save (``ELASTICD_ASYNC_CHECKPOINTS=0``) has the same window inside its own collectives: the other ranks
wait in the save's agreement while rank 0 writes. A node lost then fails that agreement; the step fails in place
like any other (``saver.py``, ``on_group_failure``), instead of the worker's end and a cold restart:

- ``committer-lost``: rank 0's node is killed (SIGKILL): its peers see their connections reset;
- ``frozen-peer``: rank 2's node is frozen (SIGSTOP, daemon and worker): nothing resets, as for a node on another
  host that lost power or its link. The others leave the agreement on the failure notice (the frozen node's
  liveness lease lapses), not on gloo's timeout minutes later: the notice reaches a rank in a save's agreement too
  (``HotSession.step_failed``), which no nudge of the all-reduce hook does.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from elasticd.etcd.client import EtcdClient
from elasticd.etcd.server import EmbeddedEtcd
from elasticd.keys import RunKeys
from elasticd.layout import done_marker
from elasticd.lineage import Lineage
from elasticd.worker.saver import FAILED_ELSEWHERE, GROUP_FAILED
from tests.integration.cluster import Cluster, Node, train_args, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

SCRIPT = Path(__file__).parent / "scripts" / "heavy_checkpoint_train.py"
# Rank 0's share of each checkpoint: ~1-3 s to write on a busy 2-core host, the recovery in place ~0.2-1 s.
BALLAST_MB = 256


def _in_flight(run_dir: Path, world_size: int) -> Path | None:
    """A partial directory whose every rank but 0 has written its part while rank 0 still writes its own."""
    if not run_dir.is_dir():
        return None
    for partial in run_dir.glob("step-*.partial"):
        others = all((partial / done_marker(rank)).exists() for rank in range(1, world_size))
        if others and not (partial / done_marker(0)).exists():
            return partial
    return None


def _worker_events(nodes: list[Node], name: str) -> list[dict[str, Any]]:
    """The workers' own events (their lines share the daemon's stderr, without its node id)."""
    return [e for node in nodes for e in node.events(name) if "node_id" not in e]


@pytest.mark.parametrize("victim_rank", [2, 0], ids=["writer-survives", "writer-lost"])
def test_a_write_in_flight_across_a_recovery_in_place_is_committed_fenced_or_abandoned_never_left_behind(
    etcd: EmbeddedEtcd, etcd_client: EtcdClient, tmp_path: Path, victim_rank: int
) -> None:
    run_id = f"handover{victim_rank}"
    names = [f"ho{victim_rank}-{i}" for i in range(3)]
    run_dir = tmp_path / "checkpoints" / run_id
    with Cluster(
        etcd.endpoint,
        tmp_path,
        run_id=run_id,
        min_nodes=2,
        max_nodes=3,
        script=SCRIPT,
        script_args=(str(BALLAST_MB), *train_args(100)),
        extra=("--checkpoint-every-steps", "20"),
    ) as c:
        for name in names:
            c.start(name)
        c.wait_step(lambda s: s["world_size"] == 3, timeout_s=120, what="a step on 3 workers")
        ranks = {n: c.nodes[n].events("rendezvous_done")[-1]["group_rank"] for n in names}
        victim = next(n for n, r in ranks.items() if r == victim_rank)
        survivors = [c.nodes[n] for n in names if n != victim]
        old_token = Lineage(etcd_client, RunKeys(run_id)).token()
        partial = wait_until(lambda: _in_flight(run_dir, 3), 120, "a background write in flight", poll_s=0.01)
        restarts = {node.name: len(node.events("restart")) for node in survivors}  # the start-up's re-formations
        c.nodes[victim].kill()
        killed_at = time.time()
        step = int(partial.name.split(".")[0].removeprefix("step-"))
        print(f"killed the node of rank {victim_rank} while {partial.name} was being written")
        for node in survivors:
            assert node.wait(240) == 0, c.diagnostics()

        # the training went on in place: no restart, the survivors re-formed at world 2 and finished
        for node in survivors:
            assert len(node.events("restart")) == restarts[node.name], f"{node.name} restarted\n{c.diagnostics()}"
        assert {e["world_size"] for e in _worker_events(survivors, "reconfigured")} == {2}, c.diagnostics()
        assert c.newest_step()["step"] == 100 and c.newest_step()["world_size"] == 2

        # the write's end is known, and said: committed (recorded under the token it started with), refused by the
        # fence, or abandoned; never a failure (a write lost to the store's new directory was one)
        assert not _worker_events(survivors, "checkpoint_failed"), _worker_events(survivors, "checkpoint_failed")
        records = {r.step: r for r in Lineage(etcd_client, RunKeys(run_id)).records()}
        committed = step in records and records[step].token == old_token
        fenced = [e for e in _worker_events(survivors, "checkpoint_fenced") if e.get("step") == step]
        abandoned = [e for e in _worker_events(survivors, "checkpoint_abandoned") if partial.name in str(e["path"])]
        outcomes = [committed, bool(fenced), bool(abandoned)]
        assert outcomes.count(True) == 1, (outcomes, c.diagnostics())
        print(f"the write of step {step}: committed {committed}, fenced {bool(fenced)}, abandoned {abandoned}")

        # nothing left behind, and the new group commits
        assert not list(run_dir.glob("*.partial")), sorted(p.name for p in run_dir.iterdir())
        later = [r for r in records.values() if r.step > step and r.committed_at > killed_at]
        assert later and all(r.token != old_token for r in later), sorted(records)


def _agreeing(run_dir: Path, world_size: int) -> Path | None:
    """A blocking save's partial directory with every rank's RNG file: the ranks but 0 are done and wait in the
    save's agreement while rank 0 writes the registered object (accelerate writes it after the RNG files)."""
    if not run_dir.is_dir():
        return None
    for partial in run_dir.glob("step-*.partial"):
        if all((partial / f"random_states_{rank}.pkl").exists() for rank in range(world_size)):
            return partial
    return None


@pytest.mark.parametrize(("victim_rank", "freeze"), [(2, True), (0, False)], ids=["frozen-peer", "committer-lost"])
def test_a_peer_lost_inside_a_blocking_saves_agreement_fails_the_step_in_place(
    etcd: EmbeddedEtcd, etcd_client: EtcdClient, tmp_path: Path, victim_rank: int, freeze: bool
) -> None:
    run_id = f"agreeloss{victim_rank}"
    names = [f"al{victim_rank}-{i}" for i in range(3)]
    run_dir = tmp_path / "checkpoints" / run_id
    with Cluster(
        etcd.endpoint,
        tmp_path,
        run_id=run_id,
        min_nodes=2,
        max_nodes=3,
        script=SCRIPT,
        script_args=(str(BALLAST_MB), *train_args(100)),
        extra=("--checkpoint-every-steps", "20"),
        env={"ELASTICD_ASYNC_CHECKPOINTS": "0"},
    ) as c:
        for name in names:
            c.start(name)
        c.wait_step(lambda s: s["world_size"] == 3, timeout_s=120, what="a step on 3 workers")
        ranks = {n: c.nodes[n].events("rendezvous_done")[-1]["group_rank"] for n in names}
        victim = next(n for n, r in ranks.items() if r == victim_rank)
        survivors = [c.nodes[n] for n in names if n != victim]
        partial = wait_until(lambda: _agreeing(run_dir, 3), 120, "a blocking save in its agreement", poll_s=0.01)
        restarts = {node.name: len(node.events("restart")) for node in survivors}
        first_token = str(survivors[0].events("lineage_token")[0]["token"])  # the run's token as the save began
        if freeze:
            c.nodes[victim].freeze()  # stays stopped: the run finishes without it, the cluster's close kills it
        else:
            c.nodes[victim].kill()
        step = int(partial.name.split(".")[0].removeprefix("step-"))
        print(f"{'froze' if freeze else 'killed'} rank {victim_rank}'s node while the ranks agreed on {partial.name}")
        for node in survivors:
            assert node.wait(240) == 0, c.diagnostics()

        # in place: no restart, one re-formation at world 2 after a failed step, the run finished
        for node in survivors:
            assert len(node.events("restart")) == restarts[node.name], f"{node.name} restarted\n{c.diagnostics()}"
        assert {e["world_size"] for e in _worker_events(survivors, "reconfigured")} == {2}, c.diagnostics()
        failed = [e for e in _worker_events(survivors, "step_failed") if GROUP_FAILED in str(e.get("reason"))]
        assert failed, c.diagnostics()
        if freeze:  # both survivors left the save on the notice (before the fix: on gloo's timeout, 2 min on)
            assert len(failed) == 2 and all(FAILED_ELSEWHERE in e["reason"] for e in failed), failed
        assert c.newest_step()["step"] == 100 and c.newest_step()["world_size"] == 2

        records = {r.step: r for r in Lineage(etcd_client, RunKeys(run_id)).records()}
        assert not list(run_dir.glob("*.partial")), sorted(p.name for p in run_dir.iterdir())
        assert max(records) > step, sorted(records)  # the next group commits
        if step in records:
            # the frozen rank had sent its part of the agreement: it completed on rank 0 (every rank's files were
            # written), which committed under the token the save began with, and the frozen rank was lost in the
            # collective that tells the outcome. (The directory itself may be gone by now: --keep-checkpoints 3 prunes
            # it once three later ones commit; the workers log no event of a commit.)
            assert freeze and records[step].token == first_token, (sorted(records), first_token, c.diagnostics())
            return
        # the save was given up, said so, and left nothing: by rank 0 at once, or by the next group's rank 0
        abandoned = [e for e in _worker_events(survivors, "checkpoint_abandoned") if partial.name in str(e["path"])]
        assert abandoned, c.diagnostics()
