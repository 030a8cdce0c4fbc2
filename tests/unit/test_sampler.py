"""Exactly once: the epoch order ignores the world size, and a restart at any world size skips or repeats nothing."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import Dataset

from elasticd.worker.batching import plan_batches
from elasticd.worker.sampler import DataPosition, ElasticSampler, StepSlice, micro_batch_loader


def world_samplers(
    dataset_len: int,
    global_batch: int,
    micro: int,
    world: int,
    *,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = False,
) -> list[ElasticSampler]:
    """One sampler per rank of a world of ``world``, as every rank would build it after a (re)start."""
    plan = plan_batches(global_batch, micro, world)
    return [
        ElasticSampler(dataset_len, plan, rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
        for rank in range(world)
    ]


def world_steps(
    samplers: list[ElasticSampler],
    start: DataPosition,
    epochs: int,
    skip_positions: frozenset[tuple[int, int]] = frozenset(),
    on_skip: Callable[[StepSlice], None] | None = None,
) -> list[list[StepSlice]]:
    """One list per step, holding every rank's slice of it; checks that the ranks agree on the step's shape."""
    per_rank = [list(sampler.steps(start, epochs, skip_positions, on_skip)) for sampler in samplers]
    assert len({len(steps) for steps in per_rank}) == 1
    steps = [list(ranks) for ranks in zip(*per_rank, strict=True)]
    for ranks in steps:
        plan = samplers[0].plan
        assert len({(s.epoch, s.position, s.valid_samples, s.last_in_epoch) for s in ranks}) == 1
        assert all(len(s.micro_batches) == plan.accumulation for s in ranks)
        assert all(len(m.indices) == len(m.valid) == plan.micro_batch_size for s in ranks for m in s.micro_batches)
    return steps


def valid_indices(step: list[StepSlice]) -> list[int]:
    return [i for s in step for m in s.micro_batches for i, ok in zip(m.indices, m.valid, strict=True) if ok]


def test_order_is_a_seeded_permutation_independent_of_the_world_size() -> None:
    orders = [sampler.order(3) for world in (1, 2, 4) for sampler in world_samplers(50, 8, 2, world, seed=7)]
    assert all(torch.equal(order, orders[0]) for order in orders)
    assert sorted(orders[0].tolist()) == list(range(50))
    assert not torch.equal(orders[0], torch.arange(50))


def test_order_changes_with_the_epoch_and_the_seed() -> None:
    plan = plan_batches(4, 1, 1)
    sampler = ElasticSampler(100, plan, 0, seed=0)
    assert not torch.equal(sampler.order(0), sampler.order(1))
    assert not torch.equal(sampler.order(1), ElasticSampler(100, plan, 0, seed=1).order(0))  # no seed + epoch mixing
    assert torch.equal(sampler.order(0), ElasticSampler(100, plan, 0, seed=0).order(0))


def test_unshuffled_order_is_the_identity() -> None:
    sampler = ElasticSampler(10, plan_batches(4, 2, 2), 1, shuffle=False)
    assert sampler.order(5).tolist() == list(range(10))


def test_rank_r_micro_batch_k_is_its_contiguous_share_of_the_global_batch() -> None:
    samplers = world_samplers(40, 12, 2, 2, seed=3)  # accumulation 3, per rank 6
    order = samplers[0].order(0).tolist()
    for step in world_steps(samplers, DataPosition(0, 12), 1)[:2]:
        for rank, slice_ in enumerate(step):
            for k, micro in enumerate(slice_.micro_batches):
                start = slice_.position + rank * 6 + k * 2
                assert micro.indices == tuple(order[start : start + 2])
                assert all(micro.valid)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_one_epoch_yields_every_sample_exactly_once_including_the_tail(world: int) -> None:
    samplers = world_samplers(101, 24, 2, world, seed=11)  # 4 full steps and a tail of 5
    steps = world_steps(samplers, DataPosition(), 1)
    assert len(steps) == samplers[0].steps_per_epoch() == 5
    seen = [i for step in steps for i in valid_indices(step)]
    assert sorted(seen) == list(range(101))
    assert seen == samplers[0].order(0).tolist()  # the global order is consumed in order


def test_tail_pads_every_micro_batch_with_an_in_range_index_and_spreads_real_samples_over_ranks() -> None:
    samplers = world_samplers(29, 24, 2, 3)  # accumulation 4; the tail holds 5 real samples
    tail = world_steps(samplers, DataPosition(), 1)[-1]
    assert tail[0].valid_samples == 5 and tail[0].last_in_epoch
    per_rank = [sum(sum(m.valid) for m in s.micro_batches) for s in tail]
    assert per_rank == [2, 2, 1]
    first = samplers[0].order(0)[24].item()
    for slice_ in tail:
        for micro in slice_.micro_batches:
            assert list(micro.valid) == sorted(micro.valid, reverse=True)  # real samples first
            assert all(index == first for index, ok in zip(micro.indices, micro.valid, strict=True) if not ok)


def test_positions_advance_by_the_global_batch_and_the_tail_starts_the_next_epoch() -> None:
    (sampler,) = world_samplers(10, 4, 4, 1)
    steps = list(sampler.steps(DataPosition(), 2))
    assert [(s.epoch, s.position) for s in steps] == [(0, 0), (0, 4), (0, 8), (1, 0), (1, 4), (1, 8)]
    assert [s.next_position() for s in steps[:3]] == [DataPosition(0, 4), DataPosition(0, 8), DataPosition(1, 0)]


def test_resuming_at_the_end_of_an_epoch_starts_the_next_one() -> None:
    (sampler,) = world_samplers(8, 4, 4, 1)
    assert [(s.epoch, s.position) for s in sampler.steps(DataPosition(0, 8), 2)] == [(1, 0), (1, 4)]
    assert list(sampler.steps(DataPosition(2, 0), 2)) == []


def test_a_position_past_the_end_of_the_dataset_is_rejected_at_once() -> None:
    (sampler,) = world_samplers(8, 4, 4, 1)
    with pytest.raises(ValueError, match="past the end of the dataset"):
        sampler.steps(DataPosition(0, 9), 1)


@settings(max_examples=150, deadline=None)
@given(
    data=st.data(),
    global_batch=st.sampled_from([12, 24, 36, 60]),
    dataset_len=st.integers(1, 150),
    epochs=st.integers(2, 3),
    seed=st.integers(0, 2**32),
    drop_last=st.booleans(),
)
def test_world_size_changes_at_step_boundaries_never_skip_or_repeat_a_sample(
    data: st.DataObject, global_batch: int, dataset_len: int, epochs: int, seed: int, drop_last: bool
) -> None:
    seen: dict[int, list[int]] = {epoch: [] for epoch in range(epochs)}
    position = DataPosition()
    restarts = data.draw(st.integers(0, 6), label="restarts")
    for restart in range(restarts + 1):
        world = data.draw(st.sampled_from([w for w in range(1, 13) if global_batch % w == 0]), label="world")
        per_rank = global_batch // world
        micro = data.draw(st.sampled_from([m for m in range(1, per_rank + 1) if per_rank % m == 0]), label="micro")
        samplers = world_samplers(dataset_len, global_batch, micro, world, seed=seed, drop_last=drop_last)
        steps = world_steps(samplers, position, epochs)
        # Each restart comes after some steps (0: it failed before its first one); the last world runs to the end.
        done = (
            data.draw(st.integers(0, len(steps)), label="steps before the restart")
            if restart < restarts
            else len(steps)
        )
        for step in steps[:done]:
            seen[step[0].epoch].extend(valid_indices(step))
        position = steps[done - 1][0].next_position() if done else position
    for epoch, indices in seen.items():
        expected = samplers[0].order(epoch).tolist()
        if drop_last:
            expected = expected[: dataset_len // global_batch * global_batch]
        assert Counter(indices) == Counter(expected), f"epoch {epoch}"


def test_skip_positions_skip_exactly_those_steps_samples_and_report_them() -> None:
    samplers = world_samplers(10, 4, 1, 2, seed=5)  # steps at 0, 4 and a tail at 8
    skip = frozenset({(0, 4), (1, 8)})
    skipped: list[StepSlice] = []
    steps = world_steps(samplers, DataPosition(), 2, skip_positions=skip, on_skip=skipped.append)
    assert [(s[0].epoch, s[0].position) for s in steps] == [(0, 0), (0, 8), (1, 0), (1, 4)]
    assert sorted((s.epoch, s.position) for s in skipped) == [(0, 4), (0, 4), (1, 8), (1, 8)]  # once per rank
    order0, order1 = samplers[0].order(0).tolist(), samplers[0].order(1).tolist()
    epoch0 = [i for step in steps if step[0].epoch == 0 for i in valid_indices(step)]
    epoch1 = [i for step in steps if step[0].epoch == 1 for i in valid_indices(step)]
    assert sorted(epoch0) == sorted(order0[:4] + order0[8:])
    assert sorted(epoch1) == sorted(order1[:8])
    assert sorted(valid_indices([s for s in skipped if s.epoch == 1])) == sorted(order1[8:])


def test_drop_last_skips_the_tail_and_the_next_epoch_starts_at_zero() -> None:
    samplers = world_samplers(10, 4, 2, 2, drop_last=True)
    steps = world_steps(samplers, DataPosition(), 2)
    assert samplers[0].steps_per_epoch() == 2
    assert [(s[0].epoch, s[0].position) for s in steps] == [(0, 0), (0, 4), (1, 0), (1, 4)]
    assert steps[1][0].next_position() == DataPosition(1, 0)
    assert all(ok for step in steps for s in step for m in s.micro_batches for ok in m.valid)
    assert sorted(i for step in steps[:2] for i in valid_indices(step)) == sorted(samplers[0].order(0)[:8].tolist())


def test_steps_per_epoch_counts_a_partial_tail_unless_dropped() -> None:
    assert world_samplers(12, 4, 4, 1)[0].steps_per_epoch() == 3
    assert world_samplers(13, 4, 4, 1)[0].steps_per_epoch() == 4
    assert world_samplers(13, 4, 4, 1, drop_last=True)[0].steps_per_epoch() == 3


def test_data_position_round_trips_through_its_manifest_form() -> None:
    position = DataPosition(epoch=2, position=768)
    assert position.to_dict() == {"epoch": 2, "samples_in_epoch": 768}
    assert DataPosition.from_dict({**position.to_dict(), "step": 9}) == position
    with pytest.raises(ValueError, match="missing samples_in_epoch"):
        DataPosition.from_dict({"epoch": 1})
    with pytest.raises(ValueError, match="epoch must be a non-negative integer"):
        DataPosition.from_dict({"epoch": "1", "samples_in_epoch": 0})
    with pytest.raises(ValueError, match="position must be a non-negative integer"):
        DataPosition(0, -1)


def test_a_rank_outside_the_world_is_rejected() -> None:
    with pytest.raises(ValueError, match="outside the world"):
        ElasticSampler(10, plan_batches(4, 2, 2), 2)


class Numbers(Dataset[dict[str, torch.Tensor]]):
    def __len__(self) -> int:
        return 10

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < 10:
            raise IndexError(index)
        return {"x": torch.tensor(index)}


class Plain(Numbers):
    def __getitem__(self, index: int) -> torch.Tensor:  # type: ignore[override]  # a dataset of plain tensors
        return super().__getitem__(index)["x"]


def test_loader_attaches_the_mask_under_valid_for_dict_batches() -> None:
    (sampler,) = world_samplers(10, 4, 2, 1, shuffle=False)
    micro_batches = [m for step in sampler.steps(DataPosition(), 1) for m in step.micro_batches]
    batches = list(micro_batch_loader(Numbers(), micro_batches))
    assert len(batches) == len(micro_batches) == 6
    for batch, micro in zip(batches, micro_batches, strict=True):
        assert batch["x"].tolist() == list(micro.indices)
        assert batch["valid"].dtype == torch.bool and batch["valid"].tolist() == list(micro.valid)
    assert batches[-2]["valid"].tolist() == [True, False]


def test_loader_returns_batch_and_mask_for_other_batches_and_uses_the_collate_fn() -> None:
    (sampler,) = world_samplers(10, 4, 2, 1, shuffle=False)
    micro_batches = (m for step in sampler.steps(DataPosition(0, 8), 1) for m in step.micro_batches)  # lazily
    batches = list(micro_batch_loader(Plain(), micro_batches, collate_fn=lambda items: torch.stack(items) * 10))
    assert [(batch.tolist(), valid.tolist()) for batch, valid in batches] == [
        ([80, 80], [True, False]),
        ([90, 80], [True, False]),
    ]
