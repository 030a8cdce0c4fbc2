"""The heal on real gloo groups of two and three, every rank in this process (a thread each).

Members with the source's state (equal fingerprints) move nothing; members without it (a joiner, a corrupted or
lagging survivor) receive it in checked pieces from every member that has it. A rank that never comes stands for a
peer that died or hangs: the others fail within the heal's timeout.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import pytest
import torch

from elasticd.worker.hot import stripes
from elasticd.worker.hot.errors import HealError
from elasticd.worker.hot.fingerprint import fingerprint
from elasticd.worker.hot.heal import HealReport, heal
from elasticd.worker.sampler import DataPosition
from elasticd.worker.state import TrainingState
from tests.integration.gloo_groups import gloo_group, on_every_rank

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

SETTLE_S = 5.0  # generous "eventually" on a loaded box: a heal of these models completes in milliseconds
PIECE_BYTES = 64  # a few pieces per tensor: the stripes, their order and their trailers are exercised


class Trainee:
    """One member's objects: a model, AdamW, a schedule, progress."""

    def __init__(self, seed: int, hidden: int = 4) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(torch.nn.Linear(3, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.1)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: 1.0 / (1.0 + s))
        self.state = TrainingState()

    def train(self, steps: int) -> None:
        for _ in range(steps):
            self.model(torch.ones(2, 3)).pow(2).sum().backward()
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad()
            self.state = self.state.advanced(DataPosition(0, self.state.data.position + 2))


def trained(count: int, steps: int = 3) -> list[Trainee]:
    """``count`` members with the same state: same seed, same steps."""
    members = [Trainee(seed=0) for _ in range(count)]
    for member in members:
        member.train(steps)
    return members


def heal_all(
    members: list[Trainee], groups: list[Any], registered: list[list[Any]] | None = None, **kwargs: Any
) -> list[Any]:
    """Every member heals from rank 0 on its own thread (``registered``: each member's registered objects)."""
    return on_every_rank(
        lambda r: heal(
            0,
            members[r].model,
            members[r].optimizer,
            members[r].scheduler,
            members[r].state,
            registered=registered[r] if registered is not None else (),
            group=groups[r],
            **kwargs,
        ),
        len(members),
    )


def same_weights(a: Trainee, b: Trainee) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.model.parameters(), b.model.parameters(), strict=True))


def reports(outcomes: list[Any]) -> list[HealReport]:
    assert not any(isinstance(o, Exception) for o in outcomes), outcomes
    return [report for _, report in outcomes]


def test_heal_gives_a_fresh_member_the_sources_model_optimizer_schedule_and_progress() -> None:
    source, joiner = Trainee(seed=0), Trainee(seed=1)
    source.train(3)
    source.state = TrainingState(step=7, data=DataPosition(0, 84))
    members = [source, joiner]
    outcomes = heal_all(members, gloo_group(2))
    (sent_state, sent), (got_state, got) = outcomes
    assert got_state == sent_state == source.state
    assert same_weights(joiner, source) and all(p.grad is None for p in joiner.model.parameters())
    assert joiner.scheduler.state_dict() == source.scheduler.state_dict()
    assert joiner.optimizer.param_groups[0]["lr"] == source.optimizer.param_groups[0]["lr"]
    assert isinstance(sent, HealReport) and sent.receivers == got.receivers == (1,)
    assert got.healed and not sent.healed
    assert sent.sent == got.received > 0 and sent.received == got.sent == 0
    # the optimizer state came along: the next step is the same on both (a fresh AdamW would step differently)
    source.train(1)
    joiner.train(1)
    assert same_weights(joiner, source)


def test_members_that_hold_the_sources_state_move_nothing() -> None:
    members = trained(3)
    for report in reports(heal_all(members, gloo_group(3))):
        assert report.receivers == () and report.bytes_moved == 0 and not report.healed


