"""elasticd.Trainer's data (elasticd/worker/trainer/steps.py): every world size trains the same micro-batches at the
same step, and Trainer's resume arithmetic (skip ``k x accumulation`` of a rank's micro-batches) lands on step k+1."""

from __future__ import annotations

import pytest
import transformers

from elasticd.worker.trainer import trainer as elastic_trainer
from elasticd.worker.trainer.steps import StepBatches, StepLoader

SIZE, GLOBAL, MICRO = 240, 24, 4


def _steps(world: int, epoch: int = 0, skip: int = 0) -> list[list[list[int]]]:
    """Per optimizer step, every micro-batch of it (in micro-batch order m = j * W + r)."""
    ranks = [StepBatches(SIZE, GLOBAL, MICRO, r, world, seed=3, epoch=epoch).skipping(skip) for r in range(world)]
    streams = [list(b) for b in ranks]
    accumulation = ranks[0].accumulation
    steps = []
    for k in range(len(streams[0]) // accumulation):
        steps.append([streams[m % world][k * accumulation + m // world] for m in range(GLOBAL // MICRO)])
    return steps


@pytest.mark.parametrize("world", [2, 3, 6])
def test_every_world_size_trains_the_same_micro_batches_at_each_step(world: int) -> None:
    assert _steps(world) == _steps(1)


def test_an_epoch_is_every_sample_once_and_each_epoch_shuffles_anew() -> None:
    first, second = _steps(3, epoch=0), _steps(3, epoch=1)
    assert sorted(i for step in first for micro in step for i in micro) == list(range(SIZE))
    assert first != second


def test_skipping_a_ranks_share_of_k_steps_resumes_at_step_k_plus_1_at_any_size() -> None:
    # trained 4 steps at 2 ranks, resumed at 3: Trainer skips 4 x accumulation(3) of each rank's micro-batches
    resumed = _steps(3, skip=4 * StepBatches(SIZE, GLOBAL, MICRO, 0, 3).accumulation)
    assert resumed == _steps(2)[4:]


def test_a_partial_last_global_batch_is_not_trained_and_a_world_that_does_not_split_is_refused() -> None:
    batches = StepBatches(SIZE + 5, GLOBAL, MICRO, 0, 2)
    assert len(batches) == (SIZE // GLOBAL) * batches.accumulation
    with pytest.raises(ValueError, match="does not split"):
        StepBatches(SIZE, GLOBAL, MICRO, 0, 4)  # 6 micro-batches over 4 ranks


def test_the_loader_follows_the_epoch_trainer_sets_and_a_resume_is_a_new_loader() -> None:
    loader = StepLoader(list(range(SIZE)), StepBatches(SIZE, GLOBAL, MICRO, 1, 3, seed=3), collate_fn=lambda b: b)
    loader.set_epoch(2)
    assert [list(b) for b in loader] == list(StepBatches(SIZE, GLOBAL, MICRO, 1, 3, seed=3, epoch=2))
    resumed = loader.skipping(5)
    resumed.set_epoch(2)
    assert [list(b) for b in resumed] == [list(b) for b in loader][5:] and len(loader.batches) == 20


def test_the_trainer_privates_it_overrides_exist_in_this_transformers() -> None:
    missing = [n for n in elastic_trainer.TRAINER_PRIVATES if not callable(getattr(transformers.Trainer, n, None))]
    assert not missing
    assert transformers.__version__.startswith(elastic_trainer.CHECKED_WITH)
