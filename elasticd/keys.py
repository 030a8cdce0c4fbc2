"""The etcd key layout of a run (DESIGN.md §3), defined in one place.

Every key of a run lives under ``/elasticd/<run-id>/``; run ids are validated by :func:`validate_run_id` so that
they are safe both as an etcd key segment and as a directory name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

ROOT = "/elasticd"

# Letters, digits, '.', '_' and '-': safe as a path segment and an etcd key segment; no leading dot so a run
# id can never be "." or "..".
_RUN_ID = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}$")
_NODE_ID = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,252}$")


def validate_run_id(run_id: str) -> str | None:
    """Return why ``run_id`` is unusable, or None when it is fine."""
    if _RUN_ID.match(run_id):
        return None
    return "use 1-128 letters, digits, '.', '_' or '-' (not starting with '.')"


def validate_node_id(node_id: str) -> str | None:
    """Return why ``node_id`` is unusable, or None when it is fine."""
    if _NODE_ID.match(node_id):
        return None
    return "use 1-253 letters, digits, '.', '_' or '-' (not starting with '.')"


@dataclass(frozen=True, slots=True)
class RunKeys:
    """The keys of one run."""

    run_id: str

    @property
    def prefix(self) -> str:
        return f"{ROOT}/{self.run_id}/"

    @property
    def rdzv_state(self) -> str:
        """torch's pickled rendezvous state (written through compare-and-set)."""
        return f"{self.prefix}rdzv/state"

    @property
    def store_prefix(self) -> str:
        """The c10d store of the rendezvous; torch prefixes its own keys with the round below this."""
        return f"{self.prefix}rdzv/store/"

    @property
    def rdzv_alive_prefix(self) -> str:
        return f"{self.prefix}rdzv/alive/"

    def rdzv_alive(self, name: str) -> str:
        """A daemon's rendezvous name (torch's node descriptor, ``addr_pid_localid``) on its node's liveness lease
        (agent/node_lease.py): gone about a second after the daemon, so a re-forming round need not wait for its
        heartbeat in the rendezvous state to expire (rendezvous/lapsed.py)."""
        return f"{self.rdzv_alive_prefix}{name}"

    # The lease rendezvous of ``elasticd start`` (rendezvous/lease_handler.py). Its lobby is what every node follows
    # (one small record of the round and the nodes waiting for the next); a round's members are its joined keys.

    @property
    def rdzv_lobby_prefix(self) -> str:
        return f"{self.prefix}rdzv/lobby/"

    @property
    def rdzv_round(self) -> str:
        """The round in force: its number, open (taking joins) or formed, and whether the run's rendezvous is closed."""
        return f"{self.rdzv_lobby_prefix}round"

    @property
    def rdzv_decider(self) -> str:
        """Which node decides when the open round forms (its round and name), on that node's liveness lease."""
        return f"{self.rdzv_lobby_prefix}decider"

    @property
    def rdzv_waiting_prefix(self) -> str:
        return f"{self.rdzv_lobby_prefix}waiting/"

    def rdzv_waiting(self, name: str) -> str:
        """A node that came while a round trains and waits for the next one, on its node's liveness lease."""
        return f"{self.rdzv_waiting_prefix}{name}"

    @property
    def rdzv_joined_root(self) -> str:
        return f"{self.prefix}rdzv/joined/"

    def rdzv_joined_prefix(self, round_: int) -> str:
        return f"{self.rdzv_joined_root}{round_}/"

    def rdzv_joined(self, round_: int, name: str) -> str:
        """A node in round ``round_``, on its node's liveness lease: the round's members are these keys at the revision
        that closed it, and a member's rank is the number of keys before its own."""
        return f"{self.rdzv_joined_prefix(round_)}{name}"

    @property
    def nodes_prefix(self) -> str:
        return f"{self.prefix}nodes/"

    def node(self, node_id: str) -> str:
        return f"{self.nodes_prefix}{node_id}"

    @property
    def lineage_token(self) -> str:
        """The fencing token of the group allowed to commit checkpoints now (elasticd/lineage.py)."""
        return f"{self.prefix}lineage/token"

    @property
    def lineage_checkpoints_prefix(self) -> str:
        return f"{self.prefix}lineage/checkpoints/"

    def lineage_checkpoint(self, step: int) -> str:
        """The record of the committed checkpoint of ``step`` (zero-padded, so key order is step order)."""
        return f"{self.lineage_checkpoints_prefix}{step:012d}"

    @property
    def membership_epoch(self) -> str:
        """The current membership epoch of hot recovery (JSON, elasticd/membership.py)."""
        return f"{self.prefix}membership/epoch"

    def membership_bids_prefix(self, epoch: int) -> str:
        return f"{self.prefix}membership/bids/{epoch:012d}/"

    def membership_bid(self, epoch: int, member: str) -> str:
        """A member's bid to be in ``epoch`` (JSON: its old rank and committed step)."""
        return f"{self.membership_bids_prefix(epoch)}{member}"

    @property
    def membership_joiners_root(self) -> str:
        return f"{self.prefix}membership/joiners/"

    def membership_joiners_prefix(self, epoch: int) -> str:
        return f"{self.membership_joiners_root}{epoch:012d}/"

    def membership_joiner(self, epoch: int, member: str) -> str:
        """A joiner's bid for ``epoch`` is in (written after its bid): the members count these, never the bids, so that
        an epoch's N bids wake one decider instead of N watchers."""
        return f"{self.membership_joiners_prefix(epoch)}{member}"

    @property
    def membership_prefix(self) -> str:
        """Everything hot recovery's workers watch: epochs, bids, failure notices, members, node liveness."""
        return f"{self.prefix}membership/"

    def membership_notice(self, group: str, epoch: int) -> str:
        """A member of ``epoch`` of ``group`` (the round's first token) saw a step fail (its reason): releases members
        still waiting in a collective. Per group: a round that fell back cold leaves its notice behind."""
        return f"{self.membership_notices_prefix(group)}{epoch:012d}"

    def membership_notices_prefix(self, group: str) -> str:
        return f"{self.prefix}membership/notice/{group}/"

    def membership_out(self, group: str, epoch: int, node_id: str) -> str:
        """A node convicted by a hang agreement of ``epoch`` of ``group`` takes its workers out of it (written before
        it kills them): the others count them dead, reachable or not (a partition: they cannot be probed)."""
        return f"{self.membership_out_prefix(group, epoch)}{node_id}"

    def membership_out_prefix(self, group: str, epoch: int) -> str:
        return f"{self.prefix}membership/out/{group}/{epoch:012d}/"

    def membership_member(self, member: str) -> str:
        """Where a worker of the hot path answers liveness probes, and its node (JSON, liveness_probe.py)."""
        return f"{self.prefix}membership/members/{member}"

    @property
    def membership_alive_prefix(self) -> str:
        return f"{self.prefix}membership/alive/"

    def membership_alive(self, node_id: str) -> str:
        """A node's short liveness lease (about a second, agent/node_lease.py): gone = the node vanished."""
        return f"{self.membership_alive_prefix}{node_id}"

    @property
    def membership_leaving_prefix(self) -> str:
        return f"{self.prefix}membership/leaving/"

    def membership_leaving(self, node_id: str) -> str:
        """A node leaves on SIGTERM: its workers leave the group at a step boundary it agrees on (on the node's
        liveness lease, so it is gone with the daemon)."""
        return f"{self.membership_leaving_prefix}{node_id}"

    @property
    def membership_group(self) -> str:
        """The group that trains in place now: its name, round and members' node ids (JSON, written by its rank 0).
        A node that starts while it trains joins it in place instead of entering the rendezvous."""
        return f"{self.prefix}membership/group"

    def hot_group_store(self, round_: int, epoch: int) -> str:
        """The c10d store prefix of one epoch's process group (elasticd/rendezvous/store.py over etcd)."""
        return f"{self.prefix}hot/pg/{round_}/{epoch}/"

    @property
    def plan(self) -> str:
        """The batch constraint the workers reported (JSON): which node counts train (``agent/spares.py``)."""
        return f"{self.prefix}plan"

    @property
    def checkpoint_latest(self) -> str:
        return f"{self.prefix}checkpoint/latest"

    @property
    def control_prefix(self) -> str:
        return f"{self.prefix}control/"

    def control(self, name: str) -> str:
        return f"{self.control_prefix}{name}"

    @property
    def hang_prefix(self) -> str:
        """Hang diagnoses: ``hang/round-<n>/{claim,summary,nodes/<node>}`` and ``hang/last`` (repeat counting)."""
        return f"{self.prefix}hang/"

    def hang_round(self, round_: int) -> str:
        return f"{self.hang_prefix}round-{round_}/"

    @property
    def hang_last(self) -> str:
        return f"{self.hang_prefix}last"
