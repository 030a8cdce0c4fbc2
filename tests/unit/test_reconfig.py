"""Hot recovery's beats in the daemon: each in-place re-formation and each fallback to cold, counted once per node."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

from elasticd.agent.beats import BeatReceiver
from elasticd.agent.reconfig import Reconfigurations, fallback_label
from elasticd.logging import get_logger
from elasticd.messages import Kind
from elasticd.metrics import HOT_FALLBACK_REASONS, RECONFIGURATION_REASONS, Metrics
from elasticd.worker.beats import BeatClient

# Seconds a beat may take through a local datagram socket on a loaded machine.
BEAT_WAIT_S = 10.0


class Registry:
    """Records what would be merged into the node's registry record."""

    def __init__(self) -> None:
        self.record: dict[str, Any] = {}
        self.updates: list[dict[str, Any]] = []

    def update(self, **fields: Any) -> None:
        self.updates.append(fields)
        self.record.update(fields)


def make() -> tuple[Reconfigurations, CollectorRegistry, Registry]:
    prom = CollectorRegistry()
    registry = Registry()
    return Reconfigurations(Metrics.create(prom), registry.update, lambda: get_logger(node_id="n1")), prom, registry


def reconfigured(local_rank: int = 0, **fields: Any) -> dict[str, Any]:
    beat = {
        "kind": "reconfigured",
        "rank": local_rank,
        "local_rank": local_rank,
        "reason": "failure",
        "epoch": 4,
        "world_size": 6,
        "nodes": 3,
        "seconds": 0.14,
        "heal_bytes": 0,
        "lost_steps": 0,
        "token": "2.e4.00ff",
    }
    return beat | fields


def value(prom: CollectorRegistry, name: str, **labels: str) -> float | None:
    return prom.get_sample_value(name, labels)


def test_a_reconfiguration_counts_once_per_node_with_its_reason_duration_and_new_size() -> None:
    recon, prom, registry = make()
    with capture_logs() as logs:
        for local_rank in range(2):  # both local workers report the same change
            recon.on_beat(reconfigured(local_rank, reason="hang", seconds=1.1))
    assert value(prom, "elasticd_reconfigurations_total", reason="hang") == 1
    assert value(prom, "elasticd_reconfigurations_total", reason="failure") == 0
    assert value(prom, "elasticd_reconfiguration_duration_seconds_count") == 1
    assert value(prom, "elasticd_reconfiguration_duration_seconds_sum") == pytest.approx(1.1)
    assert value(prom, "elasticd_reconfiguration_duration_seconds_bucket", le="1.0") == 0
    assert value(prom, "elasticd_reconfiguration_duration_seconds_bucket", le="1.5") == 1
    assert value(prom, "elasticd_membership_epoch") == 4
    assert value(prom, "elasticd_world_size") == 6 and value(prom, "elasticd_nodes") == 3
    assert value(prom, "elasticd_lost_steps_total") == 0
    assert registry.updates == [{"epoch": 4, "world_size": 6, "nodes": 3}]
    assert [entry["event"] for entry in logs] == ["reconfigured"]
    entry = logs[0]
    assert entry["log_level"] == "info" and entry["node_id"] == "n1"
    assert {k: entry[k] for k in ("reason", "epoch", "world_size", "nodes", "seconds", "token", "rank")} == {
        "reason": "hang",
        "epoch": 4,
        "world_size": 6,
        "nodes": 3,
        "seconds": 1.1,
        "token": "2.e4.00ff",
        "rank": 0,
    }


def test_heal_bytes_add_every_local_workers_own_and_lost_steps_count_once() -> None:
    recon, prom, _ = make()
    recon.on_beat(reconfigured(0, reason="join", heal_bytes=1000, lost_steps=2))
    recon.on_beat(reconfigured(1, reason="join", heal_bytes=1500, lost_steps=2))
    assert value(prom, "elasticd_heal_bytes_total") == 2500
    assert value(prom, "elasticd_lost_steps_total") == 2
    assert value(prom, "elasticd_reconfigurations_total", reason="join") == 1


