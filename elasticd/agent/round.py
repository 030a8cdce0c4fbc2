"""The round this node's workers train in: its number, fencing token, members, and how far it moved in place.

Two threads write it. The agent's thread starts each round (after a rendezvous, or a private round to join a group
in place) and, on a restart, decides whether the next one comes from the rendezvous. The beat receiver's thread
applies the workers' beats: the rank each worker trains as now, and after a re-formation in place (a
``reconfigured`` beat) the group's nodes, membership epoch and token. Every read and write goes through one lock;
readers get copies, so no caller holds state another thread is changing.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from elasticd.group_record import GroupToJoin
from elasticd.messages import Kind, kind_of


class RoundState:
    """One node's round, shared by the agent's thread and the beat receiver's."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._round: int | None = None
        self._token: str | None = None  # the fencing token of the current group's workers
        self._round_token: str | None = None  # the token the round started with: its workers' member names
        self._members: list[str] = []  # node ids: the round's, or the group's since it re-formed in place
        # local rank -> the rank its worker's latest beat gave: in the group it trains in now (in place the round's
        # ranks are stale, and a joiner's private round numbers its workers from 0 like the first node's)
        self._beat_ranks: dict[int, int] = {}
        self._regrouped = False  # the workers re-formed their group in place during this round
        self._epoch = 0  # the membership epoch the workers train in (hot recovery; 0 otherwise)
        self._joining: GroupToJoin | None = None  # this round is private: its workers join that group in place
        self._joined_ever = False  # this node came into the run by joining a group in place (ever)
        self._through_rendezvous = False  # the next round comes from the rendezvous, not from joining in place

    # -- the agent's thread ----------------------------------------------------------------------------------------

    def next_round_may_join(self) -> bool:
        """A rendezvous begins: forget the group the last round joined, and say whether this one may join one in
        place (a node that starts, or restarts its workers, does; after giving up on it once, it goes through the
        rendezvous)."""
        with self._lock:
            may_join = not self._through_rendezvous
            self._through_rendezvous, self._joining = False, None
            return may_join

    def join(self, group: GroupToJoin) -> None:
        """The next round is private: its workers join ``group`` in place."""
        with self._lock:
            self._joining, self._joined_ever = group, True

    def start(self, round_: int | None, members: list[str], token: str | None, round_token: str | None) -> list[str]:
        """A round began with ``members`` and the workers' ``token``; returns the previous round's members."""
        with self._lock:
            previous = self._members
            self._round, self._members = round_, list(members)
            self._token, self._round_token = token, round_token
            self._regrouped, self._epoch, self._beat_ranks = False, 0, {}
            return list(previous)

    def adopt_token(self, token: str) -> None:
        """The group re-formed in place under ``token`` with this node's workers in it: theirs now."""
        with self._lock:
            self._token = token

    def restarting(self) -> None:
        """The workers restart: if joining in place did not work out, the next round comes from the rendezvous."""
        with self._lock:
            self._through_rendezvous = self._joining is not None and not self._regrouped

    # -- the beat receiver's thread --------------------------------------------------------------------------------

    def on_beat(self, beat: Mapping[str, Any]) -> None:
        rank, local_rank = beat.get("rank"), beat.get("local_rank")
        with self._lock:
            if isinstance(rank, int) and isinstance(local_rank, int):
                self._beat_ranks[local_rank] = rank
            if kind_of(beat) is not Kind.RECONFIGURED:
                return
            self._regrouped = True  # the round's rendezvous no longer says who is in the group
            nodes = beat.get("node_ids")
            if isinstance(nodes, list) and nodes:
                self._members = [str(n) for n in nodes]  # the group's nodes now, not the round's
            if isinstance(beat.get("epoch"), int):
                self._epoch = beat["epoch"]  # the next hang is agreed afresh, in this epoch
            if beat.get("token"):
                self._token = str(beat["token"])  # a joiner's workers were admitted: the epoch's token is theirs

    # -- reads (any thread) ----------------------------------------------------------------------------------------

    @property
    def round(self) -> int | None:
        with self._lock:
            return self._round

    @property
    def token(self) -> str | None:
        with self._lock:
            return self._token

    @property
    def round_token(self) -> str | None:
        with self._lock:
            return self._round_token

    @property
    def members(self) -> list[str]:
        with self._lock:
            return list(self._members)

    @property
    def regrouped_in_place(self) -> bool:
        with self._lock:
            return self._regrouped

    @property
    def epoch(self) -> int:
        with self._lock:
            return self._epoch

    @property
    def joining(self) -> GroupToJoin | None:
        with self._lock:
            return self._joining

    @property
    def joined_in_place(self) -> bool:
        with self._lock:
            return self._joined_ever

    def waiting_to_join(self) -> bool:
        """This node's workers wait to be admitted to a group in place."""
        with self._lock:
            return self._joining is not None and not self._regrouped

    def rank_of(self, local_rank: int, round_rank: int) -> int:
        """A local worker's rank in the group it trains in now: as its beats say, else the round's."""
        with self._lock:
            return self._beat_ranks.get(local_rank, round_rank)
