"""Invariance in place: the same deterministic job, undisturbed (on one worker: the global batch is the same) or
taken through kill -> join -> hang -> SIGTERM with recovery in place (the default), ends with the same parameters
(within 1e-5 relative: only the order of floating-point sums differs between world sizes), every sample of every
epoch trained exactly once and the LR of every step that of the schedule. And nothing restarts but the hung worker's
node.

The disturbed run, 4 nodes of one worker each (``--min-nodes 2``):

1. kill -9 of the node of group rank 1: the other three re-form in place (4 -> 3);
2. a new node starts and joins in place, healed from a live peer (3 -> 4);
3. the worker of the node that joined in step 2 is SIGSTOPped (the private round it came in through numbered it
   rank 0, as the round numbered the node of group rank 0: the daemons must name it by its rank in the group): the
   others wait in their all-reduce, the nodes agree on the hang, its node tells the group and kills it, the others
   re-form in place (4 -> 3), and its node comes back with a fresh worker that joins in place (3 -> 4);
4. SIGTERM to the node of group rank 2: its worker leaves at an agreed step boundary (4 -> 3), and the run ends.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

from elasticd.etcd.server import EmbeddedEtcd
from tests.integration.cluster import (
    CHECKPOINT_EVERY_STEPS,
    Cluster,
    Node,
    leftover_processes,
    read_json_lines,
    train_args,
    wait_until,
)
from tests.integration.test_worker_library import effective_ids, expected_lr

pytestmark = [pytest.mark.integration, pytest.mark.timeout(480)]

# 50 epochs of 10 steps, ~0.1 s a step here: long enough for two joins, each 5-15 s to import on a busy 2-core host
STEPS = 500
REL_TOL = 1e-5
DATASET, GLOBAL_BATCH, STEPS_PER_EPOCH = 480, 48, 10


def _run(etcd: str, workdir: Path, disturb: bool) -> dict[str, torch.Tensor]:
    workdir.mkdir()
    out, record = workdir / "final.pt", workdir / "ids.jsonl"
    # undisturbed: one node, steps without a sleep (the global batch, so every step's samples, is the same at any size)
    names = [f"iv-d{i}" for i in range(4)] if disturb else ["iv-u0"]
    world = len(names)
    with Cluster(
        etcd,
        workdir,
        run_id="disturbed" if disturb else "undisturbed",
        min_nodes=2 if disturb else 1,
        max_nodes=world,
        script_args=(
            *train_args(STEPS, 0.05 if disturb else 0.0),
            "--save-final",
            str(out),
            "--record-ids",
            str(record),
        ),
        extra=("--hang-timeout", "2"),
    ) as c:
        for name in names:
            c.start(name)
        c.wait_step(lambda s: s["world_size"] == world and s["step"] >= 10, timeout_s=120, what="every worker, step 10")
        alive = list(names)
        if disturb:
            ranks = {n: c.nodes[n].events("rendezvous_done")[-1]["group_rank"] for n in names}
            by_rank = {r: n for n, r in ranks.items()}
            pids = {n: c.nodes[n].worker_pids() for n in names}
            # a node that came late to the first round restarts its peers' workers once, before the first step
            # (seen on a loaded host); from here on nothing but the hung node may restart
            restarts = {n: len(c.nodes[n].events("restart")) for n in names}
            c.nodes[by_rank[1]].kill()  # 1. 4 -> 3
            alive.remove(by_rank[1])
            c.wait_step(lambda s: s["world_size"] == 3, timeout_s=60, what="3 workers after the kill")
            c.start("iv-joiner")  # 2. 3 -> 4
            alive.append("iv-joiner")
            rejoined = c.wait_step(lambda s: s["world_size"] == 4 and s["step"] > 12, timeout_s=90, what="4 again")
            # and past the admitting step (printed at the new size already): a step completed in the new group
            c.nodes[by_rank[0]].wait_event("reconfigured", 60, where=lambda e: e["reason"] == "join")
            # 3. a hang: the culprit's node kills its worker, and comes back and joins. Stopped just after a step
            # clear of the saves (every 10 steps): a worker stopped inside a save's collective is taken for a hang
            # only after the start-up allowance (the saver's phase), far past this test's waits (seen in the suite:
            # the join admitted at step 219, the worker stopped in the save of step 220)
            wait_until(lambda: _clear_of_saves(c.newest_step(), rejoined["step"]), 60, "a step clear of the saves")
            hung = c.nodes["iv-joiner"]
            os.kill(hung.worker_pids()[-1], signal.SIGSTOP)
            diagnosed = hung.wait_event("hang_diagnosed", timeout_s=120)
            hung.wait_event("joining_in_place", timeout_s=60)
            c.wait_step(
                lambda s: s["world_size"] == 4 and s["step"] > diagnosed["step"], timeout_s=90, what="back at 4"
            )
            leaver = c.nodes[by_rank[2]]  # 4. 4 -> 3
            leaver.proc.send_signal(signal.SIGTERM)
            assert leaver.wait(60) == 0, c.diagnostics()
            alive.remove(leaver.name)
        for name in alive:
            assert c.nodes[name].wait(240) == 0, c.diagnostics()
        wait_until(lambda: not leftover_processes(list(c.nodes)), 15, "worker processes to exit")

        steps = c.all_steps()
        numbers = [s["step"] for s in steps]
        assert len(numbers) == len(set(numbers)), "a step printed twice"
        # Rank 0 prints the steps it completes; a step that a peer completed while rank 0's all-reduce failed is
        # healed forward onto rank 0 (the member with the most steps gives the state), trained but not printed.
        healed = {e["step"] for n in c.nodes.values() for e in n.events("regrouped") if "node_id" not in e}
        unprinted = set(range(1, STEPS + 1)) - set(numbers)
        assert unprinted <= healed and max(numbers) == STEPS, ("steps never trained", sorted(unprinted - healed))
        for s in steps:
            assert s["lr"] == pytest.approx(expected_lr(s["step"]), rel=1e-9)
        ids = effective_ids(record)
        assert sorted(ids) == list(range(1, STEPS + 1))
        # the global batch holds at every size: the samples the ranks recorded for each step, not the step line's own
        # arithmetic (480 samples in batches of 48: no step is padded)
        assert {step: len(trained) for step, trained in ids.items() if len(trained) != GLOBAL_BATCH} == {}
        for epoch in range(STEPS // STEPS_PER_EPOCH):
            seen = [i for s in range(epoch * 10 + 1, epoch * 10 + 11) for i in ids[s]]
            assert sorted(seen) == list(range(DATASET)), f"epoch {epoch}: samples skipped or repeated"
        if disturb:
            assert {s["world_size"] for s in steps} == {3, 4}
            _check_nothing_restarted_but_the_hung_node(c, by_rank, pids, restarts, diagnosed, leaver)
    return torch.load(out)


def _clear_of_saves(step: dict, after: int) -> bool:
    """A step at 4 beyond ``after`` from which the next save (every 10 steps) is 5-8 steps away."""
    return step["world_size"] == 4 and step["step"] > after and 2 <= step["step"] % CHECKPOINT_EVERY_STEPS <= 5


def _check_nothing_restarted_but_the_hung_node(
    c: Cluster,
    by_rank: dict[int, str],
    pids: dict[str, list[int]],
    restarts: dict[str, int],
    diagnosed: dict,
    leaver: Node,
) -> None:
    hung = c.nodes["iv-joiner"]
    assert diagnosed["culprit_nodes"] == [hung.name], diagnosed
    assert [e["reason"] for e in hung.events("restart")] == ["hang"], hung.tail(60)
    assert len(hung.events("hang_diagnosed")) == 1, hung.tail(60)  # acted on once
    for name in (by_rank[0], by_rank[2], by_rank[3]):
        node = c.nodes[name]
        assert len(node.events("restart")) == restarts[name], f"{name} restarted its workers\n{c.diagnostics()}"
        assert not node.events("checkpoint_requested"), f"{name}: a change in place takes no checkpoint first"
    for name in (by_rank[0], by_rank[2], by_rank[3]):
        done = {int(e["pid"]) for e in read_json_lines(c.nodes[name].out) if e.get("event") == "done"}
        assert done <= set(pids[name])  # the same worker processes from the first step to the last
    # the worker's own lines (the daemon's come from beats, datagrams that a busy host may drop)
    reasons = [e["reason"] for e in c.nodes[by_rank[0]].events("reconfigured") if "node_id" not in e]
    assert reasons == ["failure", "join", "hang", "join", "leave"], (reasons, c.diagnostics())
    # the others left the hang to its culprit's node: they said so, or saw their workers move on before deciding
    assert c.nodes[by_rank[0]].events("hang_left_to_culprits") or c.nodes[by_rank[0]].events("hang_cleared")
    assert leaver.events("leaving_in_place") and leaver.events("left_in_place")
    # lost steps are the completed steps trained again (worker/hot_path.py lost_steps): each change resumed from the
    # last completed step (no step printed twice, checked above) and a failed step, discarded, was never completed,
    # so every worker reports 0, the joiners (healed forward) included; the daemons count what their workers report
    reports = [e for n in c.nodes.values() for e in n.events("reconfigured") if "node_id" not in e]
    assert reports and [e["lost_steps"] for e in reports] == [0] * len(reports), reports
    daemons = [e for n in c.nodes.values() for e in n.events("reconfigured") if "node_id" in e]
    assert daemons and all(e["lost_steps"] == 0 for e in daemons)
    # every worker that ended with the run ended through the interpreter's own exit: what each gave up on in place
    # had ended by run.close(), its old groups released (worker/hot/given_up.py), so no exit guard was needed
    skipped = {n.name: n.events("teardown_skipped_at_exit") for n in c.nodes.values() if n is not hung}
    assert not any(skipped.values()), skipped


def test_kill_join_hang_and_sigterm_in_place_end_with_the_parameters_of_an_undisturbed_run(
    etcd: EmbeddedEtcd, tmp_path: Path
) -> None:
    reference = _run(etcd.endpoint, tmp_path / "undisturbed", disturb=False)
    disturbed = _run(etcd.endpoint, tmp_path / "disturbed", disturb=True)
    assert reference.keys() == disturbed.keys()
    worst = 0.0
    for name, ref in reference.items():
        rel = ((disturbed[name] - ref).abs().max() / ref.abs().max().clamp(min=1e-12)).item()
        worst = max(worst, rel)
    print(f"kill, join, hang, SIGTERM in place against undisturbed: largest relative parameter difference {worst:.3e}")
    assert worst <= REL_TOL
