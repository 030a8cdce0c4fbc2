"""bench/step_overhead.py's own logic: the round orders that spread drift over the loops, the overhead arithmetic,
and the check that the hot path's comm hook sits on the hot loop's model and nowhere else."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from bench.step_overhead import comm_hooks, compare, loops, round_order
from elasticd.worker.hot.comm_hook import GroupHolder, ResilientAllReduce
from elasticd.worker.hot.failure import StepHealth


def test_two_loops_alternate_abba_and_three_take_every_position_equally_in_six_rounds() -> None:
    assert [round_order(loops(False), i) for i in range(4)] == [
        ("baseline", "elasticd"),
        ("elasticd", "baseline"),
        ("baseline", "elasticd"),
        ("elasticd", "baseline"),
    ]
    rounds = [round_order(loops(True), i) for i in range(6)]
    assert len(set(rounds)) == 6
    for position in range(3):
        assert Counter(r[position] for r in rounds) == {"baseline": 2, "elasticd": 2, "hot": 2}


def test_overheads_are_of_medians_block_means_and_each_rounds_pair() -> None:
    row = {
        "hot_median_s": 0.0204,
        "hot_block_mean_s": 0.021,
        "hot_block_medians_s": [0.0202, 0.0206],
        "elasticd_median_s": 0.0200,
        "elasticd_block_mean_s": 0.020,
        "elasticd_block_medians_s": [0.0200, 0.0200],
    }
    got = compare(row, "hot", "elasticd")
    assert got["overhead"] == pytest.approx(0.02)
    assert got["overhead_us"] == pytest.approx(400.0)
    assert got["mean_overhead"] == pytest.approx(0.05)
    assert got["pair_overheads"] == pytest.approx([0.01, 0.03])


@pytest.fixture
def world_of_one() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=30))
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_the_hot_paths_hook_is_seen_on_its_model_only(world_of_one: None) -> None:
    plain = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1))
    hooked = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1))
    hook = ResilientAllReduce(GroupHolder(), StepHealth())
    try:
        hook.register(hooked)
        assert comm_hooks(plain) == []
        assert comm_hooks(hooked) == ["ResilientAllReduce"]
        assert comm_hooks(torch.nn.Linear(2, 1)) == []  # a 1-process run: no DDP, no hook
    finally:
        hook.close()
