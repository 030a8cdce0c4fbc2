"""This node's worker group as torch's agent keeps it: the one module that reads torch's private agent state.

torch's ``LocalElasticAgent`` holds the group (``_worker_group``), its processes (``_pcontext``) and the restart
budget (``_remaining_restarts``) in private attributes, and starts, watches and stops the group through private
methods (``_initialize_workers``, ``_monitor_workers``, ``_stop_workers``, ``_restart_workers``,
``_exit_barrier``). Everything else in elasticd goes through :class:`LocalWorkers`, so a torch upgrade that renames
one of them breaks here and nowhere else. The methods are called on the agent, so our overrides of them
(``supervisor.ElasticdAgent``) still apply.

Waiting is injected too: one ``clock`` and one ``sleep`` for every wait of the loop, so a test waits on a fake.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from typing import TypeVar

from torch.distributed.elastic.agent.server.api import RunResult, Worker, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

T = TypeVar("T")

# Seconds between two looks while waiting on the workers (a checkpoint, a leave in place): a board read or a poll of
# the processes' exit codes, cheap enough to look often.
WAIT_INTERVAL_S = 0.05


class LocalWorkers:
    """Start, watch, signal and stop the local workers of ``agent``; wait on them with one clock and sleep."""

    def __init__(
        self,
        agent: LocalElasticAgent,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._agent = agent
        self.clock = clock
        self.sleep = sleep

    @property
    def group(self) -> WorkerGroup:
        return self._agent._worker_group

    @property
    def workers(self) -> list[Worker]:
        return list(self.group.workers)

    def pids(self) -> dict[int, int]:
        """local rank -> pid of the processes running now (none for a spare, or before the first start)."""
        pcontext = self._agent._pcontext
        return dict(pcontext.pids()) if pcontext is not None else {}

    def forget_processes(self) -> None:
        """No processes this round (a spare): nothing for torch to watch or stop."""
        self._agent._pcontext = None

    # -- the group's lifecycle, through the agent (and so through our overrides) ------------------------------------

    def initialize(self) -> None:
        """Rendezvous, then start the workers."""
        self._agent._initialize_workers(self.group)

    def poll(self) -> WorkerState:
        """The workers' state now, not recorded on the group (a wait looks without deciding)."""
        return self._agent._monitor_workers(self.group).state

    def monitor(self) -> RunResult:
        """The workers' state now, recorded on the group as torch's own loop does."""
        result = self._agent._monitor_workers(self.group)
        self.group.state = result.state
        return result

    def restart(self) -> None:
        """Stop the workers, go through the rendezvous again, start them."""
        self._agent._restart_workers(self.group)

    def stop(self, state: WorkerState) -> None:
        """Stop the workers for good; the group ends in ``state``."""
        self._agent._stop_workers(self.group)
        self.group.state = state

    def exit_barrier(self) -> None:
        """Wait for the round's other agents to finish too (torch's exit barrier)."""
        self._agent._exit_barrier()

    @property
    def restarts_left(self) -> int:
        return int(self._agent._remaining_restarts)

    def count_restart(self) -> None:
        """One of ``--max-restarts`` is spent."""
        self._agent._remaining_restarts -= 1

    # -- signals ----------------------------------------------------------------------------------------------------

    def signal_all(self, sig: signal.Signals) -> None:
        """Send ``sig`` to each worker process (one that exited meanwhile is no error)."""
        for pid in self.pids().values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def kill(self) -> None:
        """SIGKILL each worker's process group: a stopped or wedged process ignores the polite signals."""
        own_group = os.getpgid(0)
        for pid in self.pids().values():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                group = os.getpgid(pid)
                if group != own_group:  # torch starts each worker in its own session; never signal our own group
                    os.killpg(group, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    # -- waits ------------------------------------------------------------------------------------------------------

    def pause(self) -> None:
        """One monitor interval (``--monitor-interval``) between two steps of the loop."""
        self.sleep(self.group.spec.monitor_interval)

    def wait_for(self, answer: Callable[[], T | None], timeout_s: float) -> T | None:
        """``answer()`` every :data:`WAIT_INTERVAL_S` until it is not None or ``timeout_s`` passed (then None)."""
        deadline = self.clock() + timeout_s
        while self.clock() < deadline:
            found = answer()
            if found is not None:
                return found
            self.sleep(WAIT_INTERVAL_S)
        return None