def test_successive_changes_move_the_epoch_and_the_size_both_ways() -> None:
    recon, prom, registry = make()
    recon.on_beat(reconfigured(reason="failure", epoch=2, world_size=2, nodes=2))
    recon.on_beat(reconfigured(reason="join", epoch=3, world_size=3, nodes=3))
    recon.on_beat(reconfigured(reason="leave", epoch=4, world_size=2, nodes=2))
    for reason, count in (("failure", 1), ("join", 1), ("leave", 1), ("hang", 0)):
        assert value(prom, "elasticd_reconfigurations_total", reason=reason) == count
    assert value(prom, "elasticd_membership_epoch") == 4
    assert value(prom, "elasticd_world_size") == 2
    assert registry.record == {"epoch": 4, "world_size": 2, "nodes": 2}


def test_a_fallback_counts_once_per_node_under_a_bounded_label_and_the_event_keeps_the_whole_reason() -> None:
    recon, prom, registry = make()
    with capture_logs() as logs:
        for local_rank in range(2):
            beat = {"kind": "hot_fallback", "rank": 4 + local_rank, "local_rank": local_rank}
            recon.on_beat(beat | {"reason": "unsupported:fsdp", "message": "hot recovery does not support FSDP"})
        recon.on_beat({"kind": "hot_fallback", "rank": 4, "local_rank": 0, "reason": "below_minimum", "message": "m"})
    assert value(prom, "elasticd_hot_fallbacks_total", reason="unsupported") == 1
    assert value(prom, "elasticd_hot_fallbacks_total", reason="below_minimum") == 1
    assert value(prom, "elasticd_reconfigurations_total", reason="failure") == 0
    assert registry.updates == []
    assert [(e["event"], e["log_level"], e["reason"], e["rank"]) for e in logs] == [
        ("hot_fallback", "warning", "unsupported:fsdp", 4),
        ("hot_fallback", "warning", "below_minimum", 4),
    ]
    assert logs[0]["message"] == "hot recovery does not support FSDP"


def test_fallback_labels_stay_within_the_known_values() -> None:
    assert fallback_label("reform_failed") == "reform_failed"
    assert fallback_label("unsupported:comm hook") == "unsupported"
    assert fallback_label("a reason from a newer worker: ENOSPC /x") == "other"
    assert fallback_label("None") == "other"
    for reason in ("reform_failed", "unsupported:x", "weird", "below_minimum"):
        assert fallback_label(reason) in HOT_FALLBACK_REASONS


def test_every_known_label_value_is_exported_at_zero_from_start_up() -> None:
    _, prom, _ = make()
    for reason in RECONFIGURATION_REASONS:
        assert value(prom, "elasticd_reconfigurations_total", reason=reason) == 0
    for reason in HOT_FALLBACK_REASONS:
        assert value(prom, "elasticd_hot_fallbacks_total", reason=reason) == 0
    assert value(prom, "elasticd_membership_epoch") == 0
    assert value(prom, "elasticd_heal_bytes_total") == 0


