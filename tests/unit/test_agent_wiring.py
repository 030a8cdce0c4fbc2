"""``ElasticdAgent`` built as the daemon builds it (a real torch ``WorkerSpec``, a real registry record, real metrics),
with no process, no etcd and no socket: torch's own start, stop and monitor are replaced by recorders, so what runs
is the agent's wiring, from a beat on the receiver's thread to the loop's outcome.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, cast

import pytest
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerSpec, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.rendezvous import RendezvousHandler

from elasticd.agent.controller import NodeState, Outcome
from elasticd.agent.registry import NodeRegistry
from elasticd.agent.supervisor import ElasticdAgent
from elasticd.etcd.client import EtcdClient
from elasticd.keys import RunKeys
from elasticd.messages import KIND, LOCAL_RANK, RANK, Kind
from elasticd.metrics import Metrics

MONITOR_INTERVAL_S = 0.25


class Handler:
    """The rendezvous as far as the agent asks it outside a rendezvous: who waits for the next round."""

    def num_nodes_waiting(self) -> int:
        return 0


class Torch:
    """Records what torch's own agent was asked to do, and answers the monitor with ``state``."""

    def __init__(self) -> None:
        self.state = WorkerState.HEALTHY
        self.calls: list[str] = []

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        def record(name: str, answer: Any = None) -> Any:
            def call(_agent: LocalElasticAgent, *_args: Any) -> Any:
                self.calls.append(name)
                return answer() if callable(answer) else answer

            return call

        monkeypatch.setattr(LocalElasticAgent, "_initialize_workers", record("initialize"))
        monkeypatch.setattr(LocalElasticAgent, "_monitor_workers", record("monitor", lambda: RunResult(self.state)))
        monkeypatch.setattr(LocalElasticAgent, "_stop_workers", record("stop"))
        monkeypatch.setattr(LocalElasticAgent, "_exit_barrier", record("exit_barrier"))


@pytest.fixture
def torch_agent(monkeypatch: pytest.MonkeyPatch) -> Torch:
    torch = Torch()
    torch.install(monkeypatch)
    return torch


def build(tmp_path: Path, *, drain: bool = False) -> tuple[ElasticdAgent, Metrics, list[float], NodeRegistry]:
    spec = WorkerSpec(
        role="default",
        local_world_size=2,
        entrypoint=sys.executable,
        args=("train.py",),
        rdzv_handler=cast(RendezvousHandler, Handler()),
        max_restarts=3,
        monitor_interval=MONITOR_INTERVAL_S,
    )
    metrics = Metrics.create()
    # an unclaimed record: updates stay in memory, the client is never used
    registry = NodeRegistry(cast(EtcdClient, None), RunKeys("run"), "n0")
    sleeps: list[float] = []
    agent = ElasticdAgent(
        spec=spec,
        logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path / "logs")),
        run_id="run",
        node_id="n0",
        metrics=metrics,
        registry=registry,
        drain_requested=lambda: drain,
        clock=lambda: 100.0,
        sleep=sleeps.append,
    )
    return agent, metrics, sleeps, registry


def beat(kind: Kind, *, rank: int, local_rank: int, **fields: Any) -> dict[str, Any]:
    return {KIND: kind, RANK: rank, LOCAL_RANK: local_rank, "ts": 1.0, **fields}


def test_a_reconfigured_beat_moves_the_round_every_part_reads(tmp_path: Path, torch_agent: Torch) -> None:
    agent, _, _, _ = build(tmp_path)
    agent.round_state.start(4, ["n0", "n1", "n2"], "4.abc", "4.abc")
    agent.on_beat(
        beat(Kind.RECONFIGURED, rank=3, local_rank=1, epoch=2, token="4.def", node_ids=["n0", "n2"], reason="lost")
    )
    rounds = agent.round_state
    assert (rounds.members, rounds.token, rounds.epoch, rounds.rank_of(1, 5)) == (["n0", "n2"], "4.def", 2, 3)
    assert rounds.rank_of(0, 1) == 1  # no beat from local rank 0 yet: the round's rank
    assert not agent.run_view.waiting_to_join()
    # the loop's finish goes through the agent's own exit barrier, which skips torch's once the group re-formed
    agent.group.finish()
    assert "exit_barrier" not in torch_agent.calls


def test_the_loop_waits_one_monitor_interval_per_step_and_returns_its_outcome(
    tmp_path: Path, torch_agent: Torch
) -> None:
    agent, _, sleeps, registry = build(tmp_path)
    torch_agent.state = WorkerState.SUCCEEDED
    outcome = agent._invoke_run()
    assert isinstance(outcome, Outcome)
    assert (outcome.node_state, outcome.exit_code, outcome.leaves) == (NodeState.FINISHED, 0, False)
    assert sleeps == [MONITOR_INTERVAL_S]
    assert torch_agent.calls == ["initialize", "monitor", "exit_barrier"]
    assert registry.record["state"] == NodeState.FINISHED.value


def test_a_drain_stops_torch_s_workers_and_ends_in_a_drained_outcome(tmp_path: Path, torch_agent: Torch) -> None:
    agent, metrics, _, _ = build(tmp_path, drain=True)
    outcome = agent._invoke_run()
    assert isinstance(outcome, Outcome)
    assert (outcome.node_state, outcome.leaves, outcome.state) == (NodeState.DRAINING, False, WorkerState.SUCCEEDED)
    assert torch_agent.calls == ["initialize", "monitor", "stop"]
    assert agent.workers.group.state is WorkerState.STOPPED
    restarts = metrics.registry.get_sample_value("elasticd_worker_restarts_total", {"reason": "drain"})
    assert restarts == 1.0


def test_the_agent_s_workers_are_torch_s_worker_group(tmp_path: Path, torch_agent: Torch) -> None:
    agent, _, _, _ = build(tmp_path)
    group: WorkerGroup = agent.get_worker_group()
    assert agent.workers.group is group
    assert agent.workers.restarts_left == 3
    agent.workers.count_restart()
    assert agent.workers.restarts_left == 2
    assert agent.workers.pids() == {}  # nothing started: no processes to signal or kill
