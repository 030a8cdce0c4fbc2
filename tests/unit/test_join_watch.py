"""worker/hot_path.py's JoinWatch: a joiner keeps waiting on a group that is alive or out of reach, gives up on one
that is gone at once, and on one that stays silent (every member stopped or wedged) after the grace."""

from __future__ import annotations

from elasticd.group_record import Reach
from elasticd.worker.hot_path import JoinWatch


class Answers:
    def __init__(self) -> None:
        self.reach = Reach.ALIVE
        self.now = 0.0


def watch(answers: Answers, grace_s: float = 10.0) -> JoinWatch:
    return JoinWatch(lambda: answers.reach, clock=lambda: answers.now, grace_s=grace_s)


def test_alive_and_out_of_reach_keep_the_joiner_and_gone_ends_it_at_once() -> None:
    answers = Answers()
    wanted = watch(answers)
    assert wanted()
    answers.reach = Reach.OUT_OF_REACH
    answers.now = 1000.0  # however long: a partition that heals
    assert wanted()
    answers.reach = Reach.GONE
    assert not wanted()


def test_a_silence_that_lasts_the_grace_ends_the_wait_and_a_greeting_in_between_starts_it_over() -> None:
    answers = Answers()
    wanted = watch(answers, grace_s=10.0)
    answers.reach = Reach.SILENT
    assert wanted()  # silent since 0
    answers.now = 9.0
    assert wanted()
    answers.reach, answers.now = Reach.ALIVE, 9.5  # a starved member greets again
    assert wanted()
    answers.reach, answers.now = Reach.SILENT, 12.0
    assert wanted()  # silent since 12: the earlier silence does not count
    answers.now = 21.9
    assert wanted()
    answers.now = 22.0
    assert not wanted()  # a group whose every member stays silent admits nobody
