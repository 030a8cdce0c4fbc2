"""A sender that dies in the middle of a heal costs the group one more epoch, never its run (DESIGN.md §3).

Two nodes of one worker (``--min-nodes 2``) train ``scripts/registered_train.py`` in place; a third node joins. In
the join's heal the group's rank 0 (the source, the only sender of this small state's one piece) SIGKILLs itself as
it is about to send the joiner its piece (``kill@heal=1,rank=0``: the process's first heal; a joiner's first heal is
a receiver's, which sends nothing). The joiner's receive fails, every member learns the heal failed, and the two left
(the other old member, which holds the state, and the joiner, whose tensors it must not trust) decide the next epoch
among themselves and heal again from the old member. The killed node's fresh worker joins too, in that epoch when it
bids in time, else in the next.

Without the retry the heal's failure is a ``hot_fallback`` and every worker restarts cold from a checkpoint; without
the joiner's "unhealed" bid it could be chosen as the next source and hand its half-written state on (the record's
per-step check sees the weights differ between ranks, or its counter at 0).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from elasticd.etcd.server import EmbeddedEtcd
from elasticd.worker.hot.link import DEFAULT_HEAL_TIMEOUT
from tests.integration.cluster import Cluster, leftover_processes, read_json_lines, wait_until
from tests.integration.on_hosts import stamp

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

SCRIPT = Path(__file__).parent / "scripts" / "registered_train.py"
EPOCHS, STEPS_PER_EPOCH = 100, 10  # ~0.1 s a step: far more than the test needs (it drains the run when done)


def test_a_source_killed_mid_heal_is_replaced_by_a_live_sender_and_the_joiner_trains_healed(
    etcd: EmbeddedEtcd, tmp_path: Path
) -> None:
    record = tmp_path / "states.jsonl"
    names = ["hr-0", "hr-1"]
    with Cluster(
        etcd.endpoint,
        tmp_path,
        run_id="healretry",
        min_nodes=2,
        max_nodes=3,
        script=SCRIPT,
        script_args=("--epochs", str(EPOCHS), "--sleep", "0.05", "--record", str(record)),
        extra=("--checkpoint-every-steps", str(EPOCHS * STEPS_PER_EPOCH)),
        env={"ELASTICD_FAULT": "kill@heal=1,rank=0"},
    ) as c:
        for name in names:
            c.start(name)
        c.wait_step(lambda s: s["world_size"] == 2 and s["step"] >= 10, timeout_s=120, what="2 workers at step 10")
        ranks = {n: c.nodes[n].events("rendezvous_done")[-1]["group_rank"] for n in names}
        source = next(n for n in names if ranks[n] == 0)
        survivor = next(n for n in names if ranks[n] == 1)
        first_pids = {pid for n in names for pid in c.nodes[n].worker_pids()}
        joiner = c.start("hr-joiner")
        # the survivor's move: the first epoch's heal lost its source, the next one healed the joiner from it
        regrouped = c.nodes[survivor].wait_event("regrouped", 240, where=lambda e: e.get("heal_attempts") == 2)
        # 2, or 3 when the killed node's fresh worker bid in time to join the retried epoch too
        assert regrouped["world_size"] in (2, 3), regrouped
        healed = joiner.wait_event("regrouped", 60)
        assert healed["heal_attempts"] == 2 and healed["heal_bytes"] > 0, healed
        # the others learn of the dead sender from gloo and take the rest of the pieces from the live one: released
        # by that, not by the heal's timeout (each wait of the failed heal would run out after 2 minutes)
        waited = stamp(regrouped) - stamp(joiner.events("join_requested")[-1])
        assert waited < DEFAULT_HEAL_TIMEOUT.total_seconds() / 2, f"the retried heal took {waited:.0f}s"
        c.wait_step(lambda s: s["step"] >= regrouped["step"] + 10, timeout_s=60, what="10 steps after the heal")
        c.stop_run()
        for name in (survivor, joiner.name):
            assert c.nodes[name].wait(240) == 0, c.diagnostics()
        c.nodes[source].wait(240)
        wait_until(lambda: not leftover_processes(list(c.nodes)), 15, "worker processes to exit")
        for name in (survivor, joiner.name):
            assert not c.nodes[name].events("hot_fallback"), (name, c.diagnostics())

    by_step: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for line in read_json_lines(record):
        by_step[int(line["step"])].append(line)
    last = max(by_step)
    assert sorted(by_step) == list(range(1, last + 1)), "a step recorded by no rank"
    for step, lines in sorted(by_step.items()):
        for line in lines:
            where = f"step {step}, rank {line['rank']} (pid {line['pid']})"
            assert line["counter"] == step, f"{where}: the counter says {line['counter']}"
            assert line["param"] == lines[0]["param"], f"{where}: the weights differ between ranks"
            assert line["ema"] == lines[0]["ema"], f"{where}: the EMA differs between ranks"
    joined = {int(line["pid"]) for lines in by_step.values() for line in lines} - first_pids
    assert joined, "no joiner recorded a step"
    for pid in joined:
        first_step = min(s for s, lines in by_step.items() if any(line["pid"] == pid for line in lines))
        assert first_step > regrouped["step"], f"joiner {pid} recorded step {first_step}, before it was healed"
