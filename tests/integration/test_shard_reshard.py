"""A sharded (FSDP2) group changes its world size in place from what its ranks hold in memory, real processes.

``scripts/reshard_ranks.py``: 3 ranks train with their shards mirrored around the ring each step
(``worker/hot/mirror.py``); rank 2 is killed (-9) in the middle of sending its step-4 mirror, so rank 0 holds that
generation in part; ranks 0 and 1, in the same processes, re-form at 2, go back to step 3 (the newest step whole in
memory: their own copies and rank 0's mirror of rank 2), exchange rows (``shard_exchange.py``) and move their FSDP2
modules onto the new mesh (``remesh.py``); then a new process joins and takes its shard from them at 3. At 2 and at
3 the weights after further steps equal, bit for bit, a fresh model of that size loaded from the full state.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import kill_tree

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

SCRIPT = Path(__file__).parent / "scripts" / "reshard_ranks.py"
RUN_TIMEOUT_S = 240


def test_lost_rank_comes_back_from_its_mirror_and_a_joiner_from_the_members(tmp_path: Path) -> None:
    roles = [("member", 0), ("member", 1), ("member", 2), ("joiner", 2)]
    logs = [(tmp_path / f"{role}-{rank}.log").open("w") for role, rank in roles]
    procs = [
        subprocess.Popen(
            [sys.executable, str(SCRIPT), str(tmp_path), role, str(rank)],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        for (role, rank), log in zip(roles, logs, strict=True)
    ]
    try:
        codes = [p.wait(timeout=RUN_TIMEOUT_S) for p in procs]
    finally:
        for p in procs:
            kill_tree(p)
        for log in logs:
            log.close()
    output = "\n".join(f"--- {log.name}\n{Path(log.name).read_text()[-3000:]}" for log in logs)
    assert codes == [0, 0, -9, 0], output
    results = {
        f"{role}-{rank}": json.loads((tmp_path / f"result-{role}-{rank}.json").read_text())
        for role, rank in roles
        if (role, rank) != ("member", 2)
    }
    for name in ("member-0", "member-1"):
        r = results[name]
        assert r["step"] == 3, "the interrupted step-4 generation must never be used"
        assert r["holders"] == [0, 1, 0], "rank 2's shard must come from rank 0's mirror of it"
        assert r["at_2"] == 0.0 and r["at_3"] == 0.0, r
    assert results["joiner-2"]["at_3"] == 0.0
    assert results["joiner-2"]["received"] > 0 and results["member-1"]["received"] > 0
