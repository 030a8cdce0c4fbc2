"""The batch plan keeps the global batch constant, and says on one line which node counts fit when it cannot."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from elasticd.errors import EXIT_USAGE, ConfigError
from elasticd.worker.batching import BatchConstraint, BatchPlan, BatchPlanError, plan_batches, spare_warning


@pytest.mark.parametrize(
    ("global_batch", "micro", "world", "accumulation"),
    [(256, 32, 1, 8), (256, 32, 4, 2), (256, 32, 8, 1), (96, 4, 3, 8), (7, 7, 1, 1), (12, 1, 12, 1)],
)
def test_plan_keeps_micro_times_world_times_accumulation_equal_to_global(
    global_batch: int, micro: int, world: int, accumulation: int
) -> None:
    plan = plan_batches(global_batch, micro, world)
    assert plan == BatchPlan(global_batch, micro, world, accumulation)
    assert plan.per_rank == micro * accumulation
    assert plan.per_rank * world == global_batch


def test_mismatch_error_is_one_line_and_lists_the_node_counts_that_fit() -> None:
    with pytest.raises(BatchPlanError) as caught:
        plan_batches(256, 32, 12, nproc_per_node=4, min_nodes=1, max_nodes=8)
    error = caught.value
    message = str(error)
    assert "\n" not in message
    assert message.startswith("global_batch_size: global batch 256")
    assert "micro-batches of 32 over 12 workers" in message
    assert "it fits at 1 or 2 nodes (4 processes per node) of the range 1..8" in message
    assert error.fitting_nodes == (1, 2)
    assert (error.global_batch_size, error.micro_batch_size, error.world_size) == (256, 32, 12)


def test_mismatch_error_is_a_config_error_on_global_batch_size_with_exit_code_2() -> None:
    with pytest.raises(ConfigError) as caught:
        plan_batches(256, 32, 3, max_nodes=8)
    assert caught.value.key == "global_batch_size"
    assert caught.value.exit_code == EXIT_USAGE
    assert "it fits at 1, 2, 4 or 8 nodes" in str(caught.value)


def test_mismatch_error_suggests_a_micro_batch_that_fits_this_world() -> None:
    with pytest.raises(BatchPlanError, match="micro_batch_size 24 fits this world"):
        plan_batches(96, 32, 2, max_nodes=3)
    assert plan_batches(96, 24, 2).accumulation == 2


def test_when_no_node_count_fits_the_error_suggests_sizes_that_do() -> None:
    with pytest.raises(BatchPlanError) as caught:
        plan_batches(100, 32, 2, max_nodes=4)
    message = str(caught.value)
    assert caught.value.fitting_nodes == ()
    assert "it fits no node count in 1..4" in message
    assert "micro_batch_size 25 or global_batch_size 128" in message
    assert "global_batch_size 384 for every node count in the range" in message
    assert plan_batches(100, 25, 2).accumulation == 2
    assert plan_batches(128, 32, 2).accumulation == 2
    assert all(plan_batches(384, 32, world) for world in range(1, 5))


def test_a_global_batch_for_every_node_count_is_not_suggested_when_it_is_huge() -> None:
    with pytest.raises(BatchPlanError) as caught:
        plan_batches(100, 7, 3, max_nodes=64)
    assert "for every node count" not in str(caught.value)
    assert "global_batch_size 105" in str(caught.value)


@given(
    global_batch=st.integers(1, 512),
    micro=st.integers(1, 64),
    nproc=st.integers(1, 8),
    nodes=st.integers(1, 16),
    extra_nodes=st.integers(0, 16),
)
def test_fitting_nodes_are_exactly_the_node_counts_that_plan(
    global_batch: int, micro: int, nproc: int, nodes: int, extra_nodes: int
) -> None:
    def fits(n: int) -> bool:
        try:
            plan_batches(global_batch, micro, n * nproc)
        except BatchPlanError:
            return False
        return True

    max_nodes = nodes + extra_nodes
    try:
        plan = plan_batches(global_batch, micro, nodes * nproc, nproc_per_node=nproc, max_nodes=max_nodes)
    except BatchPlanError as error:
        assert error.fitting_nodes == tuple(n for n in range(1, max_nodes + 1) if fits(n))
        assert "\n" not in str(error)
    else:
        assert plan.micro_batch_size * plan.world_size * plan.accumulation == global_batch


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"global_batch_size": 0}, "global_batch_size"),
        ({"global_batch_size": -8}, "global_batch_size"),
        ({"global_batch_size": 8.0}, "global_batch_size"),
        ({"micro_batch_size": 0}, "micro_batch_size"),
        ({"micro_batch_size": True}, "micro_batch_size"),
        ({"world_size": 0}, "world_size"),
        ({"nproc_per_node": 0}, "nproc_per_node"),
        ({"min_nodes": 0}, "min_nodes"),
        ({"max_nodes": -1}, "max_nodes"),
        ({"min_nodes": 4, "max_nodes": 2}, "min_nodes"),
    ],
)
def test_bad_values_are_rejected_with_a_message_naming_the_argument(kwargs: dict[str, object], key: str) -> None:
    arguments: dict[str, object] = {"global_batch_size": 8, "micro_batch_size": 2, "world_size": 2, **kwargs}
    with pytest.raises(ConfigError) as caught:
        plan_batches(**arguments)  # type: ignore[arg-type]  # bad values on purpose
    assert caught.value.key == key
    assert not isinstance(caught.value, BatchPlanError)
    assert str(caught.value).startswith(f"{key}: ")


def test_an_inconsistent_plan_cannot_be_built_by_hand() -> None:
    with pytest.raises(ValueError, match="inconsistent batch plan"):
        BatchPlan(global_batch_size=256, micro_batch_size=32, world_size=3, accumulation=2)


# -- the constraint the daemons size rounds with (agent/spares.py) -----------------------------------------------


def test_constraint_trains_the_largest_node_count_that_splits_the_global_batch() -> None:
    constraint = BatchConstraint(global_batch_size=16, micro_batch_size=4, nproc_per_node=1)
    assert constraint.fitting(2, 4) == (2, 4)
    assert [constraint.training_nodes(n, 2, 4) for n in (2, 3, 4)] == [2, 2, 4]
    assert constraint.training_nodes(5, 2, 4) == 4  # never above --max-nodes
    assert constraint.training_nodes(3, 3, 4) == 0  # only 4 fits and 3 are here: nobody can train yet


def test_constraint_counts_every_process_of_a_node() -> None:
    constraint = BatchConstraint(global_batch_size=48, micro_batch_size=4, nproc_per_node=2)  # 8 samples per node
    assert constraint.fitting(1, 8) == (1, 2, 3, 6)
    assert constraint.training_nodes(5, 1, 8) == 3


def test_the_card_scale_example_keeps_six_of_seven_nodes_training() -> None:
    # issue 10, Why 14: 8 nodes, global batch 48 in micro-batches of 1, one node lost
    assert BatchConstraint(48, 1, 1).training_nodes(7, 2, 8) == 6


@given(
    global_batch=st.integers(1, 512),
    micro=st.integers(1, 64),
    nproc=st.integers(1, 8),
    low=st.integers(1, 8),
    span=st.integers(0, 8),
    nodes=st.integers(1, 20),
)
def test_training_nodes_agrees_with_plan_batches(
    global_batch: int, micro: int, nproc: int, low: int, span: int, nodes: int
) -> None:
    constraint = BatchConstraint(global_batch, micro, nproc)
    training = constraint.training_nodes(nodes, low, low + span)
    for n in range(low, min(nodes, low + span) + 1):
        try:
            plan_batches(global_batch, micro, n * nproc)
        except BatchPlanError:
            assert n != training
        else:
            assert n <= training  # the largest count that plans is the one that trains
    if training:
        assert low <= training <= min(nodes, low + span)
        assert plan_batches(global_batch, micro, training * nproc).world_size == training * nproc


def test_batches_for_every_count_split_over_each_count_of_the_range() -> None:
    constraint = BatchConstraint(16, 4, 1)
    assert constraint.batches_for_every_count(2, 4) == (48, 96, 144)
    for batch in constraint.batches_for_every_count(2, 4):
        assert all(BatchConstraint(batch, 4, 1).fits(n) for n in range(2, 5))


def test_spare_warning_is_one_line_naming_who_trains_and_the_batches_that_fit_every_count() -> None:
    message = spare_warning(BatchConstraint(16, 4, 1), nodes=3, training=2, low=2, high=4)
    assert message == (
        "global batch 16 does not split into micro-batches of 4 over 3 nodes (1 process per node): 2 train and 1"
        " waits as a spare; global batches that fit every node count in 2..4: 48, 96, 144"
    )
    several = spare_warning(BatchConstraint(48, 1, 1), nodes=7, training=4, low=2, high=8)
    assert "4 train and 3 wait as spares" in several and "2..8: 840, 1680, 2520" in several


def test_spare_warning_when_nobody_can_train_names_the_counts_to_wait_for() -> None:
    message = spare_warning(BatchConstraint(32, 4, 2), nodes=3, training=0, low=3, high=4)
    assert "over 3 nodes (2 processes per node): all 3 wait as spares until the round has 4 nodes" in message
    assert "\n" not in message


@pytest.mark.parametrize(
    "data",
    [
        None,
        [],
        {},
        {"global_batch_size": 16, "micro_batch_size": 4},
        {"global_batch_size": 16, "micro_batch_size": 4, "nproc_per_node": 0},
        {"global_batch_size": True, "micro_batch_size": 4, "nproc_per_node": 1},
        {"global_batch_size": "16", "micro_batch_size": 4, "nproc_per_node": 1},
        {"global_batch_size": 16.0, "micro_batch_size": 4, "nproc_per_node": 1},
    ],
)
def test_a_constraint_that_does_not_parse_is_none(data: object) -> None:
    assert BatchConstraint.from_json(data) is None


def test_a_constraint_survives_json() -> None:
    constraint = BatchConstraint(16, 4, 2)
    assert BatchConstraint.from_json({**constraint.to_json(), "kind": "batch_plan", "rank": 3}) == constraint