@pytest.mark.parametrize(
    "bad",
    [
        {"reason": "reboot"},
        {"epoch": "4"},
        {"epoch": True},
        {"epoch": -1},
        {"world_size": 6.5},
        {"seconds": float("nan")},
        {"seconds": float("inf")},
        {"seconds": -0.1},
        {"seconds": "0.1"},
        {"heal_bytes": 10**400},
        {"lost_steps": None},
        {"nodes": 0},
    ],
)
def test_a_malformed_field_is_left_out_of_the_figures_and_the_rest_still_counts(bad: dict[str, Any]) -> None:
    recon, prom, registry = make()
    with capture_logs() as logs:
        recon.on_beat(reconfigured(**bad))  # must not raise on the beat receiver's thread
    (key,) = bad
    assert [e["event"] for e in logs] == ["reconfigured"]
    assert value(prom, "elasticd_reconfigurations_total", reason="failure") == (0 if key == "reason" else 1)
    counted = {s.labels["reason"]: s.value for f in prom.collect() for s in f.samples if s.name.endswith("ions_total")}
    assert set(counted) == set(RECONFIGURATION_REASONS) and sum(counted.values()) == (0 if key == "reason" else 1)
    assert value(prom, "elasticd_reconfiguration_duration_seconds_count") == (0 if key == "seconds" else 1)
    assert value(prom, "elasticd_reconfiguration_duration_seconds_sum") == (0 if key == "seconds" else 0.14)
    assert value(prom, "elasticd_heal_bytes_total") == 0
    assert value(prom, "elasticd_lost_steps_total") == 0
    assert value(prom, "elasticd_membership_epoch") == (0 if key == "epoch" else 4)
    fields = {"epoch", "world_size", "nodes"}
    assert set(registry.record) == fields - {key}


def test_other_beats_are_ignored() -> None:
    recon, prom, registry = make()
    with capture_logs() as logs:
        recon.on_beat({"kind": "step", "rank": 0, "local_rank": 0, "step": 3, "epoch": 9, "heal_bytes": 5})
        recon.on_beat({"kind": "resumed", "rank": 0, "local_rank": 0, "step": 3, "epoch": 1})
    assert logs == [] and registry.updates == []
    assert value(prom, "elasticd_membership_epoch") == 0 and value(prom, "elasticd_heal_bytes_total") == 0


def test_a_workers_beats_reach_the_counts_through_the_real_beat_socket(tmp_path: Path) -> None:
    recon, prom, registry = make()
    receiver = BeatReceiver(str(tmp_path / "b.sock"), on_beat=recon.on_beat)
    workers: list[BeatClient] = []
    try:
        workers += [BeatClient(receiver.path, rank=2 + i, local_rank=i) for i in range(2)]
        for worker in workers:
            fields = reconfigured(worker.local_rank, heal_bytes=10)
            for key in ("kind", "rank", "local_rank"):
                fields.pop(key)
            assert worker.send(Kind.RECONFIGURED, **fields)
            assert worker.send(Kind.HOT_FALLBACK, reason="reform_failed", message="peer died during the re-formation")
        deadline = time.monotonic() + BEAT_WAIT_S
        while value(prom, "elasticd_heal_bytes_total") != 20 and time.monotonic() < deadline:
            time.sleep(0.01)
        while value(prom, "elasticd_hot_fallbacks_total", reason="reform_failed") != 1 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        receiver.close()
        for worker in workers:
            worker.close()
    assert value(prom, "elasticd_heal_bytes_total") == 20
    assert value(prom, "elasticd_reconfigurations_total", reason="failure") == 1
    assert value(prom, "elasticd_hot_fallbacks_total", reason="reform_failed") == 1
    assert registry.record == {"epoch": 4, "world_size": 6, "nodes": 3}


def test_each_change_is_noted_once_per_node_for_the_live_view() -> None:
    notes: list[tuple[str, dict[str, Any]]] = []
    reconfigurations = Reconfigurations(
        Metrics.create(CollectorRegistry()),
        Registry().update,
        lambda: get_logger(node_id="n1"),
        note=lambda kind, **fields: notes.append((kind, fields)),
    )
    reconfigurations.on_beat(reconfigured(lost_nodes=["n3"]))
    reconfigurations.on_beat(reconfigured(local_rank=1, lost_nodes=["n3"]))  # the same change, seen by another rank
    reconfigurations.on_beat({"kind": "hot_fallback", "local_rank": 0, "reason": "reform_failed", "message": "m"})
    assert notes == [
        ("reformed", {"reason": "failure", "seconds": 0.14, "world_size": 6, "lost_nodes": ["n3"]}),
        ("fallback", {"reason": "reform_failed"}),
    ]
