"""Membership epochs for recovery in place: who trains now, decided by one etcd transaction that also moves the fence.

Keys of a run (``elasticd/keys.py``)::

    membership/epoch                    the decision in force: number, members in rank order, heal source, token
    membership/bids/<epoch>/<member>    a member's bid to be in that epoch: its old rank and committed step
    membership/joiners/<epoch>/<member> beside a joiner's bid: what the members watch (never the bids themselves)

After a failure every surviving member bids for the next epoch (a joiner bids with no old rank). The epoch is decided
by whichever member first sees every member of the current epoch either bid or declared dead by the daemons'
liveness verdict, never by a timer shorter than a step (a short grace once excluded a live survivor whose steps took
seconds: ``../shared/HOT-RECOVERY.md``), and only with at least ``min_members`` bids; fewer fall back to the cold
path (:class:`BelowMinimum`). Ranks follow committed steps (most first: rank 0 is the heal source), then old rank.

**One transaction** compares the epoch key's revision with the one the decider read, and writes the decision *and a
new lineage token* (``<round>.e<epoch>.<64 random bits>``, ``elasticd/lineage.py``). So a member left out of an epoch
(a node that was stopped and resumes, a partition's minority) finds an epoch without itself, and can no longer
commit a checkpoint: the fence it holds was replaced in the same write. A decider that loses the race reads the
winner's decision. Bids are never deleted while an epoch may still read them (a check-then-get of a key another
member deleted races); :meth:`Membership.forget` clears an old epoch's bids.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

from elasticd.errors import ElasticdError
from elasticd.etcd.client import EtcdClient
from elasticd.keys import RunKeys


class BelowMinimum(ElasticdError):
    """Fewer members than the minimum are left for the next epoch: recovery in place is off, restart cold."""

    def __init__(self, epoch: int, members: Collection[str], minimum: int) -> None:
        self.epoch, self.members, self.minimum = epoch, tuple(sorted(members)), minimum
        super().__init__(f"epoch {epoch}: {len(self.members)} member(s) left, at least {minimum} needed")


@dataclass(frozen=True, slots=True)
class Bid:
    member: str
    old_rank: int | None  # None: a joiner
    step: int  # the member's committed optimizer steps
    leaving: bool = False  # its node leaves: accounted for, but not in the epoch

    def encode(self) -> bytes:
        data = {"member": self.member, "old_rank": self.old_rank, "step": self.step, "leaving": self.leaving}
        return json.dumps(data).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Bid:
        data = json.loads(raw)
        rank = data.get("old_rank")
        return cls(
            str(data["member"]), None if rank is None else int(rank), int(data["step"]), bool(data.get("leaving"))
        )


# The step a member bids with after a heal failed on it (pieces may have been written into its tensors): it ranks after
# every member that holds a state, and an epoch whose source bid it has no member to heal from.
UNHEALED_STEP = -1


@dataclass(frozen=True, slots=True)
class Epoch:
    number: int
    members: tuple[str, ...]  # in rank order
    source: str  # the member the others heal from (rank 0)
    step: int  # the source's committed steps: where the epoch resumes
    token: str  # the lineage token in force for this epoch
    reason: str  # failure, hang, join, leave

    def rank_of(self, member: str) -> int | None:
        return self.members.index(member) if member in self.members else None

    def encode(self) -> bytes:
        return json.dumps(
            {
                "epoch": self.number,
                "members": list(self.members),
                "source": self.source,
                "step": self.step,
                "token": self.token,
                "reason": self.reason,
            }
        ).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Epoch:
        d = json.loads(raw)
        return cls(int(d["epoch"]), tuple(d["members"]), str(d["source"]), int(d["step"]), str(d["token"]), d["reason"])


def epoch_token(round_: int, epoch: int) -> str:
    """A lineage token that never repeats and names the epoch it fences (``writer_id`` keeps the random part)."""
    return f"{round_}.e{epoch}.{secrets.token_hex(8)}"


def rank_order(bids: Collection[Bid]) -> list[Bid]:
    """Most committed steps first (the heal source), then old members by old rank, then joiners by name."""
    return sorted(bids, key=lambda b: (-b.step, b.old_rank is None, b.old_rank or 0, b.member))


class Membership:
    """One run's membership epochs in etcd."""

    def __init__(self, client: EtcdClient, keys: RunKeys, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._client = client
        self._keys = keys
        self._clock = clock

    def current(self) -> tuple[Epoch, int] | None:
        """The epoch in force and its key's revision (None: no epoch decided yet)."""
        found = self._client.get(self._keys.membership_epoch)
        return None if found is None else (Epoch.decode(found[0]), found[1])

    def admitted_nodes(self, round_: int, epoch: int) -> list[str]:
        """The nodes of the epoch in force when it is newer than ``epoch`` and of round ``round_`` (its token names
        the round): a join being admitted, decided in etcd before its first step tells any daemon. Each member's
        node comes from its liveness record (``membership_member``); a member without one is left out."""
        found = self.current()
        if found is None:
            return []
        current = found[0]
        if current.number <= epoch or current.token.split(".", 1)[0] != str(round_):
            return []
        nodes = []
        for member in current.members:
            record = self._client.get(self._keys.membership_member(member))
            node = json.loads(record[0]).get("node") if record is not None else None
            if isinstance(node, str) and node not in nodes:
                nodes.append(node)
        return nodes

    def bid(self, epoch: int, bid: Bid) -> None:
        """Ask to be in ``epoch`` (rewritten, never deleted, if asked again)."""
        self._client.put_all(bid_items(self._keys, epoch, [bid]))

    def bids(self, epoch: int) -> dict[str, Bid]:
        found = self._client.get_prefix(self._keys.membership_bids_prefix(epoch))
        return {bid.member: bid for bid in (Bid.decode(raw) for _, raw, _ in found)}

    def try_decide(
        self,
        epoch: int,
        previous: Collection[str],
        is_dead: Callable[[str], bool],
        *,
        min_members: int,
        round_: int,
        reason: str,
        fence: str | None = None,
        fits: Callable[[int], bool] | None = None,
        out: Callable[[str], bool] = lambda _member: False,
    ) -> Epoch | None:
        """Decide ``epoch`` if it can be decided now, else None; the decision in force if someone else was faster.

        ``previous`` are the members of the epoch before, ``is_dead(member)`` the daemons' liveness verdict.
        ``fence``, when given, is the lineage token the deciders hold: the decision is written only while it is still
        the run's (a group that a newer round or epoch replaced can never decide again). ``fits(world_size)`` says
        whether the global batch splits over that many members: joiners are admitted only all together and only
        when it does (otherwise they wait, warm, for an epoch that has room). ``out(member)``: its node took it out
        of the group (convicted by a hang agreement, ``leave_group``): its bid, if any, does not count. Raises
        :class:`BelowMinimum` when every previous member is accounted for and fewer than ``min_members`` bid."""
        current = self.current()
        if current is not None and current[0].number >= epoch:
            return current[0]
        bids = self.bids(epoch)
        if previous:
            # only the members of the epoch before (and joiners): a bid left by a group of an earlier round for the
            # same epoch number (one that fell back to a cold restart) is no member of this one
            bids = {m: b for m, b in bids.items() if m in previous or b.old_rank is None}
        if any(m not in bids and not is_dead(m) for m in previous):
            return None  # a live member has not bid yet: wait for it (or for its daemon to declare it dead)
        bids = {m: b for m, b in bids.items() if not b.leaving}  # a leaver answered: it is not in the next epoch
        bids = {m: b for m, b in bids.items() if not out(m)}  # convicted: its node takes it out, bid or not
        # a joiner that died after its bid would hold up the new group's formation: leave it out
        joiners = {m for m, b in bids.items() if b.old_rank is None and m not in previous}
        dead_joiners = {m for m in joiners if is_dead(m)}
        bids = {m: b for m, b in bids.items() if m not in dead_joiners}
        if joiners - dead_joiners and fits is not None and not fits(len(bids)):
            bids = {m: b for m, b in bids.items() if m not in joiners}  # no room: they stay spares
        if len(bids) < min_members:
            raise BelowMinimum(epoch, bids, min_members)
        order = rank_order(bids.values())
        decision = Epoch(
            epoch,
            tuple(b.member for b in order),
            order[0].member,
            order[0].step,
            epoch_token(round_, epoch),
            reason,
        )
        revision = 0 if current is None else current[1]
        items: dict[str, bytes | str] = {
            self._keys.membership_epoch: decision.encode(),
            self._keys.lineage_token: decision.token,
        }
        if fence is None:
            written = self._client.put_all_if_revision(self._keys.membership_epoch, revision, items)
        else:
            written = self._client.put_all_if_revision_and_equal(
                self._keys.membership_epoch, revision, self._keys.lineage_token, fence, items
            )
        if written:
            return decision
        winner = self.current()
        return None if winner is None or winner[0].number < epoch else winner[0]

    def wait(self, epoch: int, timeout_s: float) -> Epoch | None:
        """The decision of ``epoch`` (or a later one) once it is made, or None after ``timeout_s``."""
        deadline = self._clock() + timeout_s
        while True:
            found, read_at = self._client.read_key(self._keys.membership_epoch)  # a later decision wakes the watch
            if found is not None and Epoch.decode(found[0]).number >= epoch:
                return Epoch.decode(found[0])
            remaining = deadline - self._clock()
            if remaining <= 0:
                return None
            self._client.wait_for_change(self._keys.membership_epoch, read_at + 1, remaining)

    def notify_group(self, text: str) -> bool:
        """Write the failure notice of the group training in place now (``membership/group``): its members fail
        their step with ``text`` within milliseconds, even inside a collective. False when no group trains so."""
        now = self._group_now()
        return now is not None and self._client.create(self._keys.membership_notice(*now), text)

    def leave_group(self, node_id: str) -> bool:
        """Take ``node_id``'s workers out of the group training in place now (``membership_out``), before they are
        killed for a hang they were convicted of; False when no group trains so."""
        now = self._group_now()
        if now is None:
            return False
        self._client.put(self._keys.membership_out(*now, node_id), node_id)
        return True

    def _group_now(self) -> tuple[str, int] | None:
        """The group training in place now (``membership/group``) and its epoch in force; None when none trains."""
        found = self._client.get(self._keys.membership_group)
        if found is None:
            return None
        current = self.current()
        return str(json.loads(found[0])["group"]), 0 if current is None else current[0].number

    def forget(self, epoch: int) -> int:
        """Remove the bids for ``epoch``; call once a later epoch is in force (nobody reads them any more)."""
        self._client.delete_prefix(self._keys.membership_joiners_prefix(epoch))
        return self._client.delete_prefix(self._keys.membership_bids_prefix(epoch))

    def count_bids(self, epoch: int) -> tuple[int, int]:
        """How many bids ``epoch`` has, and the revision they were counted at (:meth:`wait_for_bids` from it misses
        no bid written after): one small answer whatever the count."""
        return self._client.count_prefix_at(self._keys.membership_bids_prefix(epoch))

    def wait_for_bids(self, epoch: int, revision: int, timeout_s: float) -> bool:
        """Wait until a bid for ``epoch`` changes after ``revision`` (False: none did within ``timeout_s``)."""
        bids = self._keys.membership_bids_prefix(epoch)
        return self._client.wait_for_change(bids, revision + 1, timeout_s, prefix=True)


def bid_items(keys: RunKeys, epoch: int, bids: Collection[Bid]) -> dict[str, bytes | str]:
    """The keys of ``bids`` for ``epoch``, for one transaction: each bid, and a joiner's mark beside its bid
    (``membership_joiner``: what the members' failure watches count)."""
    items: dict[str, bytes | str] = {}
    for bid in bids:
        items[keys.membership_bid(epoch, bid.member)] = bid.encode()
        if bid.old_rank is None:
            items[keys.membership_joiner(epoch, bid.member)] = bid.member
    return items
