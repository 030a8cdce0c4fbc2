"""The pure parts of hot recovery: who heals whom, how the state is packed, when abandoned groups may go."""

from __future__ import annotations

from collections import namedtuple
from typing import Any

import torch

from elasticd.worker.hot.backend import _RELEASE_MARGIN_S, AbandonedGroups
from elasticd.worker.hot.heal import HealReport, _attach, _chunks, _detach, order_by_progress


def test_the_member_with_the_most_steps_comes_first_and_ties_go_to_the_smaller_id() -> None:
    assert order_by_progress({"w2": 41, "w1": 42, "j": 0}) == ["w1", "w2", "j"]
    assert order_by_progress({"b": 7, "a": 7}) == ["a", "b"]


def test_a_state_dict_comes_back_whole_after_its_tensors_travel_apart() -> None:
    Pair = namedtuple("Pair", "a b")
    state: dict[str, Any] = {
        "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(2, 2)}},
        "param_groups": [{"params": [0], "betas": (0.9, 0.999), "lr": 0.1}],
        "extra": Pair(torch.zeros(1), "x"),
    }
    tensors: list[torch.Tensor] = []
    skeleton = _detach(state, tensors)
    assert len(tensors) == 3 and "tensor" not in repr(skeleton)
    back = _attach(skeleton, [t.clone() for t in tensors])
    assert torch.equal(back["state"][0]["exp_avg"], state["state"][0]["exp_avg"])
    assert back["param_groups"] == state["param_groups"] and isinstance(back["extra"], Pair)


def test_tensors_travel_in_runs_of_one_dtype_within_the_chunk_size() -> None:
    tensors = [torch.zeros(4), torch.zeros(4), torch.zeros(2, dtype=torch.int64), torch.zeros(100), torch.zeros(1)]
    chunks = list(_chunks(tensors, chunk_bytes=40))
    assert [len(c) for c in chunks] == [2, 1, 1, 1]  # 16+16 bytes; a dtype change; 400 bytes alone; the rest
    assert [t for c in chunks for t in c] == tensors


def test_only_the_source_counts_bytes_sent_once_per_receiver() -> None:
    assert HealReport(rank=0, source=0, world_size=3, payload_bytes=100, tensors=4, seconds=0.1).bytes_sent == 200
    assert HealReport(rank=2, source=0, world_size=3, payload_bytes=100, tensors=4, seconds=0.1).bytes_sent == 0


def test_an_abandoned_group_is_kept_until_its_timeout_has_certainly_passed() -> None:
    now = [100.0]
    abandoned = AbandonedGroups(clock=lambda: now[0])
    old, older = object(), object()
    abandoned.keep(old, timeout_s=60.0)  # type: ignore[arg-type]  # any object stands for a group
    now[0] += 10
    abandoned.keep(older, timeout_s=600.0)  # type: ignore[arg-type]  # any object stands for a group
    now[0] = 100.0 + 60.0 + _RELEASE_MARGIN_S - 1
    assert abandoned.sweep() == 0 and len(abandoned) == 2
    now[0] += 2
    assert abandoned.sweep() == 1 and len(abandoned) == 1