def test_a_corrupted_survivor_and_only_it_is_healed_from_both_others_at_once() -> None:
    members = trained(3)
    with torch.no_grad():
        next(members[2].model.parameters())[0, 0] += 1e-3  # one value of one member, one rounding step is enough
    assert not same_weights(members[2], members[0])
    source, other, corrupted = reports(heal_all(members, gloo_group(3), chunk_bytes=PIECE_BYTES))
    assert source.receivers == other.receivers == corrupted.receivers == (2,)
    assert corrupted.healed and not source.healed and not other.healed
    assert source.received == other.received == 0 and corrupted.sent == 0
    assert source.sent > 0 and other.sent > 0, "both members with the source's state send a stripe"
    assert corrupted.received >= source.sent + other.sent  # the pieces, and the description
    assert same_weights(members[2], members[0])
    for member in members:
        member.train(1)
    assert same_weights(members[2], members[0]) and same_weights(members[1], members[0])


def test_a_survivor_a_step_behind_takes_the_sources_step_and_optimizer_state() -> None:
    members = trained(3)
    members[0].train(1)  # the source's all-reduce of the last step completed, the others' did not
    members[1].train(1)
    outcomes = heal_all(members, gloo_group(3), chunk_bytes=PIECE_BYTES)
    assert reports(outcomes)[2].receivers == (2,)
    assert outcomes[2][0] == members[0].state and same_weights(members[2], members[0])
    assert (
        members[2].optimizer.state_dict()["state"][0]["step"] == members[0].optimizer.state_dict()["state"][0]["step"]
    )


def test_a_joiner_gets_its_pieces_from_every_member_that_has_the_state() -> None:
    members = [*trained(2), Trainee(seed=5)]
    reports_ = reports(heal_all(members, gloo_group(3), chunk_bytes=PIECE_BYTES))
    state_bytes = sum(t.numel() * t.element_size() for t in members[0].model.parameters())
    assert reports_[0].sent > state_bytes // 4 and reports_[1].sent > state_bytes // 4
    assert same_weights(members[2], members[0])
    members[0].train(1)
    members[2].train(1)
    assert same_weights(members[2], members[0])


def corrupt_piece(monkeypatch: pytest.MonkeyPatch, number: int) -> None:
    """Piece ``number`` arrives with bytes that do not match its checksum: what a bad link or buffer would do."""
    trailer = stripes._trailer

    def wrong_sum(data: torch.Tensor, piece: int, device: torch.device) -> torch.Tensor:
        sent = trailer(data, piece, device)
        if piece == number:
            sent[0] += 1
        return sent

    monkeypatch.setattr(stripes, "_trailer", wrong_sum)


def test_a_piece_that_fails_its_checksum_fails_the_heal_on_every_member(monkeypatch: pytest.MonkeyPatch) -> None:
    corrupt_piece(monkeypatch, 1)
    members = [*trained(2), Trainee(seed=5)]
    outcomes = heal_all(members, gloo_group(3), chunk_bytes=PIECE_BYTES, timeout=timedelta(seconds=10))
    assert all(isinstance(o, HealError) for o in outcomes), outcomes
    assert "piece 1 of the state" in str(outcomes[2]) and "checksum" in str(outcomes[2])
    assert "a receiver did not get the state" in str(outcomes[0])


class Registered:
    """An object registered for checkpointing: a count, a tensor and a nested plain value in its state."""

    def __init__(self, steps: int = 0) -> None:
        self.steps, self.ema = steps, torch.full((3,), float(steps))
        self.history: list[tuple[str, float]] = [("start", steps)]

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "ema": self.ema, "history": self.history}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps, self.history = state["steps"], state["history"]
        self.ema.copy_(state["ema"])


def test_heal_gives_every_member_the_sources_registered_objects_as_a_restart_would() -> None:
    members = trained(2)  # equal models: the registered objects alone make the member a receiver
    objects = [[Registered(76), Registered(5)], [Registered(), Registered()]]
    objects[0][1].history.append(("ema", 0.5))
    outcomes = heal_registered(members, objects)
    assert reports(outcomes)[1].healed
    for mine, theirs in zip(objects[1], objects[0], strict=True):
        assert mine.steps == theirs.steps and mine.history == theirs.history
        assert torch.equal(mine.ema, theirs.ema) and mine.ema is not theirs.ema
    assert objects[1][0].steps == 76 and objects[1][1].history == [("start", 5), ("ema", 0.5)]


