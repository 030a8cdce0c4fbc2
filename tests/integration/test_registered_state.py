"""Objects registered with ``accelerator.register_for_checkpointing`` follow every recovery in place (DESIGN.md §3):
after a discarded step, in a member healed from a peer and in a joiner, they are what a restart from that step would
give, which for a deterministic job is what an undisturbed run has at that step.

The job (``scripts/registered_train.py``) keeps a step counter and an EMA of a parameter the accelerate way,
updated after each optimizer step, and every rank records both with the parameter after every step. Three nodes of
one worker (``--min-nodes 2``) go through:

1. kill -9 of the node of group rank 1: the survivors' step fails and is discarded, and they re-form (3 -> 2);
2. a new node starts and joins in place, healed from a live peer (2 -> 3);
3. the joiner's worker is SIGSTOPped inside its all-reduce: the nodes agree on the hang, the others' step fails on
   the culprit's notice and is discarded, they re-form without it (3 -> 2), and its node's fresh worker joins in
   place (2 -> 3).

At every step, on every rank that completed it (the joiners included), the counter is the step and the EMA is
``d * ema(s-1) + (1-d) * p(s)`` of the recorded parameters from zero: the undisturbed run's value, computed from the
weights. Without the rollback a discarded step's increment and EMA update stay (the counter runs one ahead); without
the heal a joiner starts from its own fresh objects (the counter at 0).
"""

from __future__ import annotations

import os
import signal
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch

from elasticd.etcd.server import EmbeddedEtcd
from tests.integration.cluster import Cluster, leftover_processes, read_json_lines, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(480)]

SCRIPT = Path(__file__).parent / "scripts" / "registered_train.py"
# ~0.1 s a step here: room for two joins, each 5-30 s to start on a busy host (the run is drained once they are done)
EPOCHS, STEPS_PER_EPOCH = 100, 10
STEPS = EPOCHS * STEPS_PER_EPOCH
EMA_DECAY = 0.9  # registered_train.py's


def test_a_step_counter_and_an_ema_registered_for_checkpointing_follow_kill_join_and_hang_in_place(
    etcd: EmbeddedEtcd, tmp_path: Path
) -> None:
    record = tmp_path / "states.jsonl"
    names = ["rs-0", "rs-1", "rs-2"]
    with Cluster(
        etcd.endpoint,
        tmp_path,
        run_id="registered",
        min_nodes=2,
        max_nodes=3,
        script=SCRIPT,
        script_args=("--epochs", str(EPOCHS), "--sleep", "0.05", "--record", str(record)),
        # no checkpoint save near the SIGSTOP: a worker stopped in a save's collective is taken for a hang only after
        # the start-up allowance (the saver's phase), far past this test's waits
        extra=("--hang-timeout", "2", "--checkpoint-every-steps", str(STEPS)),
    ) as c:
        for name in names:
            c.start(name)
        c.wait_step(lambda s: s["world_size"] == 3 and s["step"] >= 10, timeout_s=120, what="3 workers at step 10")
        ranks = {n: c.nodes[n].events("rendezvous_done")[-1]["group_rank"] for n in names}
        by_rank = {r: n for n, r in ranks.items()}
        first_pids = {pid for n in names for pid in c.nodes[n].worker_pids()}
        c.nodes[by_rank[1]].kill()  # 1. 3 -> 2
        c.wait_step(lambda s: s["world_size"] == 2, timeout_s=60, what="2 workers after the kill")
        joiner = c.start("rs-joiner")  # 2. 2 -> 3
        # a new node's start on a loaded host: its daemon's and its warm server's imports took 20-25 s each in the
        # suite, and 90 s ran out once (CI)
        c.wait_step(lambda s: s["world_size"] == 3 and s["step"] > 12, timeout_s=150, what="3 workers again")
        c.nodes[by_rank[0]].wait_event("reconfigured", 60, where=lambda e: e["reason"] == "join")
        # the joiner's own first step at world 3 (its daemon's event, from its worker's beat): a worker stopped
        # before it is still in its first step, judged by the start-up allowance, and its daemon never diagnoses
        # it (CI: the others, left alone, convicted the group's rank 0)
        joiner.wait_event("reconfigured", 60, where=lambda e: e["reason"] == "join" and "node_id" in e)
        hung_pid = joiner.worker_pids()[-1]
        # and its record of that step: the script writes it after run.step() returns, which is after the beat (and
        # after the change's settling: old groups released, freed memory given back)
        wait_until(
            lambda: any(int(line["pid"]) == hung_pid for line in read_json_lines(record)),
            30,
            "the joiner's first step recorded",
        )
        os.kill(hung_pid, signal.SIGSTOP)  # 3. 3 -> 2 -> 3
        diagnosed = joiner.wait_event("hang_diagnosed", timeout_s=120)
        joiner.wait_event("joining_in_place", timeout_s=60)
        back = c.wait_step(lambda s: s["world_size"] == 3 and s["step"] > diagnosed["step"], timeout_s=90)
        c.wait_step(lambda s: s["step"] >= back["step"] + 10, timeout_s=60, what="10 steps back at 3")
        # the rest of the run would only repeat what was checked: drain it (a checkpoint, then every node exits 0)
        c.stop_run()
        for name in (by_rank[0], by_rank[2], joiner.name):
            assert c.nodes[name].wait(240) == 0, c.diagnostics()
        wait_until(lambda: not leftover_processes(list(c.nodes)), 15, "worker processes to exit")
        # the worker's own lines (the daemon's come from beats)
        reasons = [e["reason"] for e in c.nodes[by_rank[0]].events("reconfigured") if "node_id" not in e]
        assert reasons == ["failure", "join", "hang", "join"], (reasons, c.diagnostics())
        assert len(c.nodes[by_rank[0]].events("step_failed")) == 2, c.diagnostics()  # the kill's and the hang's

    by_step: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for line in read_json_lines(record):
        by_step[int(line["step"])].append(line)
    last = max(by_step)  # the drain's step
    assert last > back["step"] and sorted(by_step) == list(range(1, last + 1)), "a step recorded by no rank"
    previous = torch.zeros(len(by_step[1][0]["param"]))
    for step in range(1, last + 1):
        lines = by_step[step]
        first = lines[0]
        for line in lines:
            where = f"step {step}, rank {line['rank']} (pid {line['pid']})"
            assert line["counter"] == step and line["updates"] == step, f"{where}: the counter says {line['counter']}"
            assert line["param"] == first["param"], f"{where}: the weights differ between ranks"
            assert line["ema"] == first["ema"], f"{where}: the EMA differs between ranks"
        expected = previous.mul(EMA_DECAY).add(torch.tensor(first["param"]), alpha=1 - EMA_DECAY)
        found = torch.tensor(first["ema"])
        assert torch.equal(found, expected), f"step {step}: EMA off by {(found - expected).abs().max().item():.3e}"
        previous = found

    # every worker recorded, the joiners included, from the first step each completed on
    joiner_pids = {int(line["pid"]) for lines in by_step.values() for line in lines} - first_pids
    assert hung_pid in joiner_pids and len(joiner_pids) == 2, joiner_pids
    for pid in joiner_pids:
        first_step = min(s for s, lines in by_step.items() if any(line["pid"] == pid for line in lines))
        assert first_step > 10, f"joiner {pid} recorded step {first_step}: it did not join a running group"
