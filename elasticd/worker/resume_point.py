"""Which committed checkpoint the ranks load, and which writers' directories are left over to remove.

Under a daemon only what the run's lineage in etcd records is ever loaded (DESIGN.md §3): the newest recorded
checkpoint that verifies, else the one before it. Without a daemon, or when etcd cannot be read, the newest verified
committed directory on disk (only recorded commits are ever renamed to ``step-N``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from accelerate.utils import broadcast_object_list

from elasticd.worker.checkpoints import Checkpoint, CheckpointStore
from elasticd.worker.fence import EtcdFence
from elasticd.worker.saver import ABANDONED


def choose(
    accelerator: Any,
    store: CheckpointStore,
    fence: EtcdFence | None,
    world_size: int,
    log: Any,
    on_bad: Callable[[Checkpoint, str], None],
) -> Checkpoint | None:
    """The checkpoint every rank loads: chosen once, by rank 0, and broadcast (a collective call). Each file is
    hashed once, by rank 0, not by every rank."""
    chosen: list[Any] = [None]
    if accelerator.is_main_process:
        records = fence.records() if fence is not None else None
        if fence is not None and records is None:
            log.warning("lineage_unavailable", fallback="newest verified checkpoint on disk")
        found = store.latest_loadable(on_bad=on_bad) if records is None else store.resolve(records, on_bad=on_bad)
        chosen[0] = None if found is None else (found.step, str(found.path))
    if world_size > 1:
        chosen = broadcast_object_list(chosen, from_process=0)
    return None if chosen[0] is None else Checkpoint(int(chosen[0][0]), Path(chosen[0][1]))


def remove_partials(store: CheckpointStore, fence: EtcdFence | None) -> list[Path]:
    """Rank 0: other writers' directories go, except a recorded commit not yet rolled forward; the directories
    removed (none when etcd is unreadable: a recorded commit may need its directory, so all stay)."""
    records = fence.records() if fence is not None else []
    if records is None:
        return []
    return store.remove_partials(keep=frozenset(r.partial for r in records))


def sweep_lost_writers(store: CheckpointStore, fence: EtcdFence | None, log: Any) -> None:
    """Rank 0, after a re-formation in place, once every member's earlier background write has ended: what is left
    was written by a group member that was lost (its rank 0 died before it could commit or give up)."""
    for path in remove_partials(store, fence):
        log.warning(ABANDONED, path=str(path), reason="its writer was lost when the group re-formed in place")