def test_a_registered_tensor_that_differs_makes_its_member_a_receiver() -> None:
    members = trained(2)
    objects = [[Registered(4)], [Registered(4)]]
    objects[1][0].ema[1] = 9.0
    outcomes = heal_registered(members, objects)
    assert reports(outcomes)[1].healed and objects[1][0].ema.tolist() == [4.0, 4.0, 4.0]


def heal_registered(members: list[Trainee], objects: list[list[Any]]) -> list[Any]:
    return heal_all(members, gloo_group(len(members)), objects)


def test_a_member_with_other_registered_objects_fails_the_heal_on_every_member() -> None:
    outcomes = heal_registered(trained(2), [[Registered(3)], []])
    assert all(isinstance(o, HealError) for o in outcomes), outcomes
    assert "objects registered for checkpointing [], the source has ['Registered']" in str(outcomes[1])


def test_a_member_whose_model_does_not_fit_fails_the_heal_on_every_member() -> None:
    members = [Trainee(seed=0), Trainee(seed=0, hidden=5)]
    outcomes = heal_all(members, gloo_group(2))
    assert all(isinstance(o, HealError) for o in outcomes), outcomes
    assert "does not fit" in str(outcomes[0]) and "another member" in str(outcomes[0])
    assert "parameters differ from the source's" in str(outcomes[1])


def test_a_source_that_never_comes_fails_the_heal_within_its_timeout() -> None:
    pair = gloo_group(2)
    member = Trainee(seed=1)
    started = time.monotonic()
    with pytest.raises(HealError, match="fingerprint failed"):
        heal(
            0,
            member.model,
            member.optimizer,
            member.scheduler,
            member.state,
            group=pair[1],
            timeout=timedelta(seconds=0.5),
        )
    assert time.monotonic() - started < SETTLE_S
    mine = torch.zeros(4, dtype=torch.int64)
    pair[0].allgather([[torch.empty_like(mine), torch.empty_like(mine)]], [mine]).wait(timedelta(seconds=30))


def test_after_a_failed_heal_only_the_members_that_sent_still_hold_a_state_to_give(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A receiver's tensors may be half written when its heal fails: it must never be the source of the next heal."""
    corrupt_piece(monkeypatch, 1)
    members = [*trained(2), Trainee(seed=5)]
    outcomes = heal_all(members, gloo_group(3), chunk_bytes=PIECE_BYTES, timeout=timedelta(seconds=10))
    assert all(isinstance(o, HealError) for o in outcomes), outcomes
    assert [o.holds_state for o in outcomes] == [True, True, False]


def test_a_member_waiting_on_a_live_peer_is_released_when_the_heal_is_given_up_elsewhere() -> None:
    """Only the direct peers of a dead member see gloo fail; the others learn it from the epoch's notice."""
    group = gloo_group(3, timeout=timedelta(seconds=60))
    members = [*trained(2), Trainee(seed=5)]
    given_up_at = time.monotonic() + 0.3  # rank 0, alive, never comes: another member's notice says the heal failed

    def notice() -> str | None:
        return "r0: the heal failed" if time.monotonic() >= given_up_at else None

    started = time.monotonic()
    outcomes = on_every_rank(
        lambda r: heal(
            0,
            members[r].model,
            members[r].optimizer,
            members[r].scheduler,
            members[r].state,
            group=group[r],
            timeout=timedelta(seconds=60),
            abandon=notice,
        ),
        3,
        ranks=(1, 2),
    )
    waited = time.monotonic() - started
    assert all(isinstance(o, HealError) and "given up: r0: the heal failed" in str(o) for o in outcomes[1:]), outcomes
    assert waited < SETTLE_S, f"released after {waited:.1f}s, not by the notice"
    # rank 0 comes after all: the abandoned gather completes, so that no group is left with a pending collective
    mine = fingerprint(members[0].model, members[0].optimizer, members[0].scheduler, (), members[0].state)
    out = [torch.empty_like(mine) for _ in range(3)]
    group[0].allgather([out], [mine]).wait(timedelta(seconds=30))
