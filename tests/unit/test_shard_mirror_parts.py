"""The pure parts of sharded recovery in memory: the row plan of a change of world size, which step a group can go
back to from its mirrors, and the mirror's refusals (stale epoch, wrong size, wrong owner)."""

from __future__ import annotations

import pytest
import torch

from elasticd.worker.hot.mirror import ShardMirror, peers
from elasticd.worker.hot.mirror_pick import Holdings, pick
from elasticd.worker.hot.shard_rows import MissingShard, Rows, bytes_between, plan, shard_rows


@pytest.mark.parametrize("n", [0, 1, 7, 33, 100])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
def test_shard_rows_split_like_torch_chunk(n: int, world: int) -> None:
    chunks = torch.arange(n).chunk(world) if n else ()
    for rank in range(world):
        rows = shard_rows(n, world, rank)
        expected = chunks[rank].tolist() if rank < len(chunks) else []
        assert list(range(rows.start, rows.stop)) == expected


@pytest.mark.parametrize(("old", "new"), [(3, 2), (2, 3), (4, 3), (3, 5), (5, 2)])
def test_the_plan_gives_every_new_rank_exactly_its_rows(old: int, new: int) -> None:
    rows_of = {"a": 33, "b": 7, "c": 1}
    moves = plan(rows_of, old, new, list(range(old)) if old <= new else [j % new for j in range(old)])
    for name, n in rows_of.items():
        for dst in range(new):
            got = sorted((m.rows.start, m.rows.stop) for m in moves if m.name == name and m.dst == dst)
            covered = [r for a, b in got for r in range(a, b)]
            wanted = shard_rows(n, new, dst)
            assert covered == list(range(wanted.start, wanted.stop))
    for m in moves:  # each move's rows lie in the old shard it is taken from
        held = shard_rows(rows_of[m.name], old, m.old_shard)
        assert held.start <= m.rows.start and m.rows.stop <= held.stop


def test_a_shard_nobody_holds_is_missing_and_bytes_count_only_other_ranks() -> None:
    with pytest.raises(MissingShard, match="old shard 2"):
        plan({"w": 9}, 3, 2, [0, 1, None])
    moves = plan({"w": 9}, 3, 2, [0, 1, 0])  # shards of 3 rows; new shards of 5 and 4
    assert bytes_between(moves, {"w": 8}) == {(1, 0): 2 * 8, (0, 1): 3 * 8}
    assert Rows(2, 5).overlap(Rows(6, 9)).count == 0


def test_the_group_goes_back_to_the_newest_step_whole_in_memory() -> None:
    # rank 2 (lost) was mirrored on rank 0 up to step 3; its step-4 mirror arrived in part and was never kept
    held = [Holdings(0, 0, ((3, "e1"), (4, "e1")), (2, 3, "e1")), Holdings(1, 1, ((3, "e1"), (4, "e1")), (0, 4, "e1"))]
    assert pick(held, 3, "e1") == (3, [0, 1, 0])
    # both mirrors of step 4 whole
    held[0] = Holdings(0, 0, held[0].own, (2, 4, "e1"))
    assert pick(held, 3, "e1") == (4, [0, 1, 0])


def test_a_mirror_from_a_stale_epoch_is_never_used() -> None:
    # rank 0 keeps rank 2's mirror of step 4 from epoch e0 (another world's shard layout); the group trains in e1
    held = [Holdings(0, 0, ((4, "e1"),), (2, 4, "e0")), Holdings(1, 1, ((4, "e1"),), None)]
    assert pick(held, 3, "e1") is None  # the committed checkpoint, not a stale mirror


def test_no_mirror_of_two_adjacent_lost_ranks_means_the_checkpoint() -> None:
    held = [Holdings(0, 0, ((5, "e0"),), (3, 5, "e0"))]  # ranks 1 and 2 lost; rank 1's mirror was on rank 2
    assert pick(held, 4, "e0") is None


def test_ring_peers_are_on_other_nodes() -> None:
    assert peers(0, 6, 2) == (2, 4) and peers(5, 6, 2) == (1, 3)
    assert peers(1, 2, 2) is None  # one node: no mirror


def _mirror() -> ShardMirror:
    return ShardMirror(None, rank=1, world=3, nproc_per_node=1, epoch="e1")


def test_a_received_mirror_is_refused_when_stale_short_or_from_another_owner() -> None:
    ring = _mirror()
    data = torch.zeros(8, dtype=torch.uint8)
    offsets = {"p:w": (0, 8, (2,), torch.float32)}
    ring._keep((4, "e0", 0, offsets, {}), data)  # a stale epoch
    ring._keep((4, "e1", 0, {"p:w": (0, 12, (3,), torch.float32)}, {}), data)  # 8 bytes for 12 announced
    ring._keep((4, "e1", 2, offsets, {}), data)  # not the rank this one receives from
    assert ring.held is None and len(ring.stats.refused) == 3
    ring._keep((4, "e1", 0, offsets, {}), data)
    assert ring.held is not None and ring.held.step == 4
    assert torch.equal(ring.held.tensor("p:w"), torch.zeros(2))
