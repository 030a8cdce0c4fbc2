"""The pure parts of hot recovery: who heals whom, the state's fingerprint, how the state is packed and cut into
pieces, when abandoned groups may go."""

from __future__ import annotations

from collections import namedtuple
from typing import Any

import torch

from elasticd.worker.hot.backend import AbandonedGroups
from elasticd.worker.hot.fingerprint import WIDTH, fingerprint
from elasticd.worker.hot.given_up import GivenUp
from elasticd.worker.hot.heal import HealReport, _attach, _detach, order_by_progress
from elasticd.worker.hot.stripes import Layout, checksum
from elasticd.worker.sampler import DataPosition
from elasticd.worker.state import TrainingState


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


def test_a_report_says_whether_its_member_was_healed_and_what_it_moved() -> None:
    receiver = HealReport(rank=2, source=0, world_size=3, receivers=(2,), received=90, sent=0, tensors=4, seconds=0.1)
    sender = HealReport(rank=1, source=0, world_size=3, receivers=(2,), received=0, sent=40, tensors=4, seconds=0.1)
    assert receiver.healed and not sender.healed
    assert (receiver.bytes_moved, sender.bytes_moved) == (90, 40)


class Collective:
    """Stands for a gloo Work: ends when the test says so."""

    def __init__(self) -> None:
        self.done = False

    def is_completed(self) -> bool:
        return self.done


def test_an_abandoned_group_is_released_once_nothing_given_up_in_it_is_pending() -> None:
    given_up = GivenUp()
    abandoned = AbandonedGroups(given_up)
    old, older, idle = object(), object(), object()  # any object stands for a group
    in_old, in_older, unknown = Collective(), Collective(), Collective()
    given_up.hold(in_old, old)
    given_up.hold(in_older, older)
    for group in (old, older, idle):
        abandoned.keep(group)  # type: ignore[arg-type]
    assert abandoned.sweep() == 1 and len(abandoned) == 2  # nothing was given up on in idle
    in_old.done = True
    given_up.hold(unknown, None)  # a collective of no known group pins every group
    assert abandoned.sweep() == 0 and len(abandoned) == 2
    unknown.done = True
    assert abandoned.sweep() == 1 and len(abandoned) == 1 and given_up.pending() == 1
    assert abandoned.drain(0.2, interval_s=0.01) == 1  # a peer that never answers: still held after the drain
    in_older.done = True
    assert abandoned.drain(5.0, interval_s=0.01) == 0 and given_up.pending() == 0


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.norm, self.last = torch.nn.Linear(3, 5), torch.nn.BatchNorm1d(5), torch.nn.Linear(5, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(self.norm(self.first(x)))


def member(seed: int = 0, steps: int = 2) -> tuple[Net, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    for _ in range(steps):
        model(torch.ones(4, 3)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def print_of(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: TrainingState | None = None) -> list[int]:
    return fingerprint(model, optimizer, None, [], state or TrainingState(step=2)).tolist()


def test_members_with_the_same_history_have_the_same_fingerprint() -> None:
    first, second = print_of(*member()), print_of(*member())
    assert first == second and len(first) == WIDTH


def test_one_bit_of_one_parameter_changes_the_fingerprint() -> None:
    model, optimizer = member()
    before = print_of(model, optimizer)
    with torch.no_grad():
        weight = model.first.weight.view(-1)
        weight.view(torch.int32)[3] ^= 1
    assert print_of(model, optimizer) != before


def test_a_buffer_a_step_count_and_the_progress_each_change_it() -> None:
    model, optimizer = member()
    before = print_of(model, optimizer)
    running_mean = model.norm.running_mean
    assert running_mean is not None
    running_mean[0] += 1.0
    assert print_of(model, optimizer) != before
    model, optimizer = member()
    optimizer.state[model.first.weight]["step"] += 1
    assert print_of(model, optimizer) != before
    model, optimizer = member()
    assert print_of(model, optimizer, TrainingState(step=2, data=DataPosition(0, 8))) != before


def test_two_tensors_that_trade_values_do_not_look_the_same() -> None:
    a, b = torch.nn.Linear(2, 2, bias=False), torch.nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        a.weight.copy_(torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
        b.weight.copy_(torch.tensor([[5.0, 6.0], [7.0, 8.0]]))
    pair = torch.nn.Sequential(a, b)
    first, second = torch.nn.Linear(2, 2, bias=False), torch.nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        first.weight.copy_(b.weight)
        second.weight.copy_(a.weight)
    swapped = torch.nn.Sequential(first, second)
    optimizer = torch.optim.SGD(pair.parameters(), lr=0.1)
    other = torch.optim.SGD(swapped.parameters(), lr=0.1)
    assert (
        fingerprint(pair, optimizer, None, [], TrainingState()).tolist()
        != fingerprint(swapped, other, None, [], TrainingState()).tolist()
    )


def test_the_layout_covers_every_byte_once_and_no_piece_spans_two_tensors() -> None:
    tensors = [torch.zeros(3), torch.zeros(5, dtype=torch.float64), torch.zeros(0), torch.zeros(7, dtype=torch.int16)]
    layout = Layout.of(tensors, piece_bytes=16)
    assert layout.total == 12 + 40 + 0 + 14
    assert [(p.tensor, p.first, p.end) for p in layout.pieces] == [
        (0, 0, 12),
        (1, 0, 16),
        (1, 16, 32),
        (1, 32, 40),
        (3, 0, 14),
    ]
    assert [p.number for p in layout.pieces] == list(range(5))
    assert all(p.first % 8 == 0 for p in layout.pieces)  # every piece's checksum reads whole int64 from its start


def test_pieces_are_dealt_to_senders_by_bytes() -> None:
    layout = Layout.of([torch.zeros(64), torch.zeros(2), torch.zeros(2), torch.zeros(2)], piece_bytes=128)
    owners = layout.senders_of(2)
    assert owners == [0, 1, 0, 1, 0]  # 128 bytes twice, then each small one where the load is least
    loads = [sum(p.size for p, o in zip(layout.pieces, owners, strict=True) if o == s) for s in (0, 1)]
    assert loads == [144, 136]


def test_the_checksum_reads_whole_int64_and_the_tail_bytes_as_themselves() -> None:
    data = torch.arange(11, dtype=torch.uint8)
    head = int(data[:8].view(torch.int64).item())
    assert checksum(data) == head + 8 + 9 + 10
    odd = torch.zeros(17, dtype=torch.uint8)[1:]  # a view whose storage does not start 8-aligned
    assert checksum(odd) == 0


def test_a_piece_size_that_is_not_a_multiple_of_eight_is_refused() -> None:
    try:
        Layout.of([torch.zeros(4)], piece_bytes=12)
    except ValueError as exc:
        assert "multiple of 8" in str(exc)
    else:
        raise AssertionError("piece_bytes=12 was accepted")
