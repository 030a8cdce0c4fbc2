"""A heal's operations over one process group, each with a bounded wait that gives up when the epoch is abandoned.

gloo cannot cancel an operation, and a peer that hangs (or never comes) holds its partners until the group's timeout.
Every operation here is waited for on a thread of its own (:class:`_Waiter`) while the caller asks ``abandon()``
(the new epoch's failure notice, ``watch.py``) every :data:`ABANDON_POLL_S`: a member waiting on a live peer that
already gave up is released at once, and an operation given up on is held until it ends (``given_up.py``). Used by
the replicated heal (``heal.py``) and the sharded one (``shard_heal.py``).
"""

from __future__ import annotations

import pickle
import queue
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from elasticd.worker.hot.backend import collective_device
from elasticd.worker.hot.errors import HealAbandoned, HealError
from elasticd.worker.hot.given_up import GIVEN_UP
from elasticd.worker.hot.stripes import DESCRIPTION_TAG

# One operation of a heal may take this long before the member is given up on; a 600 MB state took 2.5 s on
# loopback gloo here, so this is far above a healthy transfer and far below the group's timeout.
DEFAULT_HEAL_TIMEOUT = timedelta(minutes=2)
# While a heal's operation waits on a peer, it looks this often (seconds) whether the epoch was given up elsewhere.
ABANDON_POLL_S = 0.05


class HealLink:
    """The heal's operations over one group, each with a bounded wait (``stripes.Link`` and the collectives)."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        source: int,
        timeout: timedelta,
        abandon: Callable[[], str | None] | None = None,
    ) -> None:
        # Operations on the group object (what dist.broadcast calls underneath): ranks are the group's own, and
        # the group need not be in torch's registry.
        self.group = group
        self.source = source
        self.timeout = timeout
        self.abandon = abandon
        self.device = collective_device(group)
        self._waiter = None if abandon is None else _Waiter(timeout)

    def wait(self, work: Any, what: str) -> None:
        if self._waiter is None or self.abandon is None:
            try:
                work.wait(self.timeout)
            except Exception as exc:
                GIVEN_UP.hold(work, self.group)  # timed out, it may still be pending: held until it has ended
                raise HealError(f"{what} failed: {exc}", source=self.source) from exc
            return
        finished, failures = self._waiter.submit(work)
        while not finished.wait(ABANDON_POLL_S):
            reason = self.abandon()
            if reason is not None:
                GIVEN_UP.hold(work, self.group)  # gloo cannot cancel it: held until it has ended (given_up.py)
                raise HealAbandoned(f"{what} was given up: {reason}", source=self.source)
        if failures:
            GIVEN_UP.hold(work, self.group)  # a wait that timed out leaves it pending: held until it has ended
            raise HealError(f"{what} failed: {failures[0]}", source=self.source) from failures[0]

    def close(self) -> None:
        if self._waiter is not None:
            self._waiter.close()

    def _issue(self, issue: Callable[[], Any], what: str) -> Any:
        try:
            return issue()
        except Exception as exc:
            raise HealError(f"{what} failed: {exc}", source=self.source) from exc

    def send(self, tensor: torch.Tensor, peer: int, tag: int, what: str) -> Any:
        return self._issue(lambda: self.group.send([tensor], peer, tag), what)

    def recv(self, tensor: torch.Tensor, peer: int, tag: int, what: str) -> Any:
        return self._issue(lambda: self.group.recv([tensor], peer, tag), what)

    def gather(self, value: torch.Tensor, what: str = "agreeing on the state's fingerprint") -> list[torch.Tensor]:
        """Every member's ``value`` (same shape everywhere), by rank."""
        mine = value.to(self.device)
        out = [torch.empty_like(mine) for _ in range(self.group.size())]
        self.wait(self._issue(lambda: self.group.allgather([out], [mine]), what), what)
        return [t.cpu() for t in out]

    def gather_objects(self, value: Any, what: str) -> list[Any]:
        """Every member's picklable ``value``, by rank: ``all_gather_object`` with this link's waits (the lengths,
        then the bytes padded to the longest; pickled as torch's own object collectives do, within one job)."""
        data = pickle.dumps(value)
        lengths = [int(n.item()) for n in self.gather(torch.tensor([len(data)], dtype=torch.int64), what)]
        mine = torch.zeros(max(lengths), dtype=torch.uint8)
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        blobs = self.gather(mine, what)
        return [pickle.loads(blob[:n].numpy().tobytes()) for blob, n in zip(blobs, lengths, strict=True)]

    def broadcast_object(self, value: Any, source: int, what: str) -> Any:
        """``source``'s picklable ``value`` on every member (the others pass anything), point to point."""
        if self.group.rank() == source:
            self.send_bytes(pickle.dumps(value), [r for r in range(self.group.size()) if r != source], what)
            return value
        return pickle.loads(self.recv_bytes(source, what))

    def send_bytes(self, data: bytes, receivers: Sequence[int], what: str = "sending the state's description") -> int:
        """Send ``data`` (its length first) to every receiver. Bytes sent."""
        size = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
        works = [self.send(size, r, DESCRIPTION_TAG, what) for r in receivers]
        works += [self.send(buffer, r, DESCRIPTION_TAG + 1, what) for r in receivers]
        for work in works:
            self.wait(work, what)
        return (len(data) + 8) * len(receivers)

    def recv_bytes(self, sender: int, what: str = "receiving the state's description") -> bytes:
        size = torch.empty(1, dtype=torch.int64, device=self.device)
        self.wait(self.recv(size, sender, DESCRIPTION_TAG, what), what)
        buffer = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        self.wait(self.recv(buffer, sender, DESCRIPTION_TAG + 1, what), what)
        return buffer.cpu().numpy().tobytes()

    def agree(self, problem: str, verdict: str) -> None:
        """Every member learns whether any member has a ``problem``; all raise together (``verdict``) if so."""
        what = f"agreeing on the heal ({verdict}?)"
        flag = torch.tensor([1 if problem else 0], dtype=torch.int32, device=self.device)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp(dist.ReduceOp.MAX)
        self.wait(self._issue(lambda: self.group.allreduce([flag], options), what), what)
        if flag.item():
            raise HealError(f"{verdict}: {problem or 'another member reported it'}", source=self.source)


class _Waiter:
    """Waits out the heal's operations one after the other on a thread of its own, while the heal's thread looks for
    a reason to give up (``_Link.wait``): gloo's point-to-point work has no future and no working ``is_completed()``,
    and a wait that times out closes the connection to the peer ("Application timeout caused pair closure"). The heal
    waits for its operations in the order it submits them, so one thread serves them all."""

    def __init__(self, timeout: timedelta) -> None:
        self._timeout = timeout
        self._jobs: queue.SimpleQueue[tuple[Any, threading.Event, list[Exception]] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, work: Any) -> tuple[threading.Event, list[Exception]]:
        """Wait for ``work``: the event is set when it completed or failed (then its error is in the list)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="elasticd-heal-wait", daemon=True)
            self._thread.start()
        finished, failures = threading.Event(), list[Exception]()
        self._jobs.put((work, finished, failures))
        return finished, failures

    def close(self) -> None:
        """The thread ends after the operation it waits for now, if any (one given up on: at its timeout)."""
        if self._thread is not None:
            self._jobs.put(None)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            work, finished, failures = job
            try:
                work.wait(self._timeout)
            except Exception as exc:
                failures.append(exc)
            finally:
                finished.set()
